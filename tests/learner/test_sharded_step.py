"""Sharded train step (8 simulated CPU devices, mesh data 2 × fsdp 2 × tensor 2, rules table from
scalerl_jax/config/ with the data-parallel layouts' overrides, incl. the residual's sequence over
tensor) equals the unsharded one: parameters after 3 AdamW steps.

The device count must be set before jax is imported, so the comparison runs in a subprocess
(this file executed as a script); the test parses its JSON line.
"""
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/ (run as a script)
from helpers import xla_flags  # noqa: E402

TOL_PARAMS = 1e-5


def _main():
  import jax
  import jax.numpy as jnp
  import numpy as np
  from configs import tiny
  from scalerl_jax import config as common
  from scalerl_jax import models, sharding, topologies
  from scalerl_jax.learner import Learner
  import rl_reference as ref   # tests/ is on sys.path (the module's top)

  assert jax.device_count() == 8, jax.devices()
  cfg = models.get_preset("tiny_llama3", num_layers=2)
  config = tiny.get_config()
  config.optim.microbatches = 2
  config.mesh.shape = (("data", 2), ("fsdp", 2), ("tensor", 2), ("expert", 1))
  # The data-parallel layouts' rules (topologies.DATA_PARALLEL): the residual stream's sequence
  # (act_seq) is sharded over tensor between layers (Megatron sequence parallelism).
  config.mesh.rules = tuple((k, topologies.DATA_PARALLEL.get(k, v)) for k, v in config.mesh.rules)
  assert dict(config.mesh.rules)["act_seq"] == "tensor"
  apply_fn = lambda p, t, pos: models.forward(p, cfg, t, pos)
  params0 = models.init_params(cfg, jax.random.PRNGKey(0))
  host0 = jax.tree.map(np.asarray, params0)

  mesh = sharding.make_mesh(config.mesh.shape)
  shard = sharding.param_shardings(cfg, mesh, config.mesh.rules)
  run = common.RunConfig.from_config(config)
  meshed = Learner.for_run(apply_fn, jax.tree.map(jnp.array, host0), run, mesh=mesh,
                           params_sharding=shard, vocab_size=cfg.vocab_size)
  single = Learner.for_run(apply_fn, jax.tree.map(jnp.array, host0), run,
                           vocab_size=cfg.vocab_size)

  rng = np.random.default_rng(0)
  losses = []
  for _step in range(3):
    batch, _ = ref.make_batch(rng, num_prompts=4, gens=4, seq=32)
    batch["tokens"] = rng.integers(0, cfg.vocab_size, batch["tokens"].shape).astype(np.int32)
    batch["gen_logprobs"] = np.full(batch["tokens"].shape, -np.log(cfg.vocab_size), np.float32)
    batch["gen_logprobs"] += (0.3 * rng.standard_normal(batch["tokens"].shape)).astype(np.float32)
    batch["gen_logprobs"] = np.minimum(batch["gen_logprobs"], -1e-3)
    ms, mu = meshed.step(batch), single.step(batch)
    losses.append((ms["loss"], mu["loss"], ms["grad_norm"], mu["grad_norm"]))
  ps = jax.tree.map(np.asarray, meshed.state.params)
  pu = jax.tree.map(np.asarray, single.state.params)
  leaves = lambda t: [np.asarray(x, np.float64) for x in jax.tree.leaves(t)]
  diff = max(np.abs(a - b).max() for a, b in zip(leaves(ps), leaves(pu)))
  scale = max(np.abs(b).max() for b in leaves(pu))
  upd = max(np.abs(b - c).max() for b, c in zip(leaves(pu), leaves(host0)))
  sh_kinds = sorted({str(x.sharding.spec) for x in jax.tree.leaves(meshed.state.params)})
  print(json.dumps(dict(param_rel=diff / scale, max_abs_diff=diff, max_abs_update=upd,
                        update_rel=diff / upd, steps=int(meshed.state.step), losses=losses,
                        param_specs=sh_kinds)))


@pytest.mark.slow
def test_sharded_equals_unsharded():
  env = dict(os.environ, XLA_FLAGS=xla_flags(8),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=root,
                        capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  res = json.loads(proc.stdout.strip().splitlines()[-1])
  print(f"\n[sharded 8 dev] {res}")
  assert res["steps"] == 3
  assert res["param_rel"] <= TOL_PARAMS, res
  assert any("tensor" in s for s in res["param_specs"]) and any("fsdp" in s for s in res["param_specs"])
  for ls, lu, gs, gu in res["losses"]:
    assert abs(ls - lu) <= 1e-5 * max(1, abs(lu)) and abs(gs - gu) <= 1e-5 * max(1e-6, abs(gu))


if __name__ == "__main__":
  _main()
