"""The buffer's durability: its write-ahead log, compaction, replay and learner-resume rewind.

`Durable` is the part of `BufferState` (buffer/state.py) that keeps it across restarts: every change
is logged to the WAL (`attach_wal`; buffer/wal.py); `snapshot()` yields the whole state as records
and `apply(rtype, body)` applies one (replay.HANDLERS maps each record type to a public `restore_*`
method here), so a restart replays the log into a fresh state; `apply_learner_state` / `rewind`
are the learner-resume side (replay.py's docstring says what a rewind keeps and drops). It works
on BufferState's fields under its lock (`cv`).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional, Sequence

import numpy as np

from scalerl_jax.progress import Beacon
from scalerl_jax.buffer import replay
from scalerl_jax.buffer import wal as walmod
from scalerl_jax.buffer.groups import Group, PromptQueue
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.rl.npr import PassRateHistory
from scalerl_jax.types import PromptSpec

log = logging.getLogger("scalerl.buffer")


class Durable:
  """WAL logging, compaction, replay and rewind of a BufferState (module docstring)."""

  # BufferState's fields and methods this base works on (BufferState.__init__ sets them; declared
  # here so that their uses below are type-checked).
  B: int
  G: int
  k: int
  mode: str
  lease_ttl_s: float
  clock: Callable[[], float]
  cv: threading.Condition
  ns: int
  version: int
  npr: Optional[PassRateHistory]
  wal: Optional[walmod.WAL]
  weights_meta: Optional[dict]
  resumes: list[str]
  rewind_totals: dict
  delivered_groups: int
  delivered_rollouts: int
  expired_groups: int
  stale_dropped: int
  _prompts: dict[int, PromptSpec]
  _rng: Optional[np.random.Generator]
  _queue: PromptQueue
  _groups: dict[int, Group]
  _seen: dict[str, int]
  _kept: dict[int, list]
  _last_batch: Any             # Optional[state.PulledBatch] (state.py imports this module)
  _last_groups: list
  _rewind_drops: dict
  _next_group_id: int
  _completed_seq: int
  _round_start: int
  _round_leased: int
  _lag_total: list[int]
  _lag_negative: int
  limits: val.Limits
  # Liveness from progress (buffer.progress_file): ticked at every WAL commit and served lease.
  progress: Beacon = Beacon()

  if TYPE_CHECKING:
    def _store(self, g: Group, r: pb.Rollout, raw: bytes, c: val.Checked) -> bool: ...
    def _apply_expire(self, gid: int) -> None: ...
    def _deliver(self, step: int, batch: list, how: str) -> Any: ...

  def release(self, generator_id: str, group_ids: Sequence[int] | None = None) -> int:
    """Re-queues now the incomplete training groups leased to `generator_id` (only `group_ids`
    when given): a generator leaving on SIGTERM gives its work back instead of holding it for
    lease_ttl_s. Logged as expiries (WAL EXPIRE; counted in expired_groups). Returns how many."""
    val.check_id(generator_id, "generator_id", self.limits)
    listed = None if group_ids is None else {int(x) for x in group_ids}
    with self.cv:
      gids = [gid for gid, g in self._groups.items() if g.generator_id == generator_id
              and not g.complete and (listed is None or gid in listed)]
      self._expire_groups(gids)
      return len(gids)

  def _expire_groups(self, gids: Sequence[int]) -> None:
    """Cancels the leases of `gids` (logged: WAL EXPIRE); their prompts go back to the queue
    front in lease order (groups.PromptQueue)."""
    for gid in gids:
      self._wal_append(walmod.EXPIRE, dict(gid=gid))
      self._apply_expire(gid)
    self._wal_commit(best_effort=True)

  # ---- logging -----------------------------------------------------------------------------------
  def _wal_append(self, rtype: int, body) -> None:
    if self.wal is not None:
      self.wal.append(rtype, body)

  def _wal_commit(self, best_effort: bool = False) -> None:
    if self.wal is None:
      return
    try:
      self.wal.commit()
      self.progress.tick()
    except OSError as e:
      self.wal.discard()
      log.error("WAL write failed%s: %s", " (best effort: went on)" if best_effort else
                " (the request fails, nothing of it is kept)", e)
      if best_effort:
        return
      raise val.unavailable(f"write-ahead log write failed: {e}") from e

  def _wal_lease(self, g, round_start: int, snap: bool = False) -> None:
    v = g.view
    self._wal_append(walmod.LEASE, dict(gid=v.group_id, pid=v.prompt_id, gen=g.generator_id,
                                        deadline=g.deadline, min_v=v.min_version,
                                        max_v=v.max_version, round=round_start, snap=snap))

  def _rng_state(self):
    return self._rng.bit_generator.state if self._rng is not None else None

  def _set_rng_state(self, state) -> None:
    if state is not None and self._rng is not None:
      self._rng.bit_generator.state = state

  # ---- compaction --------------------------------------------------------------------------------
  def attach_wal(self, wal: walmod.WAL) -> str:
    """Compacts the current (replayed) state into a fresh segment and logs every later change."""
    with self.cv:
      name = wal.start_snapshot(self.snapshot())
      self.wal = wal
      self._kept = {}            # on disk now; the next replay reads them back
      return name

  def snapshot(self) -> Iterator[bytes]:
    """The whole state as WAL records (compaction; `apply` of each rebuilds it)."""
    enc = walmod.encode
    yield enc(walmod.SNAPSHOT, dict(
        ns=self.ns, version=self.version, next_group_id=self._next_group_id,
        round_start=self._round_start, round_leased=self._round_leased,
        delivered_groups=self.delivered_groups, delivered_rollouts=self.delivered_rollouts,
        expired_groups=self.expired_groups, stale_dropped=self.stale_dropped,
        lag_total=self._lag_total, lag_negative=self._lag_negative, resumes=self.resumes,
        rewind_totals=self.rewind_totals))
    if self.weights_meta is not None:
      yield enc(walmod.VERSION, self.weights_meta)
    if self.npr is not None:
      yield enc(walmod.NPR_STATE, self.npr.to_dict())
    yield enc(walmod.QUEUE, dict(queue=[int(p) for p in self._queue], rng=self._rng_state(),
                                 returned=[int(g) for g in self._queue.returned]))
    last_step = self._last_batch.step if self._last_batch is not None else None
    kept = {s: gs for s, gs in self._kept.items() if s != last_step}
    live = (set(self._groups) | {g.view.group_id for g in self._last_groups}
            | {g.view.group_id for gs in kept.values() for g in gs})
    yield enc(walmod.SEEN, dict(ids={r: g for r, g in self._seen.items() if g not in live}))

    def group(g) -> Iterator[bytes]:
      yield enc(walmod.LEASE, dict(gid=g.view.group_id, pid=g.view.prompt_id, gen=g.generator_id,
                                   deadline=g.deadline, min_v=g.view.min_version,
                                   max_v=g.view.max_version, round=self._round_start, snap=True))
      for i in sorted(g.samples):
        yield enc(walmod.ROLLOUT, g.samples[i].raw)
    for s in sorted(kept):
      for g in kept[s]:
        yield from group(g)
      yield enc(walmod.KEPT, dict(step=s, gids=[g.view.group_id for g in kept[s]]))
    if self._last_batch is not None:
      for g in self._last_groups:
        yield from group(g)
      yield enc(walmod.LAST_BATCH, dict(step=self._last_batch.step,
                                        gids=[g.view.group_id for g in self._last_groups]))
    order = sorted(self._groups.values(),
                   key=lambda g: (g.completed_seq < 0, g.completed_seq, g.view.group_id))
    for g in order:                            # complete groups in completion order (FIFO ties)
      yield from group(g)
    for why, gids in sorted(self._rewind_drops.items()):   # audit trail of the last rewind
      yield enc(walmod.DROP, dict(reason=why, gids=gids))
    self._rewind_drops = {}

  # ---- replay (replay.HANDLERS call these, one per WAL record type) -------------------------------
  def apply(self, rtype: int, body) -> bool:
    """Applies one WAL record (see wal.py) to the state; False when it was a duplicate and skipped.
    The record types' meanings live in replay.HANDLERS."""
    with self.cv:                               # re-entrant: restore() holds it too
      return replay.HANDLERS[rtype](self, walmod.decode_body(rtype, body), body) is not False

  def restore(self, records) -> dict:
    """Rebuilds the state from WAL records; call before serving. Returns counts."""
    with self.cv:
      skipped = sum(not self.apply(rtype, body) for rtype, body in records)
      now = self.clock()
      for g in self._groups.values():           # generators get a full TTL to reconnect
        g.expires_at = now + self.lease_ttl_s
      self.cv.notify_all()
      return dict(ns=self.ns, version=self.version, outstanding_groups=len(self._groups),
                  ready_groups=sum(1 for g in self._groups.values() if g.complete),
                  stored_rollouts=sum(len(g.samples) for g in self._groups.values()),
                  delivered_groups=self.delivered_groups, seen_ids=len(self._seen),
                  skipped_rollouts=skipped, kept_steps=sorted(self._kept),
                  queued_prompts=len(self._queue))

  def restore_counters(self, d: dict) -> None:
    """SNAPSHOT: step, version, id counters, delivery / lag statistics, applied resumes."""
    self.ns, self.version = d["ns"], d["version"]
    self._next_group_id = max(self._next_group_id, d["next_group_id"])
    self._round_start, self._round_leased = d["round_start"], d["round_leased"]
    self.delivered_groups, self.delivered_rollouts = d["delivered_groups"], d["delivered_rollouts"]
    self.expired_groups, self.stale_dropped = d["expired_groups"], d["stale_dropped"]
    self._lag_total, self._lag_negative = list(d["lag_total"]), d["lag_negative"]
    self.resumes = list(d.get("resumes", []))
    self.rewind_totals.update(d.get("rewind_totals", {}))

  def restore_lease(self, d: dict) -> None:
    """LEASE: an outstanding group; a live (not snapshot) lease also replays the prompt sampler."""
    p = self._prompts.get(int(d["pid"]))
    if p is None:
      raise ValueError(f"WAL leases prompt {d['pid']}, which is not in the prompt set")
    view = val.LeaseView(group_id=d["gid"], prompt_id=int(p.prompt_id),
                         prompt_tokens=np.asarray(p.tokens, np.int32), answer=p.answer,
                         group_size=self.G, min_version=d["min_v"], max_version=d["max_v"])
    self._groups[d["gid"]] = Group(view, d["gen"], d["deadline"], self.clock() + self.lease_ttl_s)
    self._next_group_id = max(self._next_group_id, d["gid"] + 1)
    if not d.get("snap"):
      self._replay_take(int(d["pid"]))
      if self.mode == "ppo_off_policy":
        if self._round_start != d["round"]:
          self._round_start, self._round_leased = d["round"], 0
        self._round_leased += 1

  def _replay_take(self, pid: int) -> None:
    """Replays the prompt sampler's pop for a logged lease of `pid` (see `_next_prompt`)."""
    q = self._queue
    while q and q[0] != pid and self.npr is not None and self.npr.is_retired(q[0]):
      q.popleft()
    if q and q[0] == pid:
      q.popleft()
      return
    try:                       # a WAL written before the sampler was logged: best effort
      q.remove(pid)
    except ValueError:
      pass

  def restore_rollout(self, raw: bytes, r: pb.Rollout, checked: val.Checked) -> bool:
    """ROLLOUT: an accepted rollout; False (skipped) for a duplicate or an unknown group."""
    g = self._groups.get(r.group_id)
    if g is None or r.sample_index in g.samples or r.rollout_id in self._seen:
      return False
    self._store(g, r, bytes(raw), checked)
    return True

  def restore_expire(self, gid: int) -> None:
    """EXPIRE: a lease that ran out."""
    if gid in self._groups:
      self._apply_expire(gid)

  def restore_stale(self, gid: int) -> None:
    """STALE: a group dropped as too old for PipelineRL-k."""
    if self._groups.pop(gid, None) is not None:
      self.stale_dropped += 1

  def restore_delivery(self, step: int, gids: list, last: bool) -> None:
    """DELIVER / LAST_BATCH: a batch the learner pulled."""
    self._deliver(step, [self._groups[g] for g in gids], "last" if last else "replay")

  def restore_kept(self, step: int, gids: list) -> None:
    """KEPT: delivered groups held for a learner rewind."""
    self._kept[step] = [self._groups.pop(g) for g in gids]

  def restore_version(self, meta: dict) -> None:
    """VERSION: the newest published weights."""
    self.version = max(self.version, meta["version"])
    self.weights_meta = meta

  def restore_npr(self, pid: int, rewards: list) -> None:
    """NPR: one prompt's rewards added to the No-Positive-Resampling history."""
    if self.npr is not None:
      self.npr.update(pid, rewards)

  def restore_npr_state(self, d: dict) -> None:
    """NPR_STATE: the whole No-Positive-Resampling history."""
    if self.npr is not None:
      self.npr = PassRateHistory.from_dict(d)

  def restore_seen(self, ids: dict) -> None:
    """SEEN: rollout ids already accepted (idempotent pushes)."""
    self._seen.update(ids)

  def restore_queue(self, order: list, rng_state, append: bool, returned: Sequence[int] = ()) -> None:
    """QUEUE (replace; `returned`: its front's group ids) / EPOCH (append): the prompt
    sampler's queue and rng."""
    if append:
      self._queue.extend(order)
    else:
      self._queue.restore(order, returned)
    self._set_rng_state(rng_state)

  # ---- learner resume ----------------------------------------------------------------------------
  def apply_learner_state(self, ls: Optional[dict]) -> Optional[dict]:
    """Applies the learner-state file at startup (before `attach_wal`): a resume request not
    applied yet rewinds the buffer to its checkpoint step (module docstring); delivered groups
    are kept from `retain_from_step` on (none without a learner-state file). Returns the rewind
    report, or None when there was nothing to rewind."""
    with self.cv:
      report = None
      res = (ls or {}).get("resume")
      if res and res["id"] not in self.resumes:
        report = self.rewind(int(res["step"]), res.get("npr"), bool(res.get("start_over")))
        self.resumes.append(res["id"])
        for k in ("requeued_groups", "dropped_lost_version_groups", "dropped_stale_groups",
                  "dropped_incomplete_groups", "missing_steps"):
          self.rewind_totals[k] = self.rewind_totals.get(k, 0) + (
              len(report[k]) if k == "missing_steps" else report[k])
        self.rewind_totals["rewinds"] = self.rewind_totals.get("rewinds", 0) + 1
      retain = None if ls is None else int(ls.get("retain_from_step", ls["checkpoint_step"]))
      self._kept = {s: g for s, g in self._kept.items() if retain is not None and s >= retain}
      return report

  def rewind(self, c: int, npr: Optional[dict], start_over: bool = False) -> dict:
    """Rewinds to learner checkpoint step `c` (replay.py's docstring says what is kept/dropped);
    `start_over`: the learner found no valid checkpoint and starts from step 0 (c == 0)."""
    rep: dict[str, Any] = dict(step=c, from_ns=self.ns, from_version=self.version, requeued_groups=0,
               requeued_rollouts=0, dropped_lost_version_groups=0, dropped_stale_groups=0,
               dropped_incomplete_groups=0, returned_prompts=0,
               missing_steps=[s for s in range(c, self.ns) if s not in self._kept])
    keep, back = [], []

    def judge(g) -> None:
      if not g.complete:
        why = "incomplete"
      elif g.max_version > c:          # generated by a policy of the lost timeline
        why = "lost_version"
      elif g.deadline < c:               # PipelineRL-k: now too old to train
        why = "stale"
      else:
        keep.append(g)
        return
      rep[f"dropped_{why}_groups"] += 1
      self._rewind_drops.setdefault(why, []).append(g.view.group_id)
      back.append(g)
      for st in g.samples.values():
        self._seen.pop(st.rollout_id, None)

    for s in sorted(x for x in self._kept if x >= c):
      for g in self._kept.pop(s):
        judge(g)
    pending = sorted(self._groups.values(),
                     key=lambda g: (g.completed_seq < 0, g.completed_seq, g.view.group_id))
    self._groups = {}
    for g in pending:
      judge(g)
    for i, g in enumerate(keep):          # re-queued first, in delivery / completion order
      g.completed_seq = i
      self._groups[g.view.group_id] = g
      rep["requeued_rollouts"] += len(g.samples)
    self._completed_seq = len(keep)
    rep["requeued_groups"] = len(keep)
    # Back at the front in lease order, with any prompts a release or expiry returned there.
    self._queue.put_back((g.view.group_id, g.view.prompt_id) for g in back)
    rep["returned_prompts"] = len(back)
    self.ns, self.version = c, c
    self._last_batch, self._last_groups = None, []
    if self.weights_meta is not None and self.weights_meta.get("version") != c:
      self.weights_meta = None
    if npr is not None and self.npr is not None:
      self.npr = PassRateHistory.from_dict(npr)
    if self.mode == "ppo_off_policy":
      r = c - c % self.k
      n = sum(1 for g in self._groups.values() if g.view.max_version == r) + (c - r) * self.B
      self._round_start, self._round_leased = (r, n) if n else (-1, 0)
    log.warning("%s: buffer rewound from step %d / version %d: %s",
                "learner started over from step 0 (no valid checkpoint)" if start_over else
                f"learner resumed from checkpoint step {c}", rep["from_ns"], rep["from_version"],
                json.dumps(rep))
    self.cv.notify_all()
    return rep
