"""The durable side of the buffer state: what WAL records mean on replay, and the learner-resume file.

`state.BufferState` owns the data and logs every change; this module says what each WAL record
means on replay (docs/RELIABILITY.md):

  * `HANDLERS`: record type -> handler; each handler calls one public `restore_*` method of the
    state (`BufferState.apply` looks it up), including the prompt sampler (queue + rng) and the
    delivered groups kept for a learner rewind (`KEPT`);
  * `write_learner_state` / `read_learner_state`: the learner's side of a resume. The learner (job.run) writes a small JSON
    file (`write_learner_state`) naming its newest checkpoint step and, when it resumes, a resume
    request {id, step, npr}. At startup the buffer rewinds once per resume id: groups delivered at
    steps >= the checkpoint step were never trained and are re-queued (first, in their original
    order) unless their tokens come from a policy version the resumed learner never had (> step,
    i.e. the lost timeline) or their deadline passed (PipelineRL-k): those are dropped and counted;
    undelivered groups that are incomplete (their generators died with the learner) or hold lost
    versions are dropped too, and every dropped group's prompt goes back to the queue front in lease
    order. `ns` and the version go back to the checkpoint step; the NPR history becomes the
    checkpoint's (`BufferState.rewind`). A learner that starts over after a previous run (no
    valid checkpoint) writes a request for step 0 with `"start_over": true` and a fresh NPR
    history: the same rewind, to step 0 (every group of a version > 0 dropped, version-0 groups
    re-queued).

This module must not import jax (the buffer server process does not).
"""
from __future__ import annotations

import json
from typing import Optional

import numpy as np

from scalerl_jax import storage
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.buffer import wal as walmod


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
  {"id", "step", "npr"} when the learner resumed from checkpoint `step` (applied once per id),
  plus `"start_over": true` when it found no valid checkpoint and starts from step 0."""
  storage.write_text(path, json.dumps(dict(checkpoint_step=int(checkpoint_step),
                                           retain_from_step=int(retain_from_step), resume=resume)))


def read_learner_state(path: Optional[str]) -> Optional[dict]:
  """The learner-state file (a local path or gs://, as the buffer pod reads it from the learner's
  workdir), or None when there is none."""
  if not path or not storage.exists(path):
    return None
  return json.loads(storage.read_text(path))


def _rollout(state, d, body):
  r = pb.Rollout.FromString(body)
  return state.restore_rollout(body, r, checked_from(r))


# Record type -> handler(state, decoded body, raw body); a handler returning False skipped a duplicate.
HANDLERS = {
    walmod.SNAPSHOT: lambda state, d, body: state.restore_counters(d),
    walmod.LEASE: lambda state, d, body: state.restore_lease(d),
    walmod.ROLLOUT: _rollout,
    walmod.EXPIRE: lambda state, d, body: state.restore_expire(d["gid"]),
    walmod.STALE: lambda state, d, body: state.restore_stale(d["gid"]),
    walmod.DELIVER: lambda state, d, body: state.restore_delivery(d["step"], d["gids"], last=False),
    walmod.LAST_BATCH: lambda state, d, body: state.restore_delivery(d["step"], d["gids"], last=True),
    walmod.KEPT: lambda state, d, body: state.restore_kept(d["step"], d["gids"]),
    walmod.VERSION: lambda state, d, body: state.restore_version(d),
    walmod.NPR: lambda state, d, body: state.restore_npr(d["pid"], d["rewards"]),
    walmod.NPR_STATE: lambda state, d, body: state.restore_npr_state(d),
    walmod.SEEN: lambda state, d, body: state.restore_seen(d["ids"]),
    walmod.QUEUE: lambda state, d, body: state.restore_queue(d["queue"], d["rng"], append=False,
                                                             returned=d.get("returned", ())),
    walmod.EPOCH: lambda state, d, body: state.restore_queue(d["order"], d["rng"], append=True),
    walmod.DROP: lambda state, d, body: None,     # audit trail only: the rewind already dropped them
}
