"""Sharded forward / decode on 8 simulated CPU devices equals the unsharded computation."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent("""
    import json, sys
    import flax.linen as nn, jax, numpy as np
    from configs.common import DEFAULT_RULES
    from scalerl_jax import models, sharding
    from scalerl_jax.models.testing import rel_err
    assert jax.device_count() == 8, jax.devices()
    out = {}
    for name in ("tiny_llama3", "tiny_llama4"):
      cfg = models.get_preset(name, vocab_size=256, d_model=128, head_dim=32, ffn_dim=192,
                              attention_chunk_size=8 if name == "tiny_llama4" else None,
                              floor_scale=4, expert_ffn_dim=64 if name == "tiny_llama4" else 0,
                              scan_layers=name == "tiny_llama4",
                              num_layers=2 if name == "tiny_llama3" else 4)
      tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 24))
      fwd = jax.jit(models.forward, static_argnums=1)
      # llama4 (all logical axes incl. experts) on every mesh; llama3 on one plus the legacy context
      shapes = ((8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4)) if name == "tiny_llama4" else ((2, 2, 2, 1),)
      for shape in shapes:
        mesh = sharding.make_mesh(tuple(zip(("data", "fsdp", "tensor", "expert"), shape)))
        params, shardings = sharding.sharded_init(cfg, jax.random.PRNGKey(0), mesh, DEFAULT_RULES)
        host = jax.tree.map(np.asarray, params)
        ref = np.asarray(fwd(host, cfg, tokens))          # unsharded (no mesh, no rules)
        n_sharded = sum(not s.is_fully_replicated for s in jax.tree.leaves(shardings))
        if name == "tiny_llama3":  # the legacy context works too
          with mesh, nn.logical_axis_rules(DEFAULT_RULES):
            legacy = jax.jit(models.forward, static_argnums=1)(params, cfg, tokens)
          out["legacy"] = dict(forward=rel_err(np.asarray(legacy), ref),
                               logits_sharding=str(legacy.sharding.spec))
        with sharding.use_mesh(mesh, DEFAULT_RULES):
          got = jax.jit(models.forward, static_argnums=1)(params, cfg, tokens)
          cache = models.init_cache(cfg, 8, 24)
          cache = jax.device_put(cache, sharding.cache_shardings(cache, mesh, DEFAULT_RULES))
          pre = jax.jit(models.prefill, static_argnums=1)
          step = jax.jit(models.decode_step, static_argnums=1)
          lp, cache = pre(params, cfg, tokens[:, :20], cache)
          dec = [np.asarray(lp)]
          for t in range(20, 21):
            ls, cache = step(params, cfg, tokens[:, t], cache)
            dec.append(np.asarray(ls)[:, None])
        out[f"{name} {shape}"] = dict(forward=rel_err(np.asarray(got), ref),
                                      decode=rel_err(np.concatenate(dec, 1), ref[:, :21]),
                                      sharded_params=n_sharded,
                                      logits_sharding=str(got.sharding.spec),
                                      logits_shard=list(got.sharding.shard_shape(got.shape)),
                                      batch_split=shape[0] * shape[1], tensor=shape[2])
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_sharded_equals_unsharded_8_devices():
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  proc = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  print(json.dumps(res, indent=1))
  assert len(res) == 5
  assert res.pop("legacy")["forward"] <= 1e-5
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
  from configs.common import DEFAULT_RULES
  from scalerl_jax import sharding
  mesh = sharding.make_mesh((("data", 1), ("fsdp", -1), ("tensor", 1), ("expert", 1)))
  assert mesh.shape == {"data": 1, "fsdp": jax.device_count(), "tensor": 1, "expert": 1}
  with pytest.raises(ValueError, match="at most one"):
    sharding.make_mesh((("data", -1), ("fsdp", -1)))
  with pytest.raises(ValueError, match="needs"):
    sharding.make_mesh((("data", 3),))
  s = sharding.logical_sharding({"w": PartitionSpec("batch", "embed")}, mesh, DEFAULT_RULES)
  assert s["w"].spec == PartitionSpec(("data", "fsdp"), "fsdp") or s["w"].spec[0] == ("data", "fsdp")
  with pytest.raises(ValueError, match="unknown mesh axis"):
    sharding.logical_sharding({"w": PartitionSpec("embed")}, mesh, (("embed", "model"),))
  with pytest.raises(ValueError, match="unknown logical axis"):
    sharding.logical_sharding({"w": PartitionSpec("embed")}, mesh, (("hidden", "fsdp"),))
