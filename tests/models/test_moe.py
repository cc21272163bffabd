"""MoE dispatch (scalerl_jax/models/moe.py) equals the dense reference on 8 simulated devices.

Forward logits and parameter gradients of the tiny Llama-4 preset in float32, expert-parallel
over `expert` = 2 and 4 (with and without tensor / sequence parallelism), in the dropless and the
capacity mode, with a layer where one expert receives no token; capacity drops are counted.
"""
import json
import os
import subprocess
import sys

import pytest

from helpers import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = os.path.join(ROOT, "tests", "moe_procs.py")


def run_moe_procs(mode: str) -> dict:
  """Runs `tests/moe_procs.py MODE` on 8 simulated CPU devices; its last stdout line (JSON)."""
  env = dict(os.environ, XLA_FLAGS=xla_flags(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, _SCRIPT, mode], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=1500)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("moe")


@pytest.fixture(scope="module")
def result():
  return run_moe_procs("parity")


def test_dispatch_equals_dense_reference(result):
  print(json.dumps(result, indent=1))
  assert result["layer1_counts"][1] == 0                      # an expert with no token
  meshed = [k for k in result if " cf" in k]
  assert len(meshed) == 4
  for k in meshed:
    assert result[k]["logits"] <= 1e-5 and result[k]["grad"] <= 1e-5, (k, result[k])
  assert result["nomesh"] <= 1e-5


def test_capacity_drops_are_counted(result):
  got, expect = result["dropped"]
  assert expect > 0 and got == expect


def test_expert_axis_must_divide_experts(result):
  assert "does not divide num_experts=4" in result["bad_mesh"]
