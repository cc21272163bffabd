"""The generator worker's continuous-batching loop (`generator.continuous`; the decoders are
generation/continuous.py's `ContinuousDecoder` on the JAX backend and vLLM's `VLLMSlots`).

`ContinuousLoop` is a base of `Worker` (generation/worker.py), the alternative to its
drain-per-lease `run`: `continuous_ok()` says whether this worker decodes continuously, and
`run_continuous()` keeps `generator.decode_batch` slots decoding, leases ahead of need and hands
each finished group to a pool of grading threads (`_grade_and_push`: grade, then push). It works
on the Worker's fields (`config`, `engine`, `gen`, `model_cfg`, `dataset`, `client`, `lease_id`,
`_working`, `_stop`, `decode_stats`, `backend`, `id`), its grading (`rewards`, `_log_grades`) and
its evaluation lane (`held_versions`, `_set_pins`, `serve_eval`; generation/eval_lane.py).
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from concurrent import futures
from typing import TYPE_CHECKING

import grpc

from scalerl_jax import config as run_config
from scalerl_jax.generation import interruption
from scalerl_jax.generation.worker_fields import WorkerFields
from scalerl_jax.generation.slots import DecodeStats, requests_for
from scalerl_jax.protocol import codec
from scalerl_jax.protocol.client import assignment_prompt

log = logging.getLogger("scalerl.worker")


class ContinuousLoop(WorkerFields):
  """The continuous-batching serving loop of a Worker (module docstring)."""

  # The Worker's other fields and methods this base works on (declared for the type checker).
  lease_id: str
  backend: str
  decode_stats: DecodeStats
  _stop: threading.Event
  terminated: bool
  _working: frozenset

  if TYPE_CHECKING:
    def rewards(self, completion, answer: str, prompt_id: int | None = None,
                log: list | None = None) -> float: ...
    def _log_grades(self, lines: list) -> None: ...
    def held_versions(self) -> list[int]: ...
    def _set_pins(self, versions) -> None: ...
    def serve_eval(self, assignments) -> int: ...

  def continuous_ok(self) -> str:
    """"" when this worker decodes continuously (generator.continuous on the JAX backend), else
    why it keeps the drain-per-lease loop."""
    if not self.config.generator.continuous:
      return "generator.continuous is off"
    if self.config.rollout.mode != "pipeline":
      return f"rollout.mode={self.config.rollout.mode} (version-capped rounds)"
    why = self.engine.refuses_continuous(self.gen, self.model_cfg)
    return f"the {self.backend} backend: {why}" if why else ""

  def _grade_and_push(self, a, prompt, group, t0: float) -> int:
    """Grades one finished group (a grading-pool thread) and pushes it; returns groups pushed."""
    t1 = time.perf_counter()
    rollouts, graded = [], []
    for i, c in enumerate(group):
      rollouts.append(codec.completion_to_rollout(
          c, group_id=a.group_id, sample_index=i, prompt_tokens=prompt.tokens,
          generator_id=self.id, rewards=(self.rewards(c, a.answer, a.prompt_id, graded),),
          start_unix_s=t0))
    with self._grade_lock:
      self.decode_stats.grade_s += time.perf_counter() - t1
      self._log_grades(graded)
    try:
      self.client.push(rollouts)
      return 1
    except grpc.RpcError as e:   # e.g. its lease expired: the buffer re-assigns the group
      log.warning("%s: push of group %d rejected (%s: %s)", self.id, a.group_id, e.code(),
                  e.details())
      return 0
    finally:
      with self._grade_lock:
        self._working = self._working - {a.group_id}

  def run_continuous(self, max_groups: int = 0) -> int:
    """The continuous loop: `generator.decode_batch` slots kept decoding (JAX: ContinuousDecoder;
    vLLM: VLLMSlots, one engine request per sample); leases refilled ahead of need; each group
    graded (a pool of `generator.grade_workers` threads) and pushed as soon as its last sample
    ends. Evaluation leases are served between chunks (the slots pause meanwhile; on vLLM, whose
    one engine switches to the pinned version, the samples in flight finish first). PipelineRL-k
    is the buffer's: a group's samples start only once this generator holds its minimum
    version, and in-flight swaps only raise versions. Returns groups pushed."""
    g = self.config.generator
    n_lease = int(g.groups_per_lease)
    n_eval = int(g.eval_groups_per_lease)
    spec0 = interruption.sampling_spec(self.config, self.dataset, seed=0)
    dec = self.engine.continuous(self.gen, spec0)
    dec.stats = self.decode_stats
    pool = futures.ThreadPoolExecutor(max(1, int(g.grade_workers)),
                                      thread_name_prefix="grade")
    self._grade_lock = threading.Lock()
    waiting: collections.deque = collections.deque()   # (assignment, prompt, requests) leased
    open_groups: dict = {}                              # group id -> [assignment, prompt, t0, {i: c}]
    pushes: list = []
    self.eval_groups = 0
    done = 0
    queued = lambda: sum(len(w[2]) for w in waiting)
    # the next waiting sample may enter a slot: this sampler has reached its minimum version
    insertable = lambda: bool(waiting) and waiting[0][0].min_version <= self.gen.version

    def finished(results) -> None:
      """Files finished samples under their groups; a complete group goes to the grading pool."""
      for r, c in results:
        entry = open_groups[r.tag]
        entry[3][r.sample_index] = c
        a = entry[0]
        if len(entry[3]) == int(a.group_size):
          del open_groups[r.tag]
          group = [entry[3][i] for i in range(int(a.group_size))]
          pushes.append(pool.submit(self._grade_and_push, a, entry[1], group, entry[2]))
    next_lease = 0.0
    try:
      while not self._stop.is_set() and (not max_groups or done < max_groups):
        # Groups whose grading finished no longer count against leasing ahead (pruned here, not
        # only after a decode step: with nothing in flight and more than 4 leases' groups still
        # grading at the last step, the loop never leased again and evaluations starved).
        done += sum(f.result() for f in pushes if f.done())
        pushes = [f for f in pushes if not f.done()]
        # Lease ahead: keep a lease's samples waiting beyond the free slots (fewer leases while
        # more than 4 leases' groups wait for their grades).
        # An empty answer (the staleness window is full) is not asked again for 0.2 s.
        if (queued() < dec.free + n_lease * int(self.config.rollout.generations_per_prompt)
            and len(pushes) <= 4 * n_lease and time.monotonic() >= next_lease
            and not self._stop.is_set()):    # SIGTERM gave the leases back: take no more
          nxt = self._lease_ahead(dec, waiting, finished, spec0, n_lease, n_eval)
          next_lease = next_lease if nxt is None else nxt
        # Fill free slots with samples whose minimum version this sampler has reached.
        self.gen.apply_pending()
        batch = self._fill(dec, waiting, open_groups, insertable)
        dec.insert(batch)
        if not dec.in_flight:
          t = time.perf_counter()
          time.sleep(0.01)   # nothing to decode: waiting for a lease or for weights
          dec.note_idle(time.perf_counter() - t)
          continue
        # samples waiting for a slot: the chunk may end early, as samples end (their slots
        # refilled at once, not idle to the chunk's end); none waiting: whole chunks
        finished(dec.step(refill=insertable()))
    finally:
      pool.shutdown(wait=not self.terminated)   # SIGTERM: no waiting on grades given back
      done += sum(f.result() for f in pushes if f.done() and not f.exception())
    return done

  def _lease_ahead(self, dec, waiting, finished, spec0, n_lease: int, n_eval: int) -> float | None:
    """One lease call of the continuous loop: training groups join `waiting` (their samples'
    requests, each group seeded by (run seed, minimum version, prompt)), evaluation groups are
    served now (`finished` takes the samples an engine that switches versions ends first).
    Returns when to ask again after an empty answer (the staleness window is full), else None."""
    nxt = None
    busy = bool(dec.in_flight) or bool(waiting)
    t = time.perf_counter()
    try:
      resp = self.client.lease_response(self.lease_id, max_groups=n_lease,
                                        wait_timeout_s=0.0 if busy else 2.0,
                                        held_versions=self.held_versions(),
                                        max_eval_groups=n_eval)
    except grpc.RpcError as e:
      log.warning("%s: lease failed (%s)", self.id, e.code())
      resp = None
      if not busy:
        time.sleep(1.0)
    if not busy:   # every slot free, waiting for work
      dec.note_idle(time.perf_counter() - t)
    if resp is not None:
      self._set_pins(resp.eval_versions)
      assignments = list(resp.assignments)
      if not assignments:
        nxt = time.monotonic() + 0.2
      if assignments and assignments[0].eval_id:
        if not self.engine.separate_eval:   # the engine switches versions: finish first
          while dec.in_flight:
            finished(dec.step())
        self.eval_groups += self.serve_eval(assignments)
      elif assignments:
        with self._grade_lock:
          self._working = self._working | {a.group_id for a in assignments}
        for a in assignments:
          p = assignment_prompt(a)
          seed = run_config.generation_seed(self.config.seed, a.min_version, [a.prompt_id])
          spec = dataclasses.replace(spec0, seed=seed)
          waiting.append((a, p, requests_for([p], int(a.group_size), spec, tag=a.group_id)))
    return nxt

  def _fill(self, dec, waiting, open_groups, insertable) -> list:
    """The samples that enter the decoder's free slots now: those whose minimum version this
    sampler holds, in lease order (a group's first sample opens its entry in `open_groups`)."""
    batch = []
    while len(batch) < dec.free and insertable():
      a, p, reqs = waiting[0]
      take = reqs[:dec.free - len(batch)]
      if a.group_id not in open_groups:
        open_groups[a.group_id] = [a, p, time.time(), {}]
      batch += take
      if len(take) == len(reqs):
        waiting.popleft()
      else:
        waiting[0] = (a, p, reqs[len(take):])
    return batch
