"""The generator worker's side of the evaluation lane (docs/ROLLOUT.md "Evaluation through the
fleet"; the buffer's side is buffer/eval_lane.py).

`EvalLane` is a base of `Worker` (generation/worker.py). It keeps the params of the last
`generator.eval_hold_versions` fetched versions plus every version an open evaluation pins
(`held_versions()` goes with every lease and heartbeat), and serves an evaluation lease
(`serve_eval`): samples the groups with exactly the pinned version (a continuous JAX generator
through `generator.eval_decode_batch` slots: `_eval_sample`), grades them with the prompt's task
verifier (no length penalty) and pushes per-group rewards with the device-seconds spent. It
works on the Worker's fields: `_held`, `_pins`, `_held_lock` and `hold_n` (set up by its
constructor), `_swap_lock` (shared with the weight watcher), `engine`, `gen`, `model_cfg`,
`dataset`, `client`, `config`, `id`, and its `_abandon`.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import TYPE_CHECKING

import grpc

from scalerl_jax.generation import interruption
from scalerl_jax import rewards
from scalerl_jax.generation.slots import drive
from scalerl_jax.generation.slots import requests_for
from scalerl_jax.generation.worker_fields import WorkerFields
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.client import assignment_prompt

log = logging.getLogger("scalerl.worker")


class EvalLane(WorkerFields):
  """Retained versions and evaluation leases of a Worker (module docstring)."""

  # The Worker's other fields and methods this base works on (declared for the type checker).
  hold_n: int
  _held: collections.OrderedDict
  _pins: set
  _held_lock: threading.Lock
  _swap_lock: threading.Lock

  if TYPE_CHECKING:
    def _abandon(self) -> None: ...
    def continuous_ok(self) -> str: ...

  def _remember(self, version: int, params) -> None:
    """Retains a fetched version's params (streamed fetches are fresh arrays: a reference)."""
    with self._held_lock:
      self._held[int(version)] = params
      self._evict()

  def _evict(self) -> None:
    """Keeps the newest `hold_n` versions and every pinned one (call with _held_lock held)."""
    keep = set(sorted(self._held)[-self.hold_n:]) | self._pins
    for v in [v for v in self._held if v not in keep]:
      del self._held[v]

  def held_versions(self) -> list[int]:
    with self._held_lock:
      return sorted(self._held)

  def _set_pins(self, versions) -> None:
    with self._held_lock:
      self._pins = {int(v) for v in versions}
      self._evict()

  def _eval_generator(self, version: int, params):
    """The generator an evaluation of `version` samples with. An engine with `separate_eval`
    (JAX): a second generator on the retained params for this lease only (the training
    generator's state and pending swaps are untouched; its copy of the pinned params is dropped
    after the lease); other engines: the one engine, switched to `version` (the caller holds
    _swap_lock)."""
    if self.engine.separate_eval:
      return self.engine.eval_generator(self.model_cfg, params, version)
    self.gen.max_version = version
    if self.gen.version != version:
      self.gen.load_params(params, version, self.model_cfg)
      self.gen.apply_pending()
    return self.gen

  def _eval_sample(self, gen, prompts, n: int, spec) -> list:
    """One group of `n` completions per prompt, sampled by `gen` (the pinned version). A
    continuous generator whose engine samples evaluations in a second generator (JAX) decodes them
    through `generator.eval_decode_batch` slots refilled as samples end: the lease's samples end at
    lengths up to 1:12 apart, and one static batch of them all idles most of its rows (measured
    on the tiny lengths task: 1.5 s vs 3.0 s for 64 prompts x 16). Other engines, a drain generator
    and `eval_decode_batch` 0 sample the lease as one batch (`generate`; vLLM's engine batches
    its requests continuously itself). "Continuous" is the worker's own verdict (`continuous_ok`:
    a worker that fell back to the drain loop evaluates as the drain loop does). Each sample draws
    its own random stream in either path (generation/continuous.py), so the two paths sample the
    same distribution, not the same tokens."""
    cap = int(self.config.generator.eval_decode_batch)
    if not cap or not self.engine.separate_eval or self.continuous_ok():
      return gen.generate(prompts, n, spec)
    groups: list[list] = [[None] * n for _ in prompts]
    for req, completion in drive(self.engine.continuous(gen, spec, cap), requests_for(prompts, n, spec)):
      groups[req.tag][req.sample_index] = completion
    return groups

  def serve_eval(self, assignments) -> int:
    """Samples, grades and reports evaluation groups (all pinned to one version); returns the
    number of groups reported."""
    a0 = assignments[0]
    v = int(a0.min_version)
    with self._held_lock:
      params = self._held.get(v)
    if params is None:      # evicted between the lease request and now: let the leases expire
      log.warning("%s: evaluation pinned to version %d, which this worker no longer holds",
                  self.id, v)
      self._abandon()
      return 0
    prompts = [assignment_prompt(a) for a in assignments]
    spec = interruption.sampling_spec(self.config, self.dataset, seed=int(a0.eval_seed + a0.group_id),
                                 temperature=float(a0.temperature), top_p=float(a0.top_p))
    swap = not self.engine.separate_eval
    if swap:
      self._swap_lock.acquire()
    try:
      gen = self._eval_generator(v, params)
      t0 = time.time()
      groups = self._eval_sample(gen, prompts, int(a0.group_size), spec)
      dt = time.time() - t0
    finally:
      if swap:
        newest = max(self.held_versions(), default=v)
        with self._held_lock:
          back = self._held.get(newest)
        self.gen.max_version = None
        if newest != v and back is not None:
          self.gen.load_params(back, newest, self.model_cfg)
        self._swap_lock.release()
    devices = self.engine.devices()
    results = []
    for a, group in zip(assignments, groups):
      bad = [c for c in group if len(c.versions) and (c.versions != v).any()]
      if bad:
        raise RuntimeError(f"evaluation pinned to version {v} sampled tokens of versions "
                           f"{sorted(set(bad[0].versions.tolist()))}")
      rewards_ = []
      for c in group:
        g = self.dataset.grade(c.tokens, a.answer, a.task)
        if g.reason == "sandbox_error":
          rewards.sandbox_still_works(g.detail)
        rewards_.append(float(g.reward))
      results.append(pb.EvalGroupResult(
          eval_id=a.eval_id, group_id=a.group_id, prompt_id=a.prompt_id, rewards=rewards_,
          lengths=[len(c.tokens) for c in group],
          finish_reasons=[codec.FINISH_TO_PB[c.finish_reason] for c in group],
          generator_id=self.id, device_seconds=dt * devices / len(assignments), version=v))
    try:
      self.client.push_eval(results)
    except grpc.RpcError as e:   # e.g. the evaluation was cancelled or lost in a buffer restart
      log.warning("%s: evaluation results rejected (%s: %s)", self.id, e.code(), e.details())
      return 0
    return len(results)
