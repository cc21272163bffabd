"""A task mixture end to end in a few steps (configs/tiny_multitask.py: digit sum + tiny code task):
per-task evaluation and train metrics, the dataset stats line, and the generators' reward log, from
which "no code task is ever graded outside the sandbox" is asserted. The full 300-step run and its
numbers: docs/DATA.md "Mixtures"."""
import collections
import glob
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_multitask")]
STEPS, PROMPTS = 4, 8


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  wd = tmp_path_factory.mktemp("multitask")
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny_multitask.py",
         f"--workdir={wd}", f"--config.total_steps={STEPS}", "--config.sft.clean_steps=20",
         "--config.sft.steps=20", "--config.sft.num_examples=256", "--config.eval.every_steps=2",
         "--config.eval.samples_per_prompt=2", "--config.data.tasks.math.heldout=8",
         "--config.data.tasks.code.heldout=8", "--config.data.tasks.math.synthetic_n_train=256",
         "--config.data.tasks.code.synthetic_n_train=256"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  return wd


def _lines(wd):
  return [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]


def test_per_task_eval_and_train_metrics(run_dir):
  lines = _lines(run_dir)
  evals = [l for l in lines if l["kind"] == "eval"]
  assert {l["kind"] for l in lines} == {"eval", "train"}
  data = [l for l in lines if "data/heldout" in l]      # dataset stats ride on the step-0 line
  assert len(data) == 1 and data[0]["step"] == 0 and data[0]["kind"] == "eval"
  assert data[0]["data/math/heldout"] == 8 and data[0]["data/code/train"] == 256
  assert [l["step"] for l in evals] == [0, 2, 4]
  for l in evals:
    assert (l["val_samples/math"], l["val_samples/code"]) == (16, 16)   # 8 prompts x 2 per task
    overall = (l["val_pass_rate/math"] * 16 + l["val_pass_rate/code"] * 16) / 32
    assert l["val_pass_rate"] == pytest.approx(overall)
  train = [l for l in lines if l["kind"] == "train"]
  assert len(train) == STEPS
  for l in train:
    assert l["prompts/math"] + l["prompts/code"] == PROMPTS
    for t in ("math", "code"):
      if l[f"prompts/{t}"]:
        assert 0.0 <= l[f"mean_reward/{t}"] <= 1.0
  assert sum(l["prompts/code"] for l in train) > 0 and sum(l["prompts/math"] for l in train) > 0
  assert os.listdir(os.path.join(run_dir, "tb"))


def test_reward_log_code_only_graded_in_the_sandbox(run_dir):
  logs = glob.glob(os.path.join(run_dir, "logs", "rewards-*.jsonl"))
  assert logs
  rows = [json.loads(l) for f in logs for l in open(f)]
  by_task = collections.Counter(r["task"] for r in rows)
  assert by_task["math"] > 0 and by_task["code"] > 0 and set(by_task) == {"math", "code"}
  code = [r for r in rows if r["task"] == "code"]
  ran = [r for r in code if r["reason"] not in ("no_code", "bad_tests")]
  assert ran and all(r["sandboxed"] for r in ran)        # every program that ran ran in bwrap
  broken = [r for r in code if r["reason"] in ("bad_tests", "sandbox_error")]
  assert not broken, broken[:3]                          # their detail says why
  assert not any(r["sandboxed"] for r in rows if r["task"] == "math")
  assert all(r["prompt_id"] >= 1 << 32 for r in code)   # task from the prompt-id range
  assert all(r["reward"] == (1.0 if r["reason"] == "pass" else 0.0) for r in rows)
