"""Audit a finished run from its files: what happened to every acknowledged rollout, and the run's
invariants (docs/RELIABILITY.md "Chaos runs").

  python -m scalerl_jax.tools.audit WORKDIR [--wal-dir DIR] [--max-lag K] [--total-steps N]

Needs a run made with `config.audit.trained_ids=True` (WORKDIR/trained_ids.jsonl: the rollout ids of
each step, truncated on resume like metrics.jsonl, so it holds the final timeline) and
`config.audit.wal_archive=True` (the buffer keeps every compacted WAL segment in
WAL_DIR/archive/, so every ROLLOUT record it ever acknowledged is still on disk).

Every acknowledged rollout (a ROLLOUT record in any segment: the buffer logs a rollout before it
acks it) ends in exactly one of: trained (once, in the final timeline); dropped with a reason the
WAL names (its group expired: EXPIRE, went stale before delivery: STALE, or a learner rewind dropped
it: DROP incomplete / lost_version / stale); or still in the buffer at the end (an undelivered group
of the newest replay chain). Anything else is `lost`; an id trained twice is `duplicated`.

No JAX: reads the WAL with buffer/wal.py and the JSON files.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from scalerl_jax.buffer import wal as walmod
from scalerl_jax.protocol import rollout_pb2 as pb


def _jsonl(path: str) -> list[dict]:
  out = []
  if os.path.exists(path):
    for line in open(path):
      try:
        out.append(json.loads(line))
      except ValueError:          # a torn last line of a killed process
        pass
  return out


def rollout_ledger(wal_dir: str, trained_ids_path: str) -> dict:
  """Fate of every acknowledged rollout id (module docstring)."""
  acked: dict[str, int] = {}
  terminal: dict[int, str] = {}
  drops: dict[str, int] = {}            # learner rewinds: groups dropped per reason (DROP records)
  segs = walmod.audit_segments(wal_dir)
  for path in segs:
    recs, _ = walmod.read_segment(path, truncate=False)
    for rtype, body in recs:
      if rtype == walmod.ROLLOUT:
        r = pb.Rollout.FromString(body)
        acked.setdefault(r.rollout_id, int(r.group_id))
      elif rtype == walmod.EXPIRE:
        terminal[int(json.loads(body)["gid"])] = "expired"
      elif rtype == walmod.STALE:
        terminal[int(json.loads(body)["gid"])] = "stale"
      elif rtype == walmod.DROP:
        d = json.loads(body)
        drops[d["reason"]] = drops.get(d["reason"], 0) + len(d["gids"])
        for g in d["gids"]:
          terminal[int(g)] = "rewind_" + d["reason"]
  # The newest replay chain: groups the buffer still held, undelivered, when it last stopped.
  records, _ = walmod.read_all(wal_dir, truncate=False)
  live, delivered = set(), set()
  for rtype, body in records:
    if rtype == walmod.LEASE:
      live.add(int(json.loads(body)["gid"]))
    elif rtype == walmod.ROLLOUT:
      live.add(int(pb.Rollout.FromString(body).group_id))
    elif rtype in (walmod.DELIVER, walmod.LAST_BATCH, walmod.KEPT):
      delivered.update(int(g) for g in json.loads(body)["gids"])
    elif rtype in (walmod.EXPIRE, walmod.STALE):
      delivered.add(int(json.loads(body)["gid"]))
  outstanding = live - delivered
  trained: dict[str, int] = {}
  steps: dict[int, int] = {}
  for rec in _jsonl(trained_ids_path):
    steps[int(rec["step"])] = steps.get(int(rec["step"]), 0) + 1
    for i in rec["ids"]:
      trained[i] = trained.get(i, 0) + 1
  fate = {"trained": 0, "left_in_buffer": 0, "lost": 0}
  lost, dup = [], [i for i, n in trained.items() if n > 1]
  for rid, gid in acked.items():
    if rid in trained:
      fate["trained"] += 1
    elif gid in terminal:
      fate["dropped_" + terminal[gid]] = fate.get("dropped_" + terminal[gid], 0) + 1
    elif gid in outstanding:
      fate["left_in_buffer"] += 1
    else:
      fate["lost"] += 1
      lost.append(rid)
  never_acked = [i for i in trained if i not in acked]
  return dict(acked=len(acked), trained_ids=len(trained), fate=fate, duplicated=len(dup),
              trained_not_acked=len(never_acked), lost_examples=lost[:5],
              duplicated_examples=dup[:5], segments=len(segs), rewind_drop_groups=drops,
              steps_logged_twice=sorted(s for s, n in steps.items() if n > 1))


def audit(workdir: str, wal_dir: str | None = None, max_lag: int | None = None,
          total_steps: int | None = None) -> dict:
  """{"ledger": rollout_ledger(...), "invariants": name -> bool, "details": name -> str}."""
  cfg = {}
  if os.path.exists(os.path.join(workdir, "config.json")):
    cfg = json.load(open(os.path.join(workdir, "config.json")))
  if max_lag is None:
    max_lag = int(cfg.get("rollout", {}).get("max_lag", 0))
  if total_steps is None:
    total_steps = int(cfg.get("total_steps", 0))
  wal_dir = wal_dir or os.path.join(workdir, "buffer_wal")
  led = rollout_ledger(wal_dir, os.path.join(workdir, "trained_ids.jsonl"))
  lines = _jsonl(os.path.join(workdir, "metrics.jsonl"))
  train = [l for l in lines if l.get("kind") == "train"]
  resumes = _jsonl(os.path.join(workdir, "resumes.jsonl"))
  inv, det = {}, {}
  inv["every_acked_rollout_trained_once_or_dropped_with_reason"] = (
      led["fate"]["lost"] == 0 and led["duplicated"] == 0 and led["trained_not_acked"] == 0
      and not led["steps_logged_twice"] and led["acked"] > 0)
  det["every_acked_rollout_trained_once_or_dropped_with_reason"] = json.dumps(
      dict(acked=led["acked"], **led["fate"], duplicated=led["duplicated"],
           trained_not_acked=led["trained_not_acked"]))
  lags = [int(l.get("max_lag", 0)) for l in train]
  inv["no_trained_token_more_than_k_behind"] = bool(train) and max(lags) <= max_lag
  det["no_trained_token_more_than_k_behind"] = f"max lag {max(lags) if lags else None} <= k={max_lag}"
  c = [float(l["compute_hours"]) for l in lines if "compute_hours" in l]
  inc = all(y > x for x, y in zip(c, c[1:]))
  gaps = [r.get("gap_booked_s") for r in resumes]
  booked = all(g is not None and g > 0 and g >= (r.get("lost_work_s") or 0)
               + (r.get("downtime_s") or 0) - 1.0 for g, r in zip(gaps, resumes))
  inv["compute_axis_increasing_with_crash_gaps_booked"] = bool(c) and inc and booked
  det["compute_axis_increasing_with_crash_gaps_booked"] = (
      f"{len(c)} points strictly increasing={inc}; {len(resumes)} resumes, gaps booked "
      f"{[round(g, 1) if g else g for g in gaps]}")
  bad = [l["step"] for l in train
         if not all(math.isfinite(float(l[k])) for k in ("loss", "grad_norm") if k in l)]
  inv["no_nan_step"] = bool(train) and not bad
  det["no_nan_step"] = f"{len(train)} train steps, non-finite: {bad[:5]}"
  steps = [int(l["step"]) for l in train]
  inv["run_reaches_total_steps"] = steps == list(range(1, total_steps + 1))
  det["run_reaches_total_steps"] = (f"train steps logged {steps[:1]}..{steps[-1:]} "
                                    f"({len(steps)} lines, {len(set(steps))} distinct) of {total_steps}")
  return dict(ledger=led, invariants=inv, details=det, resumes=len(resumes))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("workdir")
  ap.add_argument("--wal-dir", default=None)
  ap.add_argument("--max-lag", type=int, default=None)
  ap.add_argument("--total-steps", type=int, default=None)
  a = ap.parse_args(argv)
  out = audit(a.workdir, a.wal_dir, a.max_lag, a.total_steps)
  for k, v in out["invariants"].items():
    print(f"{'PASS' if v else 'FAIL'}  {k}: {out['details'][k]}")
  print(json.dumps(dict(invariants=out["invariants"], ledger=out["ledger"])))
  return 0 if all(out["invariants"].values()) else 1


if __name__ == "__main__":
  sys.exit(main())
