"""Learner crash and resume (issue #8): `kill -9` of the main process after step m, then the same
command again. Synchronous mode (k=0) with fixed seeds is deterministic end to end (generation is
seeded per sample from (seed, version, prompts), the buffer's prompt sampler is in its WAL and is
rewound to the checkpoint), so the resumed run must reproduce the uninterrupted one: the same tokens,
loss masks and rewards, bit for bit. The generator's log-probs agree to LOGPROB_TOL, not bit for bit:
the continuous decoder (generation/continuous.py) computes a chunk over a bucket of rows and a
window of its ring that depend on when each sample was inserted, and XLA:CPU rounds a [rows, ...]
matmul or a [window] softmax differently for different shapes (~1e-6; tokens are unaffected). Those
differences reach the loss and the parameters at the same order, so both are compared within tolerances.

Numbers observed here are tabulated in docs/RELIABILITY.md (run with -s to print them).
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import alive, cmdline, descendants

# One xdist worker for the module: the corrupt-checkpoint test reuses the uninterrupted run.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("resume")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N, M, EVERY = 5, 3, 2   # steps in all; the learner is killed once step M is logged; checkpoints
C = M - M % EVERY       # the checkpoint the resumed run starts from (step M is redone)
LOGPROB_TOL = 1e-5      # generator log-probs across decode layouts (measured ~1e-6; docstring)


def _cmd(wd, steps=N):
  return [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={wd}",
          f"--config.total_steps={steps}", "--config.sft.clean_steps=20", "--config.sft.steps=10",
          "--config.eval.every_steps=100", "--config.eval.samples_per_prompt=1",
          "--config.data.heldout=8", "--config.rollout.max_lag=0",
          f"--config.checkpoint.every_steps={EVERY}", "--config.checkpoint.keep=3",
          "--config.debug_dump_every=1", *_SYNC_SAVE]


# Synchronous checkpoints: step C's checkpoint is committed before step C + 1 trains, so "step M
# is logged" implies "checkpoint C exists" when the test kills the learner. With the default
# asynchronous save the kill could land before step C's save was finalized (fc12, 2026-12-04, commit 99ccc55, 2-core AMD EPYC: a
# loaded box; the run then started over and wrote no resumes.jsonl). Killing mid-save is
# tests/training/test_checkpoint_async.py's subject; here the kill must find checkpoint C.
_SYNC_SAVE = ("--config.checkpoint.async_save=False",)


def _env():
  return {**os.environ, "PYTHONPATH": ROOT}


def _lines(wd):
  return [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]


def _wait_children_gone(kids, timeout_s=30.0):
  """Waits for `kids` to exit; names every survivor (pid and command line) in the failure."""
  end = time.time() + timeout_s
  while any(alive(k) for k in kids) and time.time() < end:
    time.sleep(0.05)
  left = [k for k in kids if alive(k)]
  assert not left, "a child outlived the killed learner: " + "; ".join(
      f"pid {k} [{cmdline(k)[:300] or '?'}]" for k in left)


def _params(wd, step):
  from scalerl_jax.training.checkpoint import read_meta
  import orbax.checkpoint as ocp
  state = ocp.PyTreeCheckpointer().restore(os.path.join(wd, "checkpoints", str(step), "state"))
  return state, read_meta(os.path.join(wd, "checkpoints", str(step)))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  a, b = tmp_path_factory.mktemp("uninterrupted"), tmp_path_factory.mktemp("killed")
  t0 = time.time()
  r = subprocess.run(_cmd(a), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  t_a = time.time() - t0
  shutil.copytree(os.path.join(a, "base_policy"), os.path.join(b, "base_policy"))  # skip its SFT
  t0 = time.time()
  log = open(os.path.join(b, "first.log"), "w")
  p = subprocess.Popen(_cmd(b), cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
  def logged():
    try:
      return any(l["step"] == M and l["kind"] == "train" for l in _lines(b))
    except (OSError, ValueError):
      return False
  while not logged():
    assert p.poll() is None, open(os.path.join(b, "first.log")).read()[-4000:]
    assert time.time() - t0 < 600
    time.sleep(0.01)
  kids = descendants(p.pid)
  os.kill(p.pid, signal.SIGKILL)                # the learner (main process) dies without warning
  p.wait()
  t_kill = time.time()
  steps_at_kill = max(l["step"] for l in _lines(b))
  _wait_children_gone(kids)      # PDEATHSIG, then each child's reaper (SCALERL_CHILD_GRACE_S)
  t_children = time.time() - t_kill
  r = subprocess.run(_cmd(b), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  t_b = time.time() - t0
  return dict(a=str(a), b=str(b), stderr=r.stderr, t_a=t_a, t_b=t_b, steps_at_kill=steps_at_kill,
              children_exit_s=t_children)


def test_resumed_run_matches_uninterrupted(runs):
  a, b = runs["a"], runs["b"]
  res = [json.loads(l) for l in open(os.path.join(b, "resumes.jsonl"))]
  assert len(res) == 1 and res[0]["checkpoint_step"] == C and not res[0]["skipped_checkpoints"]
  assert f"resuming from checkpoint {C}" in runs["stderr"]
  assert res[0]["redo_steps"] >= M - C and res[0]["dropped_metric_lines"] >= M - C
  la, lb = _lines(a), _lines(b)
  ta = {l["step"]: l for l in la if l["kind"] == "train"}
  tb = [l for l in lb if l["kind"] == "train"]
  assert [l["step"] for l in tb] == list(range(1, N + 1))      # no duplicated or missing step
  assert [l["step"] for l in lb if l["kind"] == "eval"] == [0, N]
  c = [l["compute_hours"] for l in lb]
  assert all(y > x for x, y in zip(c, c[1:])), c               # the compute axis continues
  diffs = {l["step"]: abs(l["loss"] - ta[l["step"]]["loss"]) for l in tb}
  assert diffs[M + 1] <= LOGPROB_TOL, diffs
  assert max(diffs.values()) <= LOGPROB_TOL, diffs
  for s in range(N):                                            # the very same batches
    za, zb = (np.load(os.path.join(w, "batches", f"step_{s:06d}.npz")) for w in (a, b))
    for k in ("tokens", "loss_mask", "rewards"):
      np.testing.assert_array_equal(za[k], zb[k], err_msg=f"step {s} {k}")
    np.testing.assert_allclose(za["gen_logprobs"], zb["gen_logprobs"], rtol=0, atol=LOGPROB_TOL,
                               err_msg=f"step {s} gen_logprobs")
  pa, ma = _params(a, N)
  pb, mb = _params(b, N)
  import jax
  d = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
          for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
  assert d <= LOGPROB_TOL, d     # Adam steps of ~lr from log-probs equal to ~1e-6: far below
  assert ma["consumed"]["ids_sha256"] != mb["consumed"]["ids_sha256"]   # rollout ids are uuids
  assert (ma["consumed"]["groups"], ma["consumed"]["rollouts"]) == \
         (mb["consumed"]["groups"], mb["consumed"]["rollouts"])
  gap = res[0]["gap_booked_s"]
  assert gap > 0 and gap >= res[0]["lost_work_s"] + res[0]["downtime_s"] - 1.0
  summary = dict(kill_after_step=M, steps_logged_at_kill=runs["steps_at_kill"],
                 children_exit_s=round(runs["children_exit_s"], 2),
                 loss_diff_step_m_plus_1=diffs[M + 1], max_loss_diff=max(diffs.values()),
                 final_param_max_abs_diff=d, redo_steps=res[0]["redo_steps"],
                 dropped_metric_lines=res[0]["dropped_metric_lines"],
                 buffer_rewind=res[0]["buffer"], gap_booked_s=round(gap, 1),
                 uninterrupted_s=round(runs["t_a"], 1), killed_plus_resumed_s=round(runs["t_b"], 1))
  print("\n[kill9-learner-sync]", json.dumps(summary))


def test_corrupt_newest_checkpoint_falls_back_to_previous(runs, tmp_path):
  """Damage the newest checkpoint of the finished run: the same command again resumes from the
  previous one (saying so), redoes the last step from the buffer's WAL and ends with the same
  params."""
  c = str(tmp_path / "corrupt")
  shutil.copytree(runs["a"], c)
  state_dir = os.path.join(c, "checkpoints", str(N), "state")
  big = max((os.path.join(r, f) for r, _, fs in os.walk(state_dir) for f in fs), key=os.path.getsize)
  with open(big, "r+b") as f:                   # flip 16 bytes in the middle of the array data
    f.seek(os.path.getsize(big) // 2)
    chunk = f.read(16)
    f.seek(-len(chunk), 1)
    f.write(bytes(x ^ 0xFF for x in chunk))
  t0 = time.time()
  r = subprocess.run(_cmd(c), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  wall = time.time() - t0
  rel = os.path.relpath(big, os.path.join(c, "checkpoints", str(N)))
  assert f"checkpoint {N} is not valid: {rel} sha256 mismatch" in r.stderr
  assert f"resuming from checkpoint {N - 1} instead (fell back from {N})" in r.stderr
  res = [json.loads(l) for l in open(os.path.join(c, "resumes.jsonl"))]
  assert res[-1]["checkpoint_step"] == N - 1 and res[-1]["skipped_checkpoints"][0]["step"] == N
  assert os.path.isdir(res[-1]["skipped_checkpoints"][0]["moved_to"])
  train = [l["step"] for l in _lines(c) if l["kind"] == "train"]
  assert train == list(range(1, N + 1))
  pa, _ = _params(runs["a"], N)
  pc, _ = _params(c, N)
  import jax
  d = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
          for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pc)))
  assert d == 0.0, d            # step N redone from the WAL's rollouts: the very same batch
  print("\n[corrupt-checkpoint]", json.dumps(dict(corrupted=rel, fell_back_to=N - 1,
                                                  buffer_rewind=res[-1]["buffer"],
                                                  final_param_max_abs_diff=d, wall_s=round(wall, 1))))


def test_async_two_generators_kill9_learner_resumes_without_training_a_rollout_twice(tmp_path):
  """PipelineRL-2 with two JAX generators (not deterministic: lease batching depends on timing):
  kill -9 of the learner mid-run, same command again. Promised (docs/RELIABILITY.md "Resume with
  k > 0"): the step target is reached, every step is logged once, lag <= k; every acknowledged
  rollout (the buffer's WAL, archive included) is trained exactly once or dropped with a reason
  the WAL names (or is still in the buffer at the end), none trained twice; the first redone step
  trains the very same rollout ids, in the same order, as the crashed run's step c and logs the
  same loss bit for bit (same checkpointed params, batch re-queued first in delivery order)."""
  wd = str(tmp_path / "async")
  steps, kill_at = 6, 3
  cmd = _cmd(wd, steps)
  cmd = [a for a in cmd if "max_lag" not in a and "checkpoint." not in a] + [
      "--config.rollout.max_lag=2", "--config.generator.num_workers=2",
      "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=20",
      "--config.audit.trained_ids=True", "--config.audit.wal_archive=True"]
  t0 = time.time()
  p = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
  while not any(l["step"] == kill_at and l["kind"] == "train"
                for l in (_lines(wd) if os.path.exists(os.path.join(wd, "metrics.jsonl")) else [])):
    assert p.poll() is None and time.time() - t0 < 600
    time.sleep(0.01)
  kids = descendants(p.pid)
  os.kill(p.pid, signal.SIGKILL)
  p.wait()
  _wait_children_gone(kids)
  crashed_lines = _lines(wd)
  crashed_ids = {r["step"]: r["ids"] for r in map(json.loads, open(os.path.join(wd, "trained_ids.jsonl")))}
  r = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  res = [json.loads(l) for l in open(os.path.join(wd, "resumes.jsonl"))]
  assert len(res) == 1
  c = res[0]["checkpoint_step"]
  train = [l for l in _lines(wd) if l["kind"] == "train"]
  assert [l["step"] for l in train] == list(range(1, steps + 1))
  assert all(l["max_lag"] <= 2 for l in train)
  from scalerl_jax.training.checkpoint import read_meta, step_dirs
  ids, per_step = [], {}
  for _s, d in step_dirs(wd):
    for k, v in read_meta(d)["consumed"]["recent"].items():
      per_step[int(k)] = v
  assert sorted(per_step) == list(range(steps))
  ids = [i for s in sorted(per_step) for i in per_step[s]]
  assert len(ids) == len(set(ids)) == steps * 64
  last = read_meta(step_dirs(wd)[-1][1])["consumed"]
  assert (last["groups"], last["rollouts"]) == (steps * 8, steps * 64)
  # The audit trail: every acknowledged rollout's fate (tools/audit.py).
  from scalerl_jax.tools.audit import rollout_ledger
  led = rollout_ledger(os.path.join(wd, "buffer_wal"), os.path.join(wd, "trained_ids.jsonl"))
  assert led["fate"]["lost"] == 0 and led["duplicated"] == 0 and led["trained_not_acked"] == 0, led
  assert led["fate"]["trained"] == steps * 64 and not led["steps_logged_twice"], led
  final_ids = {r["step"]: r["ids"] for r in map(json.loads, open(os.path.join(wd, "trained_ids.jsonl")))}
  assert [i for s in sorted(final_ids) for i in final_ids[s]] == ids
  rw = res[0]["buffer"]
  for why in ("incomplete", "lost_version", "stale"):   # the WAL's DROP records = the counts
    assert led["rewind_drop_groups"].get(why, 0) == rw[f"dropped_{why}_groups"], (why, led, rw)
  same_first = None
  if c + 1 in crashed_ids:       # the crashed run had pulled step c: redone with the same batch
    assert final_ids[c + 1] == crashed_ids[c + 1]
    old = {l["step"]: l for l in crashed_lines if l["kind"] == "train"}
    if c + 1 in old:
      new = {l["step"]: l for l in train}
      assert new[c + 1]["loss"] == old[c + 1]["loss"], (new[c + 1]["loss"], old[c + 1]["loss"])
    same_first = True
  print("\n[kill9-learner-async]", json.dumps(dict(
      resumed_from=c, redo_steps=res[0]["redo_steps"], first_redone_step_same_batch=same_first,
      buffer_rewind=rw, trained_ids=len(ids), unique=len(set(ids)), ledger=led["fate"],
      acked=led["acked"], wall_s=round(time.time() - t0, 1))))
