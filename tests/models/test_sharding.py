"""Sharded forward / decode on 8 simulated CPU devices equals the unsharded computation."""
import json
import os
import subprocess
import sys

import pytest

from helpers import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_SCRIPT = os.path.join(ROOT, "tests", "sharding_procs.py")


@pytest.mark.slow
def test_sharded_equals_unsharded_8_devices():
  env = dict(os.environ, XLA_FLAGS=xla_flags(8),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=1500)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  print(json.dumps(res, indent=1))
  assert len(res) == 4
  for key, r in res.items():
    # the residual stream / logits really are sharded over batch (and vocab over tensor)
    assert r["logits_shard"][0] == 8 // r["batch_split"], (key, r)
    assert r["logits_shard"][2] in (256, 256 // r["tensor"]), (key, r)
    assert r["forward"] <= 1e-5, (key, r)
    assert r["decode"] <= 1e-5, (key, r)
    assert r["sharded_params"] > 0 or key.endswith("(8, 1, 1, 1)"), (key, r)
  assert set(res) == {"tiny_llama3 (2, 2, 2, 1)", "tiny_llama4 (8, 1, 1, 1)",
                      "tiny_llama4 (2, 2, 2, 1)", "tiny_llama4 (1, 2, 1, 4)"}


def test_make_mesh_and_rules_errors():
  import jax
  from jax.sharding import PartitionSpec
  from scalerl_jax.config import DEFAULT_RULES
  from scalerl_jax import sharding
  mesh = sharding.make_mesh((("data", 1), ("fsdp", -1), ("tensor", 1), ("expert", 1)))
  assert mesh.shape == {"data": 1, "fsdp": jax.device_count(), "tensor": 1, "expert": 1}
  with pytest.raises(ValueError, match="at most one"):
    sharding.make_mesh((("data", -1), ("fsdp", -1)))
  with pytest.raises(ValueError, match="needs"):
    sharding.make_mesh((("data", 3),))
  s = sharding.logical_sharding({"w": PartitionSpec("batch", "embed")}, mesh, DEFAULT_RULES)
  # batch takes (data, fsdp, expert); embed's axes are then used already: embed is replicated
  assert s["w"].spec == PartitionSpec(("data", "fsdp", "expert"), None)
  s = sharding.logical_sharding({"w": PartitionSpec("embed", "mlp")}, mesh, DEFAULT_RULES)
  assert s["w"].spec == PartitionSpec(("fsdp", "expert"), "tensor")
  with pytest.raises(ValueError, match="unknown mesh axis"):
    sharding.logical_sharding({"w": PartitionSpec("embed")}, mesh, (("embed", "model"),))
  with pytest.raises(ValueError, match="unknown logical axis"):
    sharding.logical_sharding({"w": PartitionSpec("embed")}, mesh, (("hidden", "fsdp"),))
