"""`generator.backend=vllm` runs the tiny config end to end with a real vLLM worker process."""
import json
import os
import subprocess
import sys

import pytest

from scalerl_jax.generation.vllm.generator import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_with_vllm_backend(tmp_path):
  if not vllm_python().exists():
    msg = f"vLLM venv missing ({vllm_python()}); run scripts/setup_vllm_venv.sh"
    if os.environ.get("SCALERL_REQUIRE_VLLM"):
      pytest.fail(msg + " (SCALERL_REQUIRE_VLLM is set)")
    pytest.skip(msg)
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.generator.backend=vllm", "--config.total_steps=4",
         "--config.sft.clean_steps=30", "--config.sft.steps=10", "--config.eval.every_steps=2",
         "--config.eval.samples_per_prompt=2", "--config.data.heldout=16",
         "--config.rollout.max_lag=2"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  train = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [l for l in train if l["kind"] == "train"]
  assert [l["step"] for l in train] == [1, 2, 3, 4]
  assert all(l["max_lag"] <= 2 for l in train)
  # vLLM served the initial weights from a checkpoint it was started on ...
  assert any(d.startswith("vllm_init_") for d in os.listdir(tmp_path))
  # ... and its float32 engine + FP32 head sampled with the learner's own log-probs: the first,
  # on-policy step has IS ratios of 1 and a ~0 KL estimate (a bf16 head would show ~1e-4).
  first = train[0]
  assert first["max_lag"] == 0
  assert abs(first["is_ratio_max"] - 1.0) < 1e-3 and first["kl_k3"] < 1e-6
