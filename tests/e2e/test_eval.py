"""Evaluation settings take effect end to end (issue 15 item 4): `python -m scalerl_jax.main` on the
tiny config with `eval.mode=fleet` (the one JAX generator evaluates through the buffer's evaluation
lane), at eval.num_prompts 64 and 512: the eval lines are at the steps eval.every_steps names, each
holds num_prompts x samples_per_prompt samples of the version published at that step, and the
learner process's peak RSS does not grow with num_prompts. Bad eval settings fail at start-up with
one clear line."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLES = 2


def _run(wd, *extra, timeout=900):
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={wd}",
         "--config.eval.mode=fleet", "--config.total_steps=3", "--config.eval.every_steps=2",
         f"--config.eval.samples_per_prompt={SAMPLES}", "--config.data.heldout=512",
         "--config.sft.clean_steps=20", "--config.sft.steps=10", "--config.rewards.log=False",
         "--config.forecast.enabled=False", *extra]
  return subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                        capture_output=True, text=True, timeout=timeout)


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("eval_e2e")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  out = {}
  for n in (64, 512):
    wd = tmp_path_factory.mktemp(f"fleet_eval_{n}")
    r = _run(wd, f"--config.eval.num_prompts={n}")
    assert r.returncode == 0, r.stderr[-4000:]
    out[n] = [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]
  return out


@pytest.mark.parametrize("n", [64, 512])
def test_eval_settings_take_effect_through_the_fleet(runs, n):
  evals = [l for l in runs[n] if l["kind"] == "eval"]
  assert [l["step"] for l in evals] == [0, 2, 3]           # every_steps=2, plus the last step
  for l in evals:
    assert l["eval_mode"] == "fleet" and l["eval_version"] == l["step"]   # pinned version
    assert l["val_prompts"] == n and l["val_samples"] == n * SAMPLES
    assert 0.0 <= l["val_pass_rate"] <= 1.0
  c = [l["compute_hours"] for l in evals]
  assert c[0] == 0.0 and all(b > a for a, b in zip(c, c[1:]))   # the x-axis of the fit
  # Generators reported the device-seconds of every evaluation (the ledger books them as
  # eval_gen_hours when collected: in later snapshots, off the x-axis).
  assert all(l["eval_group_device_s"] > 0 for l in evals)
  assert all(l["compute_hours_with_eval"] >= l["compute_hours"] for l in evals)


def test_learner_peak_rss_does_not_grow_with_num_prompts(runs):
  rss = {n: max(l["learner_peak_rss_mb"] for l in runs[n] if l["kind"] == "eval") for n in runs}
  for n in runs:
    print(f"num_prompts={n}: " + ", ".join(
        f"step {l['step']} pass {l['val_pass_rate']:.3f} wait {l['eval_wait_s']:.1f} s "
        f"gen {l['eval_group_device_s']:.1f} device-s rss {l['learner_peak_rss_mb']:.0f} MB"
        for l in runs[n] if l["kind"] == "eval"))
  print(f"learner peak RSS (fleet evaluation): 64 prompts {rss[64]:.0f} MB, "
        f"512 prompts {rss[512]:.0f} MB")
  assert rss[512] <= rss[64] * 1.05 + 16, rss


@pytest.mark.parametrize("args,text", [
    (["--config.eval.num_prompts=65", "--config.data.heldout=64"],
     "eval.num_prompts=65 is larger than the held-out split (64 prompts"),
    (["--config.eval.samples_per_prompt=0"], "eval.samples_per_prompt must be >= 1"),
    (["--config.eval.num_prompts=-1"], "eval.num_prompts must be >= 0"),
    (["--config.eval.mode=remote"], "eval.mode='remote'"),
])
def test_bad_eval_config_is_one_clear_line(tmp_path, args, text):
  wd = tmp_path / "wd"
  r = subprocess.run([sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
                      f"--workdir={wd}", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                     capture_output=True, text=True, timeout=120)
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
  assert lines[0].startswith("config error: ") and text in lines[0], lines[0]
  assert not wd.exists()
