"""MoE routing replay (R3): JAX sampler routes -> wire -> learner batch -> learner log-probs.

* With replay, the learner's recomputed log-probs equal the sampler's (<= 1e-5) and the learner's
  mismatch KL (metric kl_k3) is ~0.
* With a generator whose router differs (routing differs on many tokens), the learner without
  replay reports the mismatch KL (kl_k3); replaying the generator's routes lowers it.
* Routes of the wrong shape or range are refused by the buffer's validation and by the learner.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.learner import Learner
from scalerl_jax.protocol import client, codec, validation
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.types import PromptSpec, SamplingSpec

CFG = models.get_preset("tiny_llama4")
R, K, E = models.num_moe_layers(CFG), CFG.num_experts_per_tok, CFG.num_experts
SPEC = SamplingSpec(temperature=1.0, think_budget_min=20, think_budget_max=24, answer_budget=4,
                    interruption_tokens=(7, 8), seed=3)
LIMITS = validation.Limits(vocab_size=CFG.vocab_size, route_layers=R, route_k=K, num_experts=E)


def _prompts():
  rng = np.random.RandomState(1)
  return [PromptSpec(i, rng.randint(0, CFG.vocab_size, 5 + 3 * i).astype(np.int32))
          for i in range(3)]


def _rollouts(params):
  """Sampler (record_routes) -> wire Rollouts, validated as the buffer does."""
  groups = JaxSampler(CFG, params, record_routes=True).generate(_prompts(), 2, SPEC)
  prompts = {p.prompt_id: p.tokens for p in _prompts()}
  out = []
  for gid, group in enumerate(groups):
    for j, c in enumerate(group):
      assert c.routes.shape == (len(prompts[c.prompt_id]) + len(c.tokens), R, K)
      r = codec.completion_to_rollout(c, group_id=gid, sample_index=j,
                                      prompt_tokens=prompts[c.prompt_id], generator_id="g")
      lease = validation.LeaseView(gid, c.prompt_id, prompts[c.prompt_id], "", 2, 0, -1)
      validation.validate_rollout(r, lease, 0, LIMITS)
      out.append(r)
  return out


def _batch(rollouts):
  groups = [pb.Group(group_id=g, prompt_id=rollouts[2 * g].prompt_id,
                     rollouts=rollouts[2 * g:2 * g + 2]) for g in range(len(rollouts) // 2)]
  return client.batch_to_arrays(client.Batch(0, groups, pb.BatchSummary()))


def _learner_metrics(params, batch, replay: bool, cfg=CFG):
  config = common.base_config()
  config.optim.lr = 0.0
  config.optim.warmup_steps = 0
  config.rl.routing_replay = replay
  config.generator.backend = "jax"      # a backend that records routes (a valid replay config)
  aux = cfg.moe_capacity_factor > 0
  apply_fn = lambda p, t, pos, routes=None: models.forward(p, cfg, t, pos, routes=routes,
                                                           return_aux=aux)
  learner = Learner.for_run(apply_fn, params, common.RunConfig.from_config(config),
                            vocab_size=CFG.vocab_size, route_shape=(R, K, E))
  keys = ("tokens", "gen_logprobs", "loss_mask", "rewards", "prompt_ids")
  b = {k: batch[k] for k in keys + (("routes",) if replay else ())}
  b["rewards"] = np.arange(len(b["rewards"]), dtype=np.float32) % 2   # non-zero variance
  return learner.step(b)


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("routing_replay")


@pytest.fixture(scope="module")
def params():
  return models.init_params(CFG, jax.random.PRNGKey(0))


def test_replayed_learner_logprobs_equal_sampler(params):
  batch = _batch(_rollouts(params))
  assert batch["routes"].shape == batch["tokens"].shape + (R, K)
  logits = models.forward(params, CFG, jnp.asarray(batch["tokens"]),
                          routes=jnp.asarray(batch["routes"]))
  logp = jax.nn.log_softmax(logits[:, :-1], -1)
  logp = np.asarray(jnp.take_along_axis(logp, jnp.asarray(batch["tokens"])[:, 1:, None], -1))[..., 0]
  mask = batch["loss_mask"][:, 1:]
  err = np.max(np.abs(logp - batch["gen_logprobs"][:, 1:])[mask])
  print("max |learner - sampler| log-prob with replay:", err, "over", int(mask.sum()), "tokens")
  assert mask.sum() > 50 and err <= 1e-5
  m = _learner_metrics(params, batch, replay=True)
  print("kl_k3 with replay, same weights:", m["kl_k3"])
  assert m["kl_k3"] <= 1e-6


def test_mismatch_kl_reported_without_replay(params):
  # The generator's router differs (e.g. an engine's numerics or a lagging version): its routing
  # differs from the learner's on many tokens.
  gen = jax.tree.map(lambda x: x, params)
  for i in range(CFG.num_layers):
    if CFG.layer_is_moe(i):
      r = gen[f"layers_{i}"]["moe"]["router"]
      gen[f"layers_{i}"]["moe"]["router"] = r + 0.05 * jax.random.normal(jax.random.PRNGKey(i), r.shape)
  batch = _batch(_rollouts(gen))
  own = models.prefill(params, CFG, jnp.asarray(batch["tokens"]),
                       models.init_cache(CFG, *batch["tokens"].shape), return_routes=True)[2]
  real = batch["loss_mask"]                     # completion tokens the loss sees
  differ = float(np.mean((np.asarray(own) != batch["routes"])[real]))
  off = _learner_metrics(params, batch, replay=False)
  on = _learner_metrics(params, batch, replay=True)
  print(f"routes differing: {differ:.3f} of (token, layer); kl_k3 replay off {off['kl_k3']:.3e}, "
        f"on {on['kl_k3']:.3e}")
  assert differ > 0.05
  assert off["kl_k3"] > 1e-4 and on["kl_k3"] < off["kl_k3"]


def test_capacity_drops_reach_the_learner_metrics(params):
  """moe_dropped in the learner's metrics equals the count from the model's own routes."""
  from scalerl_jax.models import moe
  cfg = dataclasses.replace(CFG, moe_capacity_factor=0.5)
  batch = _batch(_rollouts(params))
  m = _learner_metrics(params, batch, replay=False, cfg=cfg)
  # the capacity model's own routes (drops in one layer change the next layers' inputs)
  routes = np.asarray(models.prefill(params, cfg, jnp.asarray(batch["tokens"]),
                                     models.init_cache(cfg, *batch["tokens"].shape),
                                     return_routes=True)[2])          # [B,T,R,K]
  cap = moe.capacity(routes[:, :, 0].size, E, 0.5)
  expect = sum(int(np.maximum(np.bincount(routes[:, :, r].ravel(), minlength=E) - cap, 0).sum())
               for r in range(R))
  print("moe_dropped", m["moe_dropped"], "expected", expect)
  assert expect > 0 and m["moe_dropped"] == expect


def test_bad_routes_are_refused(params):
  r = _rollouts(params)[0]
  lease = validation.LeaseView(0, r.prompt_id, codec.decode(r.prompt_tokens, pb.INT32, "p", 99),
                               "", 2, 0, -1)
  routes = codec.decode_routes(r)
  cases = {
      "shorter": codec.encode_routes(routes[:-1]),
      "layers": codec.encode_routes(np.concatenate([routes, routes], axis=1)),
      "range": codec.encode_routes(np.where(routes == routes.max(), E, routes)),
      "negative": codec.encode_routes(-np.ones_like(routes)),
  }
  for _name, bad in cases.items():
    rr = pb.Rollout()
    rr.CopyFrom(r)
    rr.routes.CopyFrom(bad)
    with pytest.raises(validation.RejectError, match="routes"):
      validation.validate_rollout(rr, lease, 0, LIMITS)
  with pytest.raises(validation.RejectError, match="does not accept them"):
    validation.validate_rollout(r, lease, 0, dataclasses.replace(LIMITS, route_layers=0))
  batch = _batch(_rollouts(params))
  for bad, match in ((batch["routes"][..., :1, :], "must be integer"),
                     (batch["routes"] + E, "outside")):
    with pytest.raises(ValueError, match=match):
      _learner_metrics(params, dict(batch, routes=bad), replay=True)
  with pytest.raises(ValueError, match="routes must have shape"):
    models.forward(params, CFG, jnp.asarray(batch["tokens"]), routes=jnp.asarray(batch["routes"][:, :, :1]))
