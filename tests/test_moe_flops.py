"""Compiled FLOPs of the MoE learner step (tools/plan.py probe) at reduced Scout width.

Same expert count (16) and top-k (1) as Scout, all layers MoE, on 8 simulated devices with an
expert-parallel mesh: the capacity dispatch compiles to within 1.3x of 6 N_active + attention
per token; the dense reference is several times that.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = os.path.join(ROOT, "tests", "moe_procs.py")


@pytest.fixture(scope="module")
def result():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, _SCRIPT, "flops"], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_dispatch_flops_near_active(result):
  print(json.dumps({k: {m: v[m] for m in ("flops_per_token", "six_n_active_per_token",
                                            "attention_flops_per_token",
                                            "flops_per_token_vs_6n_plus_attention")}
                    for k, v in result.items()}, indent=1))
  ratio = result["dispatch cf1.0"]["flops_per_token_vs_6n_plus_attention"]
  assert 0.8 <= ratio <= 1.3, ratio
  assert result["dense cf0.0"]["flops_per_token_vs_6n_plus_attention"] >= 2.5 * ratio
