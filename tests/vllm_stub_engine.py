"""A stand-in for vLLM's AsyncLLM with known routed experts (tests/vllm/test_vllm_routes.py): the REAL
worker (scalerl_jax/generation/vllm/worker.py, in .venv-vllm) drives it through `engine_factory`.

Decoding is deterministic (token i of a request = a hash of its seed and i, never a stop or
end-of-thinking token). `routed_experts` follow vLLM 0.32's contract: one row per position whose
forward ran, from `routed_experts_prompt_start` to num_tokens − 1 (the last sampled token has
none), every engine layer (dense layers carry 999, out of range: a wrong layer map is caught),
and `route(...)` below gives each row: the prefill rows of a request differ from decode rows of
the same (token, position), so a test can tell which request produced a thinking token's route.
"""
from __future__ import annotations

import os
import sys
import types

import numpy as np

DENSE = 999


def route(token: int, pos: int, layer: int, k: int, experts: int, prefill: bool) -> list[int]:
  """The K distinct experts of (token, position, layer); `prefill`: a prompt position."""
  base = (token * 31 + pos * 7 + layer * 3 + (13 if prefill else 0)) % experts
  return [(base + j) % experts for j in range(k)]


class StubEngine:
  """The AsyncLLM methods the worker calls, with `routed_experts` on every output."""

  def __init__(self, cfg: dict):
    a = cfg["engine_args"]
    self.layers, self.k, self.experts = int(a["layers"]), int(a["k"]), int(a["experts"])
    self.vocab, self.avoid = int(a["vocab"]), set(a.get("avoid", ()))
    self.moe = set(cfg["route_layers"] or ())
    self.version = "0"
    # One line on each stream: tests/vllm/test_vllm_logs.py finds the engine's own output in its log.
    print(f"stub engine up: pid {os.getpid()} (stdout)", flush=True)
    print(f"stub engine up: pid {os.getpid()} (stderr)", file=sys.stderr, flush=True)

  async def collective_rpc(self, method, args=()):
    return [{"stub": True, "method": method}]

  async def update_weight_version(self, v):
    self.version = v

  def shutdown(self):
    pass

  def _rows(self, seq: list[int], prompt_len: int, start: int) -> np.ndarray:
    rows = np.full((max(0, len(seq) - 1 - start), self.layers, self.k), DENSE, np.int64)
    for p in range(start, len(seq) - 1):
      for l in range(self.layers):
        if l in self.moe:
          rows[p - start, l] = route(seq[p], p, l, self.k, self.experts, p < prompt_len)
    return rows

  async def generate(self, prompt: dict, sp, request_id: str):
    ids = list(prompt["prompt_token_ids"])
    rng = np.random.default_rng([int(sp.seed), len(ids)])
    out: list[int] = []
    while len(out) < sp.max_tokens:
      t = int(rng.integers(0, self.vocab))
      if t not in self.avoid:
        out.append(t)
    start = int(getattr(sp, "routed_experts_prompt_start", 0))
    comp = types.SimpleNamespace(
        token_ids=out, logprobs=[{t: types.SimpleNamespace(logprob=-1.0)} for t in out],
        finish_reason="length", weight_versions=None,
        routed_experts=self._rows(ids + out, len(ids), start))
    yield types.SimpleNamespace(outputs=[comp])
