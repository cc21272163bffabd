"""Compiled FLOPs of the MoE learner step (tools/plan.py probe) at reduced Scout width.

Same expert count (16) and top-k (1) as Scout, all layers MoE, on 8 simulated devices with an
expert-parallel mesh: the capacity dispatch compiles to within 1.3x of 6 N_active + attention
per token; the dense reference is several times that.
"""
import json

import pytest

from test_moe import run_moe_procs


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("moe_flops")


@pytest.fixture(scope="module")
def result():
  return run_moe_procs("flops")


def test_dispatch_flops_near_active(result):
  print(json.dumps({k: {m: v[m] for m in ("flops_per_token", "six_n_active_per_token",
                                            "attention_flops_per_token",
                                            "flops_per_token_vs_6n_plus_attention")}
                    for k, v in result.items()}, indent=1))
  ratio = result["dispatch cf1.0"]["flops_per_token_vs_6n_plus_attention"]
  assert 0.8 <= ratio <= 1.3, ratio
  assert result["dense cf0.0"]["flops_per_token_vs_6n_plus_attention"] >= 2.5 * ratio
