"""MoE checks on 8 simulated CPU devices (tests/models/test_moe.py runs `python tests/moe_procs.py parity`,
tests/models/test_moe_flops.py `python tests/moe_procs.py flops`, with 8 XLA:CPU devices); prints one JSON
line.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo


def parity():
  import json
  import jax, jax.numpy as jnp, numpy as np
  from scalerl_jax.config import DEFAULT_RULES
  from scalerl_jax import models, sharding, topologies
  from scalerl_jax.models import moe
  assert jax.device_count() == 8
  SP = tuple((k, topologies.SEQUENCE_PARALLEL.get(k, v)) for k, v in DEFAULT_RULES)
  dense = models.get_preset("tiny_llama4", moe_impl="dense")
  params = models.init_params(dense, jax.random.PRNGKey(0))
  # Layer 1 (MoE): expert 1's router column equals expert 0's -> top-1 ties go to expert 0, so
  # expert 1 receives no token there.
  r = params["layers_1"]["moe"]["router"]
  params["layers_1"]["moe"]["router"] = r.at[:, 1].set(r[:, 0])
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(rng.randint(0, dense.vocab_size, (8, 16)))
  probe = jnp.asarray(rng.randn(8, 16, dense.vocab_size).astype(np.float32))

  def loss(p, cfg):
    logits = models.forward(p, cfg, tokens)
    return jnp.sum(logits * probe), logits

  # logits and gradients from ONE compiled program per case (the compile is most of this script)
  grad_and_logits = jax.jit(jax.grad(loss, has_aux=True), static_argnums=1)

  def run(cfg, p=params):
    gr, lg = grad_and_logits(p, cfg)
    return np.asarray(lg), jax.tree.map(np.asarray, gr)

  def rel(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))

  ref_l, ref_g = run(dense)
  _, inter = models.transformer.Transformer(dense).apply(
      {"params": params}, tokens, jnp.broadcast_to(jnp.arange(16), (8, 16)),
      jnp.broadcast_to(jnp.arange(16), (8, 16)), mutable=["intermediates"])
  routes1 = np.asarray(inter["intermediates"]["layers_1"]["moe"]["routes"][0])
  out = dict(layer1_counts=np.bincount(routes1.ravel(), minlength=4).tolist())
  for shape, rules, name in (((1, 2, 2, 2), DEFAULT_RULES, "dp e2 t2"),
                             ((1, 2, 1, 4), DEFAULT_RULES, "dp e4"),
                             ((2, 1, 1, 4), SP, "sp e4"),
                             ((1, 4, 1, 2), SP, "sp e2")):
    mesh = sharding.make_mesh(tuple(zip(("data", "fsdp", "tensor", "expert"), shape)))
    for cf in ((0.0,) if name in ("dp e2 t2", "sp e4") else (4.0,)):
      cfg = dense.replace(moe_impl="dispatch", moe_capacity_factor=cf)
      placed = jax.device_put(params, sharding.param_shardings(cfg, mesh, rules))
      with sharding.use_mesh(mesh, rules):
        lg, gr = run(cfg, placed)
      errs = jax.tree.leaves(jax.tree.map(rel, gr, ref_g))
      out[f"{name} cf{cf}"] = dict(logits=rel(lg, ref_l), grad=max(errs))
  # Unsharded dispatch (no mesh) and the capacity drop count against an independent count.
  cfg = dense.replace(moe_impl="dispatch")
  out["nomesh"] = rel(run(cfg)[0], ref_l)
  cfg = dense.replace(moe_impl="dispatch", moe_capacity_factor=1.0)
  _, inter = models.transformer.Transformer(cfg).apply(
      {"params": params}, tokens, jnp.broadcast_to(jnp.arange(16), (8, 16)),
      jnp.broadcast_to(jnp.arange(16), (8, 16)), mutable=["intermediates"])
  copies = routes1.size
  cap = moe.capacity(copies, 4, 1.0)
  expect = int(np.sum(np.maximum(np.bincount(routes1.ravel(), minlength=4) - cap, 0)))
  out["dropped"] = [int(inter["intermediates"]["layers_1"]["moe"]["moe_dropped"][0]), expect]
  # expert axis must divide the expert count
  try:
    mesh = sharding.make_mesh((("data", 1), ("fsdp", 1), ("tensor", 1), ("expert", 8)))
    bad = dense.replace(moe_impl="dispatch", num_experts=4)
    with sharding.use_mesh(mesh, DEFAULT_RULES):
      jax.jit(models.forward, static_argnums=1)(params, bad, tokens)
    out["bad_mesh"] = "no error"
  except ValueError as e:
    out["bad_mesh"] = str(e)
  print(json.dumps(out))


def flops():
  import json
  from configs import scout
  from scalerl_jax import sharding, topologies
  from scalerl_jax.models import sections as model_sections
  from scalerl_jax.tools import plan
  out = {}
  for impl, cf in (("dense", 0.0), ("dispatch", 1.0)):
    config = scout.get_config("gb200_16")
    config.model.update(dict(d_model=256, num_heads=4, num_kv_heads=2, head_dim=64,
                             expert_ffn_dim=512, ffn_dim=1024, vocab_size=2048, num_layers=8,
                             attention_chunk_size=512, moe_impl=impl, moe_capacity_factor=cf,
                             remat="none"))   # the dispatch FLOPs, not the remat policy's
    config.mesh.shape = (("data", 1), ("fsdp", 2), ("tensor", 1), ("expert", 4))
    config.optim.microbatches = 2
    cfg = model_sections.model_config(config)
    assert cfg.num_experts == 16 and cfg.num_experts_per_tok == 1 and cfg.scan_period == 4
    mesh = sharding.make_mesh(config.mesh.shape)
    topo = topologies.get_topology("gb200_16")
    rep = plan.compute_report(config, cfg, mesh, topo, batch_rows=4, seq_len=1024, mfu=0.4)
    out[f"{impl} cf{cf}"] = rep
  print(json.dumps(out))


if __name__ == "__main__":
  {"parity": parity, "flops": flops}[sys.argv[1]]()
