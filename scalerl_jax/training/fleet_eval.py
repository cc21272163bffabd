"""Held-out evaluation through the generator fleet (the learner side; no JAX).

`eval.mode=fleet` (docs/ROLLOUT.md "Evaluation through the fleet"): at an evaluation step the
learner submits the held-out prompts (`eval_prompts`: `eval.num_prompts` of them, each sampled
`eval.samples_per_prompt` times) to the buffer's evaluation lane, pinned to the version it just
published. Generators holding that version lease the groups ahead of training groups, sample them
with that version only, grade them and push per-group rewards (no tokens). The learner collects
the rewards: it never gathers parameters and never allocates a KV cache for evaluation.

`FleetEvaluator` keeps the open evaluations in submission order. The trainer polls it after every
step and writes an evaluation line when the oldest completes, with the compute-axis snapshot taken
when its version was published (the x-axis value of that policy); it waits for them before a
checkpoint and at the end (`drain`), and before publishing a version that would push a pinned one
out of the generators' retained weights (`wait_held`). An evaluation the buffer reports
`unservable` (its version superseded and held by no live generator: every generator that had it
restarted, or none fetched it) is dropped at once as an `eval_failed` line, like one still open
after `eval.timeout_s`; before, it stalled training until that timeout (30 min by default).

`summarize` turns per-prompt rewards into the evaluation metrics, for both modes (mean@n as
`val_pass_rate`, pass@n, lengths, interruptions, per-task rates of a mixture).
"""
from __future__ import annotations

import dataclasses
import logging
import resource
import time
from typing import Callable, Optional, Sequence

import grpc
import numpy as np

from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb

log = logging.getLogger("scalerl.eval")

_INTERRUPTED = pb.FINISH_INTERRUPTED


def eval_prompts(heldout: Sequence, num_prompts: int, seed: int = 0) -> list:
  """The prompts one evaluation uses: the whole held-out split for `num_prompts` 0 (or equal to
  its size), else a seeded subset of that size in split order (the same at every evaluation, so
  the curve follows fixed prompts). A mixture keeps its tasks' proportions in expectation."""
  held = list(heldout)
  n = int(num_prompts)
  if n < 0 or n > len(held):
    raise ValueError(f"eval.num_prompts={n} but the held-out split has {len(held)} prompts "
                     f"(0 = all of them)")
  if n in (0, len(held)):
    return held
  idx = np.sort(np.random.default_rng([int(seed), 0xE7A1]).choice(len(held), n, replace=False))
  return [held[i] for i in idx]


def summarize(tasks: Sequence[str], rewards: Sequence[Sequence[float]],
              lengths: Sequence[Sequence[int]], interrupted: Sequence[Sequence[bool]],
              task_names: Sequence[str] = ()) -> dict:
  """Evaluation metrics from per-prompt samples: `val_pass_rate` (mean@n: the mean reward over all
  prompts x samples), `val_pass_at_n` (prompts with a sample of reward >= 1, i.e. solved),
  `val_len`, `val_interrupted`, `val_samples`, `val_prompts`; with `task_names` (a mixture),
  `val_pass_rate/<task>` and `val_samples/<task>`."""
  r = np.concatenate([np.asarray(x, np.float64) for x in rewards])
  out = {"val_pass_rate": float(r.mean()),
         "val_pass_at_n": float(np.mean([np.max(x) >= 1.0 - 1e-6 for x in rewards])),
         "val_len": float(np.mean(np.concatenate([np.asarray(x, np.float64) for x in lengths]))),
         "val_interrupted": float(np.mean(np.concatenate(
             [np.asarray(x, bool) for x in interrupted]))),
         "val_samples": int(r.size), "val_prompts": len(rewards)}
  if task_names:
    t = np.concatenate([[task] * len(x) for task, x in zip(tasks, rewards)])
    for name in task_names:
      if (t == name).any():
        out[f"val_pass_rate/{name}"] = float(r[t == name].mean())
        out[f"val_samples/{name}"] = int((t == name).sum())
  return out


def summarize_results(results: Sequence[pb.EvalGroupResult], tasks: Sequence[str],
                      task_names: Sequence[str] = ()) -> dict:
  """`summarize` of a complete fleet evaluation (results in group order, tasks per group)."""
  return summarize(tasks, [list(g.rewards) for g in results], [list(g.lengths) for g in results],
                   [[f == _INTERRUPTED for f in g.finish_reasons] for g in results], task_names)


def peak_rss_mb() -> float:
  """This process's peak resident set size so far (MB; Linux ru_maxrss is in KiB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@dataclasses.dataclass
class _Open:
  eval_id: int
  step: int
  version: int
  request: pb.EvalRequest
  tasks: list
  snapshot: dict                  # the ledger at submission (the policy's compute-axis value)
  submitted: float
  resubmitted: int = 0
  failed: str = ""                # why it was dropped ("timeout", "unservable"), "" if it was not


class FleetEvaluator:
  """The learner's side of the evaluation lane (module docstring). `client`: a BufferClient."""

  def __init__(self, client, heldout: Sequence, *, num_prompts: int, samples_per_prompt: int,
               seed: int, temperature: float, top_p: float, hold_versions: int = 2,
               timeout_s: float, task_names: Sequence[str] = (),
               watchdog: Optional[Callable[[], None]] = None):
    self.client = client
    self.prompts = eval_prompts(heldout, num_prompts, seed)
    self.samples, self.seed = int(samples_per_prompt), int(seed)
    self.temperature, self.top_p = float(temperature), float(top_p)
    self.hold_versions, self.timeout_s = int(hold_versions), float(timeout_s)
    self.task_names = tuple(task_names)
    self.watchdog = watchdog
    self.open: list[_Open] = []
    # Eval ids: unique per learner process start (a resumed learner never reuses a dead one's).
    self._next_id = (int(time.time() * 1000) % (1 << 40)) << 16
    # The request's prompt part, encoded once (the same prompts at every evaluation).
    self._prompt_msgs = [pb.EvalPrompt(prompt_id=int(p.prompt_id),
                                       prompt_tokens=codec.encode(p.tokens, pb.INT32),
                                       answer=p.answer, task=p.task) for p in self.prompts]

  def submit(self, step: int, version: int, snapshot: dict) -> int:
    """Opens an evaluation of `version` (published already) for evaluation step `step`."""
    self._next_id += 1
    req = pb.EvalRequest(eval_id=self._next_id, version=int(version),
                         samples_per_prompt=self.samples, seed=self.seed,   # as local eval
                         temperature=self.temperature, top_p=self.top_p,
                         prompts=self._prompt_msgs)
    self.client.submit_eval(req)
    self.open.append(_Open(req.eval_id, int(step), int(version), req,
                           [p.task for p in self.prompts], dict(snapshot), time.time()))
    return req.eval_id

  def _collect(self, e: _Open, timeout_s: float) -> Optional[pb.EvalResult]:
    """The evaluation's result once complete or unservable (it never will complete), else None;
    resubmits one a restarted buffer lost."""
    try:
      res = self.client.collect_eval(e.eval_id, timeout_s=timeout_s)
    except grpc.RpcError as err:
      if err.code() != grpc.StatusCode.NOT_FOUND:
        raise
      log.warning("evaluation of version %d was lost by the buffer (restart?); resubmitting",
                  e.version)
      e.resubmitted += 1
      self.client.submit_eval(e.request)
      return None
    return res if res.complete or res.unservable else None

  def poll(self, block: bool = False) -> list[tuple[_Open, Optional[pb.EvalResult]]]:
    """Completed evaluations, oldest first, in submission order (a later one waits for the
    earlier: eval lines keep increasing compute). `block`: wait for every open one. An evaluation
    open longer than `timeout_s` is cancelled and returned with result None."""
    done = []
    while self.open:
      e = self.open[0]
      expired = time.time() - e.submitted > self.timeout_s
      res = None if expired else self._collect(e, 2.0 if block else 0.0)
      if res is None and not expired:
        if not block:
          break
        if self.watchdog is not None:
          self.watchdog()
        continue
      if res is None or res.unservable:
        if res is None:
          e.failed = "timeout"
          log.error("evaluation of version %d (step %d) not complete after %.0f s: dropped",
                    e.version, e.step, self.timeout_s)
        else:
          e.failed = "unservable"
          log.error("evaluation of version %d (step %d) can never complete: no live generator "
                    "holds that version and none can fetch it any more (generators restarted "
                    "after it was superseded); dropped with %d of %d groups done", e.version,
                    e.step, len(e.request.prompts) - res.pending_groups, len(e.request.prompts))
        res = None
        try:
          self.client.collect_eval(e.eval_id, cancel=True)
        except grpc.RpcError:
          pass
      self.open.pop(0)
      done.append((e, res))
    return done

  def wait_held(self, next_version: int) -> None:
    """Before publishing `next_version`: every open evaluation of a version that generators would
    no longer retain by default (older than `hold_versions` versions) must be held by one that was
    told to keep it (or done), or its weights could be gone from the fleet."""
    for e in list(self.open):
      if next_version - e.version < self.hold_versions:
        continue
      t0 = said = time.time()
      while True:
        try:
          res = self.client.collect_eval(e.eval_id, timeout_s=0.0)
        except grpc.RpcError as err:
          if err.code() != grpc.StatusCode.NOT_FOUND:
            raise
          break                              # poll() resubmits it
        if (res.complete or res.held or res.unservable
            or time.time() - e.submitted > self.timeout_s):
          break                              # (poll() drops an unservable or timed-out one)
        if self.watchdog is not None:
          self.watchdog()
        if time.time() - said > 60:
          said = time.time()
          log.warning("publishing version %d waits for the evaluation of version %d (step %d) to "
                      "be held by a generator: %.0f s so far, %d of %d groups pending",
                      next_version, e.version, e.step, said - t0, res.pending_groups,
                      len(e.request.prompts))
        time.sleep(0.05)

  def record(self, e: _Open, res: Optional[pb.EvalResult]) -> dict:
    """The metrics line of a finished evaluation (compute-axis fields from submission time)."""
    rec = {"step": e.step, "kind": "eval", **e.snapshot, "eval_mode": "fleet",
           "eval_version": e.version, "eval_wait_s": time.time() - e.submitted,
           "learner_peak_rss_mb": peak_rss_mb()}
    if res is None:          # timed out / unservable: a line of its own kind, no val_pass_rate
      rec["kind"] = "eval_failed"
      rec["eval_failed_reason"] = e.failed or "timeout"
      return rec
    rec["eval_group_device_s"] = float(sum(g.device_seconds for g in res.results))
    rec.update(summarize_results(res.results, e.tasks, self.task_names))
    return rec
