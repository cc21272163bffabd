"""The buffer's state machine: prompt leases, PipelineRL-k admission, complete-group batches, lag.

No gRPC here (the server wraps it), so the scheduling logic is testable on its own.

Vocabulary: `ns` = the next learner step to be pulled (steps 0..ns-1 have been pulled), `v` = the newest
published policy version (the learner publishes v = s+1 after training step s; version 0 exists at start).

Every leased group gets a *deadline*: the last learner step allowed to train on it.
  pipeline (PipelineRL-k): tokens must come from versions >= v_lease, so the group may be trained at
    steps <= v_lease + k without ever exceeding lag k.  deadline = v_lease + k.
  ppo_off_policy: a round of k*B groups is leased with exactly version v == ns (ns % k == 0); the learner
    takes k steps on it.  deadline = ns + k - 1.
Batches are filled earliest-deadline-first and a pull waits until every group due at that step is
complete. Admission keeps the schedule feasible: for every deadline d, #outstanding groups with
deadline <= d must be <= (d - ns + 1) * B. Deadlines of new leases are never smaller than existing
ones, so this reduces to: outstanding + new <= (v + k - ns + 1) * B (see docs/ROLLOUT.md).
Freshness bound (rollout.max_ahead = a): admission uses min(a, k) in place of k, deadlines keep
v_lease + k (docs/ROLLOUT.md "Freshness bound").
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import struct
import threading
import time
from typing import Callable, Mapping, Optional, Sequence

import numpy as np

from scalerl_jax import config
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.buffer import wal as walmod
from scalerl_jax.protocol import wire
from scalerl_jax.buffer.durability import Durable
from scalerl_jax.buffer.eval_lane import EvalLane
from scalerl_jax.buffer.fleet import Fleet
from scalerl_jax.buffer.groups import Group, PromptQueue, Stored, group_item_bytes, lag_histogram
from scalerl_jax.rl.npr import PassRateHistory
from scalerl_jax.types import PromptSpec

MODES = ("pipeline", "ppo_off_policy")
log = logging.getLogger("scalerl.buffer")


@dataclasses.dataclass
class PulledBatch:
  step: int
  groups: list                     # list[bytes]: serialized `BatchItem{group}` messages
  summary: pb.BatchSummary
  num_rollouts: int
  num_bytes: int


def _check_alive(alive: Callable[[], bool], what: str) -> None:
  if not alive():
    raise val.cancelled(f"{what}: the caller went away or the server is stopping")


class BufferState(Durable):
  """Thread-safe buffer state. All public methods raise `val.RejectError` on refusal.

  Admission, leases and delivery are here; the evaluation lane is `EvalLane` (buffer/eval_lane.py);
  durability (WAL, compaction, replay, rewind) is the `Durable` base (buffer/durability.py)."""

  def __init__(self, prompts: Sequence[PromptSpec], *, prompts_per_step: int, group_size: int,
               max_lag: int, mode: str = config.Rollout.mode,
               lease_ttl_s: float = config.Buffer.lease_ttl_s,
               limits: val.Limits = val.Limits(), verifier: Optional[val.Verifier] = None,
               shuffle_seed: Optional[int] = None, clock: Callable[[], float] = time.time,
               npr_threshold: Optional[float] = None, max_ahead: int = config.Rollout.max_ahead):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if prompts_per_step < 1 or group_size < 1 or max_lag < 0:
      raise ValueError("prompts_per_step and group_size must be >= 1 and max_lag >= 0")
    if mode == "ppo_off_policy" and max_lag < 1:
      raise ValueError("ppo_off_policy needs max_lag (k) >= 1: k steps per generated batch")
    if max_ahead < -1 or (max_ahead >= 0 and mode != "pipeline"):
      raise ValueError(f"max_ahead={max_ahead}: -1 (off) or >= 0 in pipeline mode only")
    if not prompts:
      raise ValueError("no prompts")
    self.B, self.G, self.k, self.mode = prompts_per_step, group_size, max_lag, mode
    # The freshness bound (admission only; deadlines keep k): at most this many learner batches
    # leased ahead of the newest version, so a fast fleet trains on lag <= max_ahead tokens.
    self.ahead = max_lag if max_ahead < 0 else min(max_ahead, max_lag)
    self.lease_ttl_s, self.limits, self.verifier, self.clock = lease_ttl_s, limits, verifier, clock
    self._prompts = {int(p.prompt_id): p for p in prompts}
    if len(self._prompts) != len(prompts):
      raise ValueError("duplicate prompt ids")
    self._order = list(self._prompts)
    self._rng = np.random.default_rng(shuffle_seed) if shuffle_seed is not None else None
    self._queue = PromptQueue()
    self.cv = threading.Condition()
    self.version = 0
    self.ns = 0
    self._next_group_id = 1
    self._groups: dict[int, Group] = {}       # outstanding (leased, not delivered)
    self._seen: dict[str, int] = {}            # rollout_id -> group_id (idempotency)
    self._completed_seq = 0
    self._round_start = -1                     # ppo_off_policy: the step whose round is leased
    self._round_leased = 0
    self._last_batch: Optional[PulledBatch] = None
    self._last_groups: list = []               # the Groups of _last_batch (WAL snapshot)
    self._kept: dict[int, list] = {}           # step -> delivered groups kept for a learner rewind
    self.resumes: list[str] = []               # learner resume ids already applied (replay.py)
    self.rewind_totals: dict = {}              # counts of what learner rewinds re-queued / dropped
    self._rewind_drops: dict = {}              # reason -> gids dropped by a rewind (WAL DROP records)
    self.wal: Optional[walmod.WAL] = None      # write-ahead log (attach_wal), None: memory only
    self.weights_meta: Optional[dict] = None   # newest VERSION record (sha256, format, size)
    self.delivered_groups = self.delivered_rollouts = 0
    self.expired_groups = self.stale_dropped = 0
    self._lag_total: list[int] = []
    self._lag_negative = 0
    self.recent: collections.deque = collections.deque(maxlen=16)
    # generator id -> (versions it holds, when it said so): from leases and heartbeats that list
    # them; an evaluation nobody live holds any more is unservable (collect_eval).
    self._holders: dict[str, tuple[frozenset, float]] = {}
    self.fleet = Fleet()   # the generators' heartbeat facts (counters, versions, relays)
    # No-Positive-Resampling: pass-rate history of delivered groups; retired prompts are skipped
    # when the next epoch's order is drawn (PAPER_NOTES §3). None disables it.
    self.npr = None
    if npr_threshold is not None:
      self.npr = PassRateHistory(threshold=npr_threshold)
    # The evaluation lane (buffer/eval_lane.py): not in the WAL; called with self.cv held.
    self.evals = EvalLane(limits, lease_ttl_s)

  # ---- admission ---------------------------------------------------------------------------------
  def capacity(self) -> int:
    """Groups that may be newly leased now (call with the lock held)."""
    out = len(self._groups)
    if self.mode == "pipeline":
      return max(0, (self.version + self.ahead - self.ns + 1) * self.B - out)
    if self.ns % self.k or self.version != self.ns:
      return 0
    if self._round_start != self.ns:
      if out:
        return 0
      return self.k * self.B
    return self.k * self.B - self._round_leased

  def _next_prompt(self) -> PromptSpec:
    while self._queue and self.npr is not None and self.npr.is_retired(self._queue[0]):
      self._queue.popleft()
    if not self._queue:
      order = list(self._order)
      if self.npr is not None:
        active = self.npr.active(order)
        order = active or order   # every prompt retired: keep sampling rather than stall

      if self._rng is not None:
        self._rng.shuffle(order)
      self._queue.extend(order)
      self._wal_append(walmod.EPOCH, dict(order=[int(p) for p in order], rng=self._rng_state()))
    return self._prompts[self._queue.popleft()]

  def lease(self, generator_id: str, max_groups: int, wait_timeout_s: float,
            alive: Callable[[], bool] = lambda: True,
            held_versions: Sequence[int] = (), max_eval_groups: int = 0) -> list[pb.Assignment]:
    """Leases up to `max_groups` groups, waiting up to `wait_timeout_s` for admission (CANCELLED
    once `alive()` is False: the caller went away or the server is stopping).

    The evaluation lane comes first: while an open evaluation pinned to one of `held_versions`
    (the versions this generator holds) has unleased groups, the lease is those groups (one
    evaluation per lease, outside the training admission), never training ones."""
    val.check_id(generator_id, "generator_id", self.limits)
    if not 1 <= max_groups <= self.limits.max_lease_groups:
      raise val.invalid(f"max_groups={max_groups} must be in [1, {self.limits.max_lease_groups}]")
    val.check_timeout(wait_timeout_s, "wait_timeout_s", self.limits)
    held = self._held_set(held_versions)
    n_eval = int(max_eval_groups) or max_groups
    if not 1 <= n_eval <= self.limits.max_lease_groups:
      raise val.invalid(f"max_eval_groups={max_eval_groups} must be in [0, "
                        f"{self.limits.max_lease_groups}]")
    end = self.clock() + wait_timeout_s
    with self.cv:
      self._holders[generator_id] = (frozenset(held), self.clock())
      while True:
        self._expire()
        ev = self.evals.take(generator_id, n_eval, held, self.clock())
        if ev:
          return ev
        cap = self.capacity()
        if cap > 0:
          break
        left = end - self.clock()
        if left <= 0:
          return []
        _check_alive(alive, "LeasePrompts")
        self.cv.wait(min(left, 0.25))
      out, new = [], []
      now = self.clock()
      ppo = self.mode == "ppo_off_policy"
      round_start = self.ns if ppo and self._round_start != self.ns else self._round_start
      returned = list(self._queue.returned)     # restored with the prompts if not durable
      for _ in range(min(cap, max_groups)):
        p = self._next_prompt()
        gid = self._next_group_id
        self._next_group_id += 1
        view = val.LeaseView(group_id=gid, prompt_id=int(p.prompt_id),
                             prompt_tokens=np.asarray(p.tokens, np.int32), answer=p.answer,
                             group_size=self.G, min_version=self.version,
                             max_version=self.version if ppo else -1)
        deadline = self.ns + self.k - 1 if ppo else self.version + self.k
        new.append(Group(view, generator_id, deadline, now + self.lease_ttl_s))
        self._wal_lease(new[-1], round_start)
        out.append(pb.Assignment(
            group_id=gid, prompt_id=view.prompt_id,
            prompt_tokens=codec.encode(view.prompt_tokens, pb.INT32), answer=p.answer,
            group_size=self.G, min_version=view.min_version, max_version=view.max_version,
            lease_expires_unix_s=now + self.lease_ttl_s))
      try:
        self._wal_commit()
      except val.RejectError:
        for g in reversed(new):                 # not durable: not leased
          self._queue.appendleft(g.view.prompt_id)
        self._queue.returned = collections.deque(returned[:len(self._queue)])
        raise
      if ppo and self._round_start != round_start:
        self._round_start, self._round_leased = round_start, 0
      for g in new:
        self._groups[g.view.group_id] = g
        if ppo:
          self._round_leased += 1
      if out:
        self.progress.tick()   # a served lease (liveness from progress)
      return out

  def _expire(self) -> None:
    """Cancels incomplete groups whose lease ran out; their prompts go back to the queue front."""
    now = self.clock()
    self._expire_groups([g for g, x in self._groups.items() if not x.complete and x.expires_at < now])
    self.evals.expire(now)

  def _apply_expire(self, gid: int) -> None:
    g = self._groups.pop(gid)
    for s in g.samples.values():               # partial samples are discarded, never delivered
      self._seen.pop(s.rollout_id, None)
    self._queue.put_back([(gid, g.view.prompt_id)])   # at the front, in lease order
    self.expired_groups += 1
    if self.mode == "ppo_off_policy" and self._round_start == self.ns:
      self._round_leased -= 1
    self.cv.notify_all()

  def _held_set(self, held_versions: Sequence[int]) -> set:
    """A generator's held versions (lease or heartbeat), at most limits.max_held_versions."""
    if len(held_versions) > self.limits.max_held_versions:
      raise val.invalid(f"held_versions has {len(held_versions)} entries, limit "
                        f"{self.limits.max_held_versions}")
    return {int(v) for v in held_versions}

  def heartbeat(self, generator_id: str, group_ids: Sequence[int] | None = None,
                held_versions: Sequence[int] | None = None,
                stats: Mapping[str, float] | None = None, version: int | None = None,
                relay_address: str = "") -> int:
    """Extends the incomplete leases held by `generator_id`; returns how many. `version`: the
    policy version it samples with (a generator more than max(1, max_lag) versions behind is
    counted in `generator_stats()["generators_behind"]`). `held_versions`
    (when given): the versions whose weights it holds, recorded as its lease requests' are.

    `group_ids` (when given): only those training groups are extended; the generator's other
    incomplete groups keep their expiry and are re-queued after the TTL. A lease the buffer
    logged but whose response never reached the generator (the buffer crashed in between) would
    otherwise be kept alive forever by that generator's heartbeats, and its step never completes.
    None: every incomplete group of `generator_id` (clients that do not list their groups).
    `stats`: the generator's cumulative counters, kept per generator (not in the WAL) and summed
    into every BatchSummary."""
    val.check_id(generator_id, "generator_id", self.limits)
    if relay_address and (len(relay_address) > 256 or ":" not in relay_address
                          or not relay_address.isprintable()):
      raise val.invalid(f"relay_address {relay_address[:64]!r}: a 'host:port' of <= 256 chars")
    listed = None if group_ids is None else {int(x) for x in group_ids}
    held = None if held_versions is None else self._held_set(held_versions)
    checked = val.check_generator_stats(stats) if stats else {}
    with self.cv:
      self.fleet.record(generator_id, checked, version, relay_address, self.clock())
      if held is not None:
        self._holders[generator_id] = (frozenset(held), self.clock())
      self._expire()
      n = 0
      for gid, g in self._groups.items():
        if g.generator_id == generator_id and not g.complete and (listed is None or gid in listed):
          g.expires_at = self.clock() + self.lease_ttl_s
          n += 1
      return n + self.evals.renew(generator_id, self.clock())

  # ---- ingest ------------------------------------------------------------------------------------
  def add_rollouts(self, items: Sequence[tuple]) -> list[pb.Ack]:
    """Validates and stores (rollout, raw bytes) pairs all-or-nothing; idempotent on rollout_id.

    Returns one Ack per item in order (`duplicate` for ids stored before or earlier in `items`)."""
    for r, _ in items:
      val.check_id(r.rollout_id, "rollout_id", self.limits)
    with self.cv:                              # 1) look up leases (immutable views)
      views = []
      for r, _ in items:
        if r.rollout_id in self._seen:
          views.append(None)
          continue
        g = self._groups.get(r.group_id)
        if g is None:
          if 0 < r.group_id < self._next_group_id:
            raise val.precondition(f"group {r.group_id} is no longer leased (expired or delivered)")
          raise val.invalid(f"group_id {r.group_id} was never leased")
        views.append(g.view)
      version = self.version
    checked = [None if v is None else val.validate_rollout(r, v, version, self.limits, self.verifier,
                                                           id_checked=True)
               for (r, _), v in zip(items, views)]     # 2) validate outside the lock
    with self.cv:                              # 3) re-check conflicts, then store everything
      plan, ids, slots = [], set(), set()
      for (r, raw), c in zip(items, checked):
        if c is None or r.rollout_id in self._seen or r.rollout_id in ids:
          plan.append(None)
          continue
        g = self._groups.get(r.group_id)
        if g is None:
          raise val.precondition(f"group {r.group_id} expired while the rollout was validated")
        key = (r.group_id, r.sample_index)
        if r.sample_index in g.samples or key in slots:
          other = g.samples[r.sample_index].rollout_id if r.sample_index in g.samples else "?"
          raise val.invalid(f"sample_index {r.sample_index} of group {r.group_id} already filled "
                            f"(by rollout {other})")
        ids.add(r.rollout_id)
        slots.add(key)
        plan.append((g, r, raw, c))
      for p in plan:                           # 4) durable before acknowledged
        if p is not None:
          self._wal_append(walmod.ROLLOUT, p[2])
      self._wal_commit()
      raws = iter(wire.retain([p[2] for p in plan if p is not None]))
      acks = []
      for (r, _), p in zip(items, plan):
        if p is None:
          acks.append(pb.Ack(rollout_id=r.rollout_id, duplicate=True))
          continue
        g, r, _, c = p
        done = self._store(g, r, next(raws), c)
        acks.append(pb.Ack(rollout_id=r.rollout_id, group_complete=done))
      return acks

  def _store(self, g: Group, r: pb.Rollout, raw: bytes, c: val.Checked) -> bool:
    g.samples[r.sample_index] = Stored(r.rollout_id, raw, c)
    self._seen[r.rollout_id] = r.group_id
    g.expires_at = max(g.expires_at, self.clock() + self.lease_ttl_s)
    done = g.complete and g.completed_seq < 0
    if done:
      g.completed_seq = self._completed_seq
      self._completed_seq += 1
      self.cv.notify_all()
    return done

  # ---- learner -----------------------------------------------------------------------------------
  def set_version(self, version: int, meta: Optional[dict] = None) -> None:
    """Admits `version`; `meta` (sha256, format, total_bytes) goes into the WAL's VERSION record."""
    with self.cv:
      rec = dict(meta or {}, version=int(version))
      self._wal_append(walmod.VERSION, rec)
      self._wal_commit()
      self.weights_meta = rec
      self.version = version
      self.evals.superseded(version, self.clock())   # the clock of EvalLane.unservable
      self.cv.notify_all()

  def _ready(self, s: int) -> Optional[list[Group]]:
    """The EDF batch for step s if it can be formed now, else None."""
    for gid in [g for g, x in self._groups.items() if x.complete and x.deadline < s]:
      self._groups.pop(gid)                     # unreachable under admission; never delivered
      self.stale_dropped += 1
      self._wal_append(walmod.STALE, dict(gid=gid))
      self._wal_commit(best_effort=True)
    if any(x.deadline <= s and not x.complete for x in self._groups.values()):
      return None
    if self.mode == "ppo_off_policy" and s % self.k == 0:
      # The whole k*B round is generated with one version before the learner's first step on it.
      if (self._round_start != s or self._round_leased < self.k * self.B
          or not all(x.complete for x in self._groups.values())):
        return None
    done = sorted((x for x in self._groups.values() if x.complete),
                  key=lambda x: (x.deadline, x.completed_seq))
    if len(done) < self.B:
      return None
    # Which groups: by deadline, FIFO by completion among equal deadlines. Their row order: by
    # (deadline, group id), so a batch's layout does not depend on which generator's grader
    # finished first (continuous generators complete groups in timing-dependent order; a resumed
    # synchronous run must reproduce the uninterrupted run's batches row for row).
    return sorted(done[:self.B], key=lambda x: (x.deadline, x.view.group_id))

  def next_step(self) -> tuple[int, Optional[int]]:
    """(the step the next pull must ask for, the step of the batch a retried pull re-sends)."""
    with self.cv:
      return self.ns, (None if self._last_batch is None else self._last_batch.step)

  def pull(self, step: int, timeout_s: float,
           alive: Callable[[], bool] = lambda: True) -> PulledBatch:
    """Returns the batch for learner step `step`, waiting up to `timeout_s` for it to be complete
    (CANCELLED once `alive()` is False: a dead learner's pull must not hold a server thread, and
    the process's exit, for the rest of its timeout)."""
    val.check_timeout(timeout_s, "timeout_s", self.limits)
    end = self.clock() + timeout_s
    with self.cv:
      if self._last_batch is not None and step == self._last_batch.step:
        return self._last_batch                 # retry of the same step: same groups, not new ones
      if step != self.ns:
        raise val.precondition(f"learner asked for step {step}; the next step is {self.ns}")
      while True:
        self._expire()
        batch = self._ready(step)
        if batch is not None:
          break
        left = end - self.clock()
        if left <= 0:
          raise val.timed_out(f"no complete batch for step {step} within {timeout_s}s "
                              f"(version {self.version}, {len(self._groups)} groups outstanding)")
        _check_alive(alive, "PullBatch")
        self.cv.wait(min(left, 0.25))
      return self._deliver(step, batch, "live")

  def _deliver(self, step: int, batch: list, how: str) -> PulledBatch:
    """Delivers `batch` as step `step`. how: "live" (log to the WAL first, then apply), "replay"
    (a DELIVER record; NPR comes from its own records), "last" (snapshot: only rebuild the batch
    a retried pull re-sends; counters come from the SNAPSHOT record)."""
    counts: list[int] = []
    negative = nbytes = nroll = 0
    blobs = []
    for g in batch:
      for st in g.samples.values():
        c = st.checked
        for off in np.nonzero(c.version_counts)[0]:
          lag = step - (c.min_version + int(off))
          if lag < 0:
            negative += int(c.version_counts[off])
            continue
          if lag >= len(counts):
            counts.extend([0] * (lag + 1 - len(counts)))
          counts[lag] += int(c.version_counts[off])
        nroll += 1
      blobs.append(group_item_bytes(g))
      nbytes += len(blobs[-1])
    summary = pb.BatchSummary(step=step, num_groups=len(batch), lag=lag_histogram(counts, negative),
                              generator_stats=self.generator_stats())
    if how == "live":
      self._wal_append(walmod.DELIVER, dict(step=step, gids=[g.view.group_id for g in batch]))
      if self.npr is not None:
        for g in batch:
          self._wal_append(walmod.NPR, dict(pid=g.view.prompt_id, rewards=[
              st.checked.reward for _, st in sorted(g.samples.items())]))
      self._wal_commit()                        # not durable -> not delivered
    for g in batch:
      self._groups.pop(g.view.group_id, None)
      if how == "live" and self.npr is not None:
        self.npr.update(g.view.prompt_id, [st.checked.reward for _, st in sorted(g.samples.items())])
    self._last_batch = PulledBatch(step, blobs, summary, nroll, nbytes)
    self._last_groups = list(batch)
    if how != "live":                           # replay: kept for a learner rewind (replay.py)
      self._kept[step] = list(batch)
    if how == "last":
      return self._last_batch
    for i, c in enumerate(counts):
      if i >= len(self._lag_total):
        self._lag_total.append(0)
      self._lag_total[i] += c
    self._lag_negative += negative
    self.recent.append(summary)
    self.delivered_groups += len(batch)
    self.delivered_rollouts += nroll
    self.ns = step + 1
    self.cv.notify_all()
    return self._last_batch

  # ---- evaluation lane (buffer/eval_lane.py: the lane's rules; here the lock and the waiting) ----
  def submit_eval(self, req: pb.EvalRequest) -> pb.EvalAck:
    """Opens evaluation `req.eval_id` (validation.validate_eval_request); idempotent on the id."""
    with self.cv:
      version = self.version
      dup = self.evals.known(req.eval_id)
      if dup is not None:
        return dup
    prompts = val.validate_eval_request(req, version, self.limits)   # outside the lock
    with self.cv:
      if self.evals.open(req, prompts):
        self.cv.notify_all()
      return pb.EvalAck(eval_id=req.eval_id, groups=len(prompts))

  def eval_versions(self) -> list[int]:
    """Versions pinned by open evaluations (generators keep those weights)."""
    with self.cv:
      return self.evals.versions()

  def add_eval_results(self, results: Sequence[pb.EvalGroupResult]) -> pb.EvalPushResponse:
    """Stores evaluation results all-or-nothing (EvalLane.add_results)."""
    with self.cv:
      out = self.evals.add_results(results)
      if out.accepted:
        self.cv.notify_all()
      return out

  def collect_eval(self, eval_id: int, timeout_s: float, cancel: bool = False,
                   alive: Callable[[], bool] = lambda: True) -> pb.EvalResult:
    """The state of evaluation `eval_id`, waiting up to `timeout_s` for it to complete; a complete
    one carries every group's result and is closed (kept for a retried collect). `cancel` drops
    it. NOT_FOUND for an id never submitted (or lost in a buffer restart). An evaluation that can
    never complete (EvalLane.unservable) is answered at once."""
    val.check_timeout(timeout_s, "timeout_s", self.limits)
    end = self.clock() + timeout_s
    with self.cv:
      while True:
        out = self.evals.collect(eval_id, cancel)
        if out is not None:
          if cancel or out.complete:
            self.cv.notify_all()
          return out
        job = self.evals.jobs[eval_id]
        left = end - self.clock()
        unservable = self.evals.unservable(job, self.version, self._holders, self.clock())
        if left <= 0 or unservable:
          return job.state(unservable=unservable)
        _check_alive(alive, "CollectEval")
        self._expire()
        self.cv.wait(min(left, 0.25))

  # ---- status ------------------------------------------------------------------------------------
  def contents(self) -> pb.BufferContents:
    with self.cv:
      h = hashlib.sha256()
      h.update(struct.pack("<qqqq", self.version, self.ns, self.delivered_groups, self._next_group_id))
      for gid in sorted(self._groups):
        g = self._groups[gid]
        h.update(struct.pack("<q", gid))
        for i in sorted(g.samples):
          h.update(g.samples[i].rollout_id.encode())
      ready = sum(1 for g in self._groups.values() if g.complete)
      return pb.BufferContents(
          current_version=self.version, next_step=self.ns, prompts=len(self._prompts),
          leased_groups=len(self._groups) - ready, ready_groups=ready,
          stored_rollouts=sum(len(g.samples) for g in self._groups.values()),
          delivered_groups=self.delivered_groups, delivered_rollouts=self.delivered_rollouts,
          expired_groups=self.expired_groups, stale_dropped_groups=self.stale_dropped,
          digest=h.hexdigest())

  def relay_parents(self, generator_id: str, fanout: int) -> list[str]:
    """The relays `generator_id` fetches weights from, nearest first (buffer/fleet.py)."""
    with self.cv:
      return self.fleet.relay_parents(generator_id, fanout, self.clock(), self.lease_ttl_s)

  def generator_stats(self) -> dict[str, float]:
    """The generators' heartbeat counters summed over every incarnation, and the gauge
    `generators_behind`: live generators more than max(1, max_lag) versions behind (their
    updates keep failing, or are slow)."""
    with self.cv:
      return self.fleet.totals(self.clock(), self.lease_ttl_s, self.version - max(1, self.k))

  def status_fields(self) -> dict:
    with self.cv:
      return dict(mode=self.mode, max_lag=self.k, prompts_per_step=self.B, group_size=self.G,
                  admission_capacity=self.capacity(),
                  lag_total=lag_histogram(self._lag_total, self._lag_negative),
                  recent=list(self.recent))
