"""The durable side of the buffer state: WAL logging, startup compaction, replay, learner rewind.

`WalStateMixin` is mixed into `admission.BufferState` (which owns the scheduling logic); it holds
everything that turns the in-memory state into WAL records and back (docs/RELIABILITY.md):

  * `_wal_append` / `_wal_commit`: log a change; a failed commit refuses the request;
  * `attach_wal`: compaction — the whole state as a fresh snapshot segment (`_snapshot_records`);
  * `restore`: replay of the records, including the prompt sampler (queue + rng) and the delivered
    groups kept for a learner rewind (`KEPT`);
  * `apply_learner_state`: the learner's side of a resume. The learner (job.run) writes a small JSON
    file (`write_learner_state`) naming its newest checkpoint step and, when it resumes, a resume
    request {id, step, npr}. At startup the buffer rewinds once per resume id: groups delivered at
    steps >= the checkpoint step were never trained and are re-queued (first, in their original
    order) unless their tokens come from a policy version the resumed learner never had (> step,
    i.e. the lost timeline) or their deadline passed (PipelineRL-k): those are dropped and counted;
    undelivered groups that are incomplete (their generators died with the learner) or hold lost
    versions are dropped too, and every dropped group's prompt goes back to the queue front in lease
    order. `ns` and the version go back to the checkpoint step; the NPR history becomes the
    checkpoint's.

This module must not import jax (the buffer server process does not).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

import grpc
import numpy as np

from scalerl_jax.rollout import codec
from scalerl_jax.rollout import rollout_pb2 as pb
from scalerl_jax.rollout import validation as val
from scalerl_jax.rollout import wal as walmod

log = logging.getLogger("scalerl.buffer")


def checked_from(r: pb.Rollout) -> val.Checked:
  """What validation recorded about an already-accepted rollout (WAL replay; not re-validated)."""
  v = codec.decode(r.versions, pb.INT32, "versions", 1 << 31).astype(np.int64)
  vmin = int(v.min()) if len(v) else 0
  counts = np.bincount(v - vmin) if len(v) else np.zeros(1, np.int64)
  return val.Checked(num_tokens=len(v), min_version=vmin, version_counts=counts,
                     reward=float(r.rewards[0]) if len(r.rewards) else 0.0)


def write_learner_state(path: str, checkpoint_step: int, retain_from_step: int,
                        resume: Optional[dict] = None) -> None:
  """Atomically writes the file the buffer reads at every startup (`--learner-state`).

  `checkpoint_step`: the learner's newest durable checkpoint; `retain_from_step`: the oldest one it
  may still fall back to (delivered groups from that step on are kept in the WAL); `resume`:
  {"id", "step", "npr"} when the learner resumed from checkpoint `step` (applied once per id)."""
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(dict(checkpoint_step=int(checkpoint_step), retain_from_step=int(retain_from_step),
                   resume=resume), f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def read_learner_state(path: Optional[str]) -> Optional[dict]:
  """The learner-state file, or None when there is none."""
  if not path or not os.path.exists(path):
    return None
  with open(path) as f:
    return json.load(f)


def _max_version(g) -> int:
  return max((st.checked.min_version + len(st.checked.version_counts) - 1
              for st in g.samples.values()), default=-1)


class WalStateMixin:
  """WAL, replay and rewind methods of `admission.BufferState` (see the module docstring)."""

  # ---- logging -----------------------------------------------------------------------------------
  def _wal_append(self, rtype: int, body) -> None:
    if self.wal is not None:
      self.wal.append(rtype, body)

  def _wal_commit(self, best_effort: bool = False) -> None:
    if self.wal is None:
      return
    try:
      self.wal.commit()
    except OSError as e:
      self.wal.discard()
      if best_effort:
        log.error("WAL write failed: %s", e)
        return
      raise val.RejectError(grpc.StatusCode.UNAVAILABLE, f"write-ahead log write failed: {e}")

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
      name = wal.start_snapshot(self._snapshot_records())
      self.wal = wal
      self._kept = {}            # on disk now; the next replay reads them back
      return name

  def _snapshot_records(self):
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
    yield enc(walmod.QUEUE, dict(queue=[int(p) for p in self._queue], rng=self._rng_state()))
    last_step = self._last_batch.step if self._last_batch is not None else None
    kept = {s: gs for s, gs in self._kept.items() if s != last_step}
    live = (set(self._groups) | {g.view.group_id for g in self._last_groups}
            | {g.view.group_id for gs in kept.values() for g in gs})
    yield enc(walmod.SEEN, dict(ids={r: g for r, g in self._seen.items() if g not in live}))

    def group(g):
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

  # ---- replay ------------------------------------------------------------------------------------
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

  def restore(self, records) -> dict:
    """Rebuilds the state from WAL records (see wal.py); call before serving. Returns counts."""
    from scalerl_jax.rollout.admission import _Group
    with self.cv:
      now = self.clock()
      skipped = 0
      for rtype, body in records:
        d = walmod.decode_body(rtype, body)
        if rtype == walmod.SNAPSHOT:
          self.ns, self.version = d["ns"], d["version"]
          self._next_group_id = max(self._next_group_id, d["next_group_id"])
          self._round_start, self._round_leased = d["round_start"], d["round_leased"]
          self.delivered_groups, self.delivered_rollouts = d["delivered_groups"], d["delivered_rollouts"]
          self.expired_groups, self.stale_dropped = d["expired_groups"], d["stale_dropped"]
          self._lag_total, self._lag_negative = list(d["lag_total"]), d["lag_negative"]
          self.resumes = list(d.get("resumes", []))
          self.rewind_totals.update(d.get("rewind_totals", {}))
        elif rtype == walmod.LEASE:
          p = self._prompts.get(int(d["pid"]))
          if p is None:
            raise ValueError(f"WAL leases prompt {d['pid']}, which is not in the prompt set")
          view = val.LeaseView(group_id=d["gid"], prompt_id=int(p.prompt_id),
                               prompt_tokens=np.asarray(p.tokens, np.int32), answer=p.answer,
                               group_size=self.G, min_version=d["min_v"], max_version=d["max_v"])
          self._groups[d["gid"]] = _Group(view, d["gen"], d["deadline"], now + self.lease_ttl_s)
          self._next_group_id = max(self._next_group_id, d["gid"] + 1)
          if not d.get("snap"):
            self._replay_take(int(d["pid"]))
            if self.mode == "ppo_off_policy":
              if self._round_start != d["round"]:
                self._round_start, self._round_leased = d["round"], 0
              self._round_leased += 1
        elif rtype == walmod.ROLLOUT:
          r = pb.Rollout.FromString(body)
          g = self._groups.get(r.group_id)
          if g is None or r.sample_index in g.samples or r.rollout_id in self._seen:
            skipped += 1
            continue
          self._store(g, r, bytes(body), checked_from(r))
        elif rtype == walmod.EXPIRE:
          if d["gid"] in self._groups:
            self._apply_expire(d["gid"])
        elif rtype == walmod.STALE:
          if self._groups.pop(d["gid"], None) is not None:
            self.stale_dropped += 1
        elif rtype in (walmod.DELIVER, walmod.LAST_BATCH):
          groups = [self._groups[g] for g in d["gids"]]
          self._deliver(d["step"], groups, "replay" if rtype == walmod.DELIVER else "last")
        elif rtype == walmod.KEPT:
          self._kept[d["step"]] = [self._groups.pop(g) for g in d["gids"]]
        elif rtype == walmod.VERSION:
          self.version = max(self.version, d["version"])
          self.weights_meta = d
        elif rtype == walmod.NPR:
          if self.npr is not None:
            self.npr.update(d["pid"], d["rewards"])
        elif rtype == walmod.NPR_STATE:
          if self.npr is not None:
            from scalerl_jax.rl.npr import PassRateHistory
            self.npr = PassRateHistory.from_dict(d)
        elif rtype == walmod.SEEN:
          self._seen.update(d["ids"])
        elif rtype == walmod.QUEUE:
          self._queue.clear()
          self._queue.extend(d["queue"])
          self._set_rng_state(d["rng"])
        elif rtype == walmod.EPOCH:
          self._queue.extend(d["order"])
          self._set_rng_state(d["rng"])
      for g in self._groups.values():           # generators get a full TTL to reconnect
        g.expires_at = now + self.lease_ttl_s
      self.cv.notify_all()
      return dict(ns=self.ns, version=self.version, outstanding_groups=len(self._groups),
                  ready_groups=sum(1 for g in self._groups.values() if g.complete),
                  stored_rollouts=sum(len(g.samples) for g in self._groups.values()),
                  delivered_groups=self.delivered_groups, seen_ids=len(self._seen),
                  skipped_rollouts=skipped, kept_steps=sorted(self._kept),
                  queued_prompts=len(self._queue))

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
        report = self._rewind(int(res["step"]), res.get("npr"))
        self.resumes.append(res["id"])
        for k in ("requeued_groups", "dropped_lost_version_groups", "dropped_stale_groups",
                  "dropped_incomplete_groups", "missing_steps"):
          self.rewind_totals[k] = self.rewind_totals.get(k, 0) + (
              len(report[k]) if k == "missing_steps" else report[k])
        self.rewind_totals["rewinds"] = self.rewind_totals.get("rewinds", 0) + 1
      retain = None if ls is None else int(ls.get("retain_from_step", ls["checkpoint_step"]))
      self._kept = {s: g for s, g in self._kept.items() if retain is not None and s >= retain}
      return report

  def _rewind(self, c: int, npr: Optional[dict]) -> dict:
    rep = dict(step=c, from_ns=self.ns, from_version=self.version, requeued_groups=0,
               requeued_rollouts=0, dropped_lost_version_groups=0, dropped_stale_groups=0,
               dropped_incomplete_groups=0, returned_prompts=0,
               missing_steps=[s for s in range(c, self.ns) if s not in self._kept])
    keep, back = [], []

    def judge(g) -> None:
      if not g.complete:
        rep["dropped_incomplete_groups"] += 1
      elif _max_version(g) > c:          # generated by a policy of the lost timeline
        rep["dropped_lost_version_groups"] += 1
      elif g.deadline < c:               # PipelineRL-k: now too old to train
        rep["dropped_stale_groups"] += 1
      else:
        keep.append(g)
        return
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
    back.sort(key=lambda g: g.view.group_id)     # lease order
    self._queue.extendleft(reversed([g.view.prompt_id for g in back]))
    rep["returned_prompts"] = len(back)
    self.ns, self.version = c, c
    self._last_batch, self._last_groups = None, []
    if self.weights_meta is not None and self.weights_meta.get("version") != c:
      self.weights_meta = None
    if npr is not None and self.npr is not None:
      from scalerl_jax.rl.npr import PassRateHistory
      self.npr = PassRateHistory.from_dict(npr)
    if self.mode == "ppo_off_policy":
      r = c - c % self.k
      n = sum(1 for g in self._groups.values() if g.view.max_version == r) + (c - r) * self.B
      self._round_start, self._round_leased = (r, n) if n else (-1, 0)
    log.warning("learner resumed from checkpoint step %d: buffer rewound from step %d / version "
                "%d: %s", c, rep["from_ns"], rep["from_version"], json.dumps(rep))
    self.cv.notify_all()
    return rep
