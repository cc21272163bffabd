"""What launch.rehearse reads back after a rehearsal: the pods' logs (jax.distributed processes,
the run-config knobs each pod logged, weights served and fetched), the buffer's WAL, and the
buffer-kill check (acknowledged rollouts at the kill against the final WAL)."""
from __future__ import annotations

import glob
import json
import os
import re

from launch.rehearse_pods import Pod, component_of
from scalerl_jax.buffer import wal as walmod
from scalerl_jax.protocol import rollout_pb2 as pb


def read_logs(r, p: Pod) -> str:
  out = []
  for f in sorted(glob.glob(os.path.join(r.state, "pods", p.name, "*.log"))):
    with open(f, errors="replace") as fh:
      out.append(fh.read())
  return "\n".join(out)


def learner_processes(r) -> dict:
  """Per learner pod: the jax.distributed process index and count it reported."""
  out = {}
  for p in r.learners():
    text = read_logs(r, p)
    m = re.findall(r"jax\.distributed: process (\d+) of (\d+)", text)
    out[p.name] = {"process": int(m[-1][0]), "of": int(m[-1][1])} if m else None
  return out


def logged_knobs(r) -> dict:
  """Per pod and role: the run-config knobs its process logged at its last start
  (`run config (ROLE): k=v ...`, config.knob_line), and the learner's devices."""
  out = {}
  for p in r.pods:
    text = read_logs(r, p)
    got = {}
    for role, rest in re.findall(r"run config \((\w+)\): (.*)", text):
      got[role] = dict(re.findall(r"(\S+?)=((?:\([^=]*\)\)|\S+))(?= \S+=|$)", rest.strip()))
    m = re.findall(r"learner devices: (\d+) local of (\d+) in (\d+) processes", text)
    if m:
      got["devices"] = {"local": int(m[-1][0]), "global": int(m[-1][1]), "processes": int(m[-1][2])}
    out[p.name] = got
  return out


def weights_served(r) -> dict:
  """Chunks served per learner pod (its log) and learner sources each generator fetched from."""
  ip_of = {p.ip: p.name for p in r.pods}
  served, fetched = {}, {}
  for p in r.pods:
    text = read_logs(r, p)
    if component_of(p) == "learner":
      served[p.name] = sum(int(n) for n in re.findall(r"served weights version \d+: (\d+) chunks",
                                                      text))
    elif component_of(p) == "generator":
      srcs = {}
      for blob in re.findall(r"fetched weights version \d+ from learner sources (\{[^}]*\})", text):
        for addr, n in re.findall(r"'([^']+)': (\d+)", blob):
          name = ip_of.get(addr.rsplit(":", 1)[0].strip("[]"), addr)
          srcs[name] = srcs.get(name, 0) + int(n)
      fetched[p.name] = srcs
  return {"served_chunks": served, "fetched_chunks_by_source": fetched}


def buffer_state(r, p: Pod) -> dict:
  """From the buffer's own state: its WAL (segments, NPR records) and the NPR threshold of the run
  config it resolved (its `run config (buffer): ...` log line)."""
  c = p.spec["containers"][0]
  argv, _ = r.command(p, c)
  flags = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
  wal_dir = flags.get("--wal-dir", "")
  npr = re.findall(r"run config \(buffer\): .*?\brl\.npr_threshold=(\S+)", read_logs(r, p))
  out = {"npr_threshold": npr[-1] if npr else None, "wal_dir": wal_dir}
  if wal_dir and os.path.isdir(wal_dir):
    records, _ = walmod.read_all(wal_dir, truncate=False)
    kinds = {}
    for t, _ in records:
      kinds[walmod.NAMES.get(t, str(t))] = kinds.get(walmod.NAMES.get(t, str(t)), 0) + 1
    out["wal_files"] = sorted(os.listdir(wal_dir))
    out["wal_bytes"] = sum(os.path.getsize(os.path.join(wal_dir, f)) for f in os.listdir(wal_dir))
    out["wal_records"] = kinds
    npr = [json.loads(b) for t, b in records if t == walmod.NPR_STATE]
    out["npr_state"] = npr[-1] if npr else None
  return out


def kill_check(k: dict) -> dict:
  """Acknowledged rollouts (the WAL at the kill) against what the final WAL says was delivered or
  is still stored; every group delivered at most once across both."""

  def scan(d) -> tuple[dict, set, list, set]:
    rolls, seen, deliver, last = {}, set(), [], set()
    records, _ = walmod.read_all(d, truncate=False)
    for t, body in records:
      if t == walmod.ROLLOUT:
        x = pb.Rollout.FromString(body)
        rolls[x.rollout_id] = x.group_id
      elif t == walmod.SEEN:
        seen.update(json.loads(body)["ids"])
      elif t == walmod.DELIVER:
        b = json.loads(body)
        deliver.append((b["step"], tuple(b["gids"])))
      elif t == walmod.LAST_BATCH:
        last.update(json.loads(body)["gids"])
    return rolls, seen, deliver, last
  a_rolls, a_seen, a_deliver, _ = scan(k["wal_at_kill"])
  f_rolls, f_seen, f_deliver, f_last = scan(k["wal_dir"])
  delivered_groups = {g for _, gs in a_deliver + f_deliver for g in gs} | f_last
  delivered = set(f_seen) | set(a_seen) | {r for r, g in {**a_rolls, **f_rolls}.items()
                                           if g in delivered_groups}
  acked = set(a_rolls) | set(a_seen)
  lost = sorted(acked - delivered - set(f_rolls))
  by_step: dict[int, set] = {}
  for step, gs in a_deliver + f_deliver:
    by_step.setdefault(step, set()).add(gs)
  twice = {}
  owner: dict[int, int] = {}
  for step, batches in by_step.items():
    if len(batches) > 1:
      twice[f"step {step}"] = "different batches"
    for g in next(iter(batches)):
      if g in owner and owner[g] != step:
        twice[f"group {g}"] = [owner[g], step]
      owner[g] = step
  return {"acked_at_kill": len(acked), "delivered_by_end": len(delivered),
          "stored_at_end": len(f_rolls), "lost": lost[:20], "lost_count": len(lost),
          "trained_twice": twice, "delivered_steps": sorted(by_step)}
