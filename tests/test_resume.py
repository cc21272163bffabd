"""Learner crash and resume (issue #8): `kill -9` of the main process after step m, then the same
command again. Synchronous mode (k=0) with fixed seeds is deterministic end to end (generation is
seeded per lease from (seed, version, prompts), the buffer's prompt sampler is in its WAL and is
rewound to the checkpoint), so the resumed run must reproduce the uninterrupted one exactly.

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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N, M = 4, 2          # steps in all; the learner is killed once checkpoint M is on disk


def _cmd(wd, steps=N):
  return [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={wd}",
          f"--config.total_steps={steps}", "--config.sft.clean_steps=20", "--config.sft.steps=10",
          "--config.eval.every_steps=100", "--config.eval.samples_per_prompt=1",
          "--config.data.heldout=8", "--config.rollout.max_lag=0",
          "--config.checkpoint.every_steps=1", "--config.checkpoint.keep=3",
          "--config.debug_dump_every=1"]


def _env():
  return {**os.environ, "PYTHONPATH": ROOT}


def _lines(wd):
  return [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]


def _children(pid):
  out = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        if int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
          out.append(int(d))
      except (OSError, IndexError, ValueError):
        pass
  return out


def _alive(pid):
  try:
    st = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    return st != "Z"
  except OSError:
    return False


def _params(wd, step):
  from scalerl_jax.checkpoint import read_meta
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
  manifest = os.path.join(b, "checkpoints", str(M), "manifest.json")
  while not os.path.exists(manifest):
    assert p.poll() is None, open(os.path.join(b, "first.log")).read()[-4000:]
    assert time.time() - t0 < 600
    time.sleep(0.02)
  kids = _children(p.pid)
  os.kill(p.pid, signal.SIGKILL)                # the learner (main process) dies without warning
  p.wait()
  t_kill = time.time()
  steps_at_kill = max(l["step"] for l in _lines(b))
  end = time.time() + 30
  while any(_alive(k) for k in kids) and time.time() < end:   # children follow (PDEATHSIG)
    time.sleep(0.05)
  assert not any(_alive(k) for k in kids), "a child outlived the killed learner"
  t_children = time.time() - t_kill
  r = subprocess.run(_cmd(b), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  t_b = time.time() - t0
  return dict(a=str(a), b=str(b), stderr=r.stderr, t_a=t_a, t_b=t_b, steps_at_kill=steps_at_kill,
              children_exit_s=t_children)


def test_resumed_run_matches_uninterrupted(runs):
  a, b = runs["a"], runs["b"]
  res = [json.loads(l) for l in open(os.path.join(b, "resumes.jsonl"))]
  assert len(res) == 1 and res[0]["checkpoint_step"] == M and not res[0]["skipped_checkpoints"]
  assert "resuming from checkpoint 2" in runs["stderr"]
  la, lb = _lines(a), _lines(b)
  ta = {l["step"]: l for l in la if l["kind"] == "train"}
  tb = [l for l in lb if l["kind"] == "train"]
  assert [l["step"] for l in tb] == list(range(1, N + 1))      # no duplicated or missing step
  assert [l["step"] for l in lb if l["kind"] == "eval"] == [0, N]
  c = [l["compute_hours"] for l in lb]
  assert all(y > x for x, y in zip(c, c[1:])), c               # the compute axis continues
  diffs = {l["step"]: abs(l["loss"] - ta[l["step"]]["loss"]) for l in tb}
  assert diffs[M + 1] <= 1e-6, diffs
  assert max(diffs.values()) <= 1e-6, diffs
  for s in range(N):                                            # the very same batches
    za, zb = (np.load(os.path.join(w, "batches", f"step_{s:06d}.npz")) for w in (a, b))
    for k in ("tokens", "gen_logprobs", "loss_mask", "rewards"):
      np.testing.assert_array_equal(za[k], zb[k], err_msg=f"step {s} {k}")
  pa, ma = _params(a, N)
  pb, mb = _params(b, N)
  import jax
  d = max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
          for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)))
  assert d == 0.0, d
  assert ma["consumed"]["ids_sha256"] != mb["consumed"]["ids_sha256"]   # rollout ids are uuids
  assert (ma["consumed"]["groups"], ma["consumed"]["rollouts"]) == \
         (mb["consumed"]["groups"], mb["consumed"]["rollouts"])
  gap = res[0]["gap_booked_s"]
  assert gap > 0 and lb[-1]["compute_hours"] > [l for l in lb if l["step"] == M][-1]["compute_hours"]
  summary = dict(kill_after_step=M, steps_logged_at_kill=runs["steps_at_kill"],
                 children_exit_s=round(runs["children_exit_s"], 2),
                 loss_diff_step_m_plus_1=diffs[M + 1], max_loss_diff=max(diffs.values()),
                 final_param_max_abs_diff=d, redo_steps=res[0]["redo_steps"],
                 dropped_metric_lines=res[0]["dropped_metric_lines"],
                 buffer_rewind=res[0]["buffer"], gap_booked_s=round(gap, 1),
                 uninterrupted_s=round(runs["t_a"], 1), killed_plus_resumed_s=round(runs["t_b"], 1))
  print("\n[kill9-learner-sync]", json.dumps(summary))
