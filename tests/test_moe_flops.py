"""Compiled FLOPs of the MoE learner step (tools/plan.py probe) at reduced Scout width.

Same expert count (16) and top-k (1) as Scout, all layers MoE, on 8 simulated devices with an
expert-parallel mesh: the capacity dispatch compiles to within 1.3x of 6 N_active + attention
per token; the dense reference is several times that.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import json
    import jax
    from configs import scout
    from scalerl_jax import runtime, sharding, topologies
    from scalerl_jax.tools import plan
    out = {}
    for impl, cf in (("dense", 0.0), ("dispatch", 1.0)):
      config = scout.get_config("gb200_16")
      config.model.update(dict(d_model=256, num_heads=4, num_kv_heads=2, head_dim=64,
                               expert_ffn_dim=512, ffn_dim=1024, vocab_size=2048, num_layers=8,
                               attention_chunk_size=512, moe_impl=impl, moe_capacity_factor=cf))
      config.mesh.shape = (("data", 1), ("fsdp", 2), ("tensor", 1), ("expert", 4))
      config.optim.microbatches = 2
      cfg = runtime.model_config(config)
      assert cfg.num_experts == 16 and cfg.num_experts_per_tok == 1 and cfg.scan_period == 4
      mesh = sharding.make_mesh(config.mesh.shape)
      topo = topologies.get_topology("gb200_16")
      rep = plan.compute_report(config, cfg, mesh, topo, batch_rows=4, seq_len=1024, mfu=0.4)
      out[f"{impl} cf{cf}"] = rep
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def result():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=1500)
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
