"""Sharded forward / decode on 8 simulated CPU devices vs unsharded (tests/models/test_sharding.py runs it
as `python tests/sharding_procs.py` with 8 XLA:CPU devices); prints one JSON line of errors.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
import json, sys
import jax, numpy as np
from scalerl_jax.config import DEFAULT_RULES
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
  # llama4 (all logical axes incl. experts) on every mesh; llama3 on one
  shapes = ((8, 1, 1, 1), (2, 2, 2, 1), (1, 2, 1, 4)) if name == "tiny_llama4" else ((2, 2, 2, 1),)
  for shape in shapes:
    mesh = sharding.make_mesh(tuple(zip(("data", "fsdp", "tensor", "expert"), shape)))
    params, shardings = sharding.sharded_init(cfg, jax.random.PRNGKey(0), mesh, DEFAULT_RULES)
    host = jax.tree.map(np.asarray, params)
    ref = np.asarray(fwd(host, cfg, tokens))          # unsharded (no mesh, no rules)
    n_sharded = sum(not s.is_fully_replicated for s in jax.tree.leaves(shardings))
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
                                  batch_split=shape[0] * shape[1] * shape[3], tensor=shape[2])
print(json.dumps(out))
