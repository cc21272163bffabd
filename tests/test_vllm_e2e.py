"""`generator.backend=vllm` runs the tiny config end to end with a real vLLM worker process.

* at T = 0.7 the first, on-policy step's IS ratios have mean 1 +- 1e-3 and KL(gen||learner) < 1e-6
  (vLLM's processed log-probs = log_softmax(logits / T); the learner divides by the same T), and
  the start-up log-prob parity gate passes;
* an engine started on the wrong checkpoint (`generator.vllm_model_dir`) stops the run at
  start-up, before any step, with the gate's message.
"""
import json
import os
import subprocess
import sys

import pytest

from test_vllm_worker import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
          f"--workdir={workdir}", "--config.generator.backend=vllm", "--config.total_steps=4",
          "--config.sft.clean_steps=30", "--config.sft.steps=10", "--config.eval.every_steps=2",
          "--config.eval.samples_per_prompt=2", "--config.data.heldout=16",
          "--config.rollout.max_lag=2", *extra]


def test_main_with_vllm_backend(tmp_path):
  require_vllm()
  cmd = _cmd(tmp_path, "--config.generator.temperature=0.7")
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  train = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [l for l in train if l["kind"] == "train"]
  assert [l["step"] for l in train] == [1, 2, 3, 4]
  assert all(l["max_lag"] <= 2 for l in train)
  # vLLM served the initial weights from a checkpoint it was started on ...
  assert any(d.startswith("vllm_init_") for d in os.listdir(tmp_path))
  # ... and its float32 engine + FP32 head sampled with the learner's own log-probs at T = 0.7:
  # the first, on-policy step has IS ratios of 1 and a ~0 KL estimate (a bf16 head would show
  # ~1e-4; a learner at T = 1 shows a mean ratio 1.0022 and KL 9e-3, docs/LEARNER.md).
  first = train[0]
  print(f"\n[vllm T=0.7] first step: is_ratio_mean {first['is_ratio_mean']:.7f}, max "
        f"{first['is_ratio_max']:.7f}, kl_k3 {first['kl_k3']:.2e}, parity mean |d| "
        f"{first['health/parity_mean_abs']:.2e} on {first['health/parity_tokens']} tokens")
  assert first["max_lag"] == 0
  assert abs(first["is_ratio_mean"] - 1.0) < 1e-3 and abs(first["is_ratio_max"] - 1.0) < 1e-3
  assert first["kl_k3"] < 1e-6
  # The start-up parity gate ran on the first batch and passed (float32 engine: ~1e-6 per token).
  assert first["health/parity_alarm"] == 0 and first["health/parity_mean_abs"] < 1e-4
  assert first["health/parity_tokens"] > 0


def test_parity_gate_stops_a_run_whose_engine_has_the_wrong_weights(tmp_path):
  """The fleet's engine is started on another checkpoint of the same architecture (a random one,
  as a mixed-up base/instruct path would be): the gate fails the run before step 1."""
  require_vllm()
  from scalerl_jax import models
  from configs import tiny
  import jax
  import numpy as np
  from scalerl_jax import runtime
  cfg = runtime.model_config(tiny.get_config())
  wrong = tmp_path / "wrong_ckpt"
  models.save_hf(cfg, jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(123))),
                 str(wrong))
  work = tmp_path / "run"
  r = subprocess.run(_cmd(work, f"--config.generator.vllm_model_dir={wrong}"), cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  last = r.stderr.strip().splitlines()[-1]
  print(f"\n[gate] exit {r.returncode}: {last[:400]}")
  assert r.returncode != 0
  assert last.startswith("run stopped at start-up: log-prob parity gate failed at weight version 0")
  assert "Traceback" not in r.stderr.split("run stopped at start-up")[-1]
  lines = [json.loads(l) for l in open(work / "metrics.jsonl")] if (work / "metrics.jsonl").exists() else []
  assert not [l for l in lines if l.get("kind") == "train"]      # not one RL step was taken
  assert not os.path.isdir(work / "checkpoints") or not os.listdir(work / "checkpoints")


def test_vllm_model_dir_that_is_not_a_checkpoint_is_a_config_error(tmp_path):
  r = subprocess.run(_cmd(tmp_path / "run", f"--config.generator.vllm_model_dir={tmp_path}/nope"),
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1].startswith(
      "config error: generator.vllm_model_dir=") and "Traceback" not in r.stderr
