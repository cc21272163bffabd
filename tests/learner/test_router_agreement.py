"""The learner metric router_disagree (learner/metrics.router_stats; docs/LEARNER.md "Router
agreement"): the fraction of the (position, MoE layer) pairs the loss reads whose top-k expert
set differs between the learner's own router and the generator's recorded routes.

* router_stats against a float64 NumPy loop on planted routes (K = 2: order within K ignored;
  planted differences outside the read positions — prompt, last sampled token, padding, rows the
  zero-variance filter drops — are not counted).
* Through the Learner on a tiny Llama-4 MoE: routes planted on the model's own top-k reach the
  metric exactly, without replay (`gen_routes`) and with replay (`routes`) on the last MoE layer.
* configs/tiny_moe.py resolves: an MoE, routes recorded, bf16 wire, R3 on by default, `+no_r3` off.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax.models import sections as model_sections
from scalerl_jax import config as run_config
from scalerl_jax import config as common
from configs import tiny_moe
from scalerl_jax import models
from scalerl_jax import recipes
from scalerl_jax.learner import Learner
from scalerl_jax.learner import metrics

CFG = dataclasses.replace(models.get_preset("tiny_llama4"), vocab_size=32, d_model=64,
                          num_layers=2, interleave_moe_layer_step=1)
R, K, E = models.num_moe_layers(CFG), CFG.num_experts_per_tok, CFG.num_experts


def _reference(own, gen, weights, mask) -> tuple[int, int]:
  """(pairs, differing pairs) by explicit loops: position t counts when token t+1 is an effective
  loss token (token weight > 0 and loss_mask); a pair differs when the expert SETS differ."""
  B, T, Rn, _ = own.shape
  pairs = differ = 0
  for b in range(B):
    for t in range(T - 1):
      if not (weights[b, t + 1] > 0 and mask[b, t + 1]):
        continue
      for r in range(Rn):
        pairs += 1
        differ += set(own[b, t, r].tolist()) != set(gen[b, t, r].tolist())
  return pairs, differ


def test_router_stats_matches_numpy_reference():
  rng = np.random.RandomState(0)
  B, T, Rn, Kn, En = 5, 12, 3, 2, 6
  own = np.stack([np.stack([np.stack([rng.choice(En, Kn, replace=False) for _ in range(Rn)])
                            for _ in range(T)]) for _ in range(B)]).astype(np.int32)
  gen = own[..., ::-1].copy()                       # same sets, other order: agreement
  mask = np.zeros((B, T), bool)
  mask[:, 5:10] = True                              # completions at positions 5..9
  mask[3, 8:] = False
  rows = np.array([1.0, 0.5, 0.0, 1.0, 2.0], np.float32)      # row 2: outside the loss
  weights = rows[:, None] * np.ones((B, T), np.float32)       # token weights (not masked here)
  # Planted differences: read positions (4 = last prompt position, 5..8) and positions the loss
  # never reads (prompt 0..3, the last sampled token 9 and after, row 2 with weight 0).
  for b, t, r in [(0, 4, 0), (0, 6, 2), (1, 8, 1), (3, 6, 0), (4, 5, 2), (4, 7, 1),   # read
                  (0, 1, 0), (1, 9, 2), (2, 6, 1), (3, 8, 0), (4, 11, 2), (0, 3, 1)]:  # not read
    gen[b, t, r, 0] = (set(range(En)) - set(own[b, t, r].tolist())).pop()
  got = {k: float(v) for k, v in metrics.router_stats(own, gen, weights, mask).items()}
  pairs, differ = _reference(own, gen, weights, mask)
  print("router_stats", got, "reference pairs", pairs, "differing", differ)
  assert (pairs, differ) == ((3 * 5 + 3) * 3, 6)   # rows 0, 1, 4: positions 4..8; row 3: 4..6
  assert got == {"router_pairs": pairs, "router_disagree_sum": differ}
  fin = metrics.finalize({**metrics.zeros(), **got})
  assert float(fin["router_disagree"]) == pytest.approx(6 / 54, abs=1e-7)


def _batch(params):
  """6 rows (3 prompts x 2), prompt 8 tokens + completion 8; prompt 2's rewards are equal (the
  zero-variance filter drops its rows: weight 0)."""
  rng = np.random.RandomState(1)
  B, P, T = 6, 8, 16
  tokens = rng.randint(0, CFG.vocab_size, (B, T)).astype(np.int32)
  mask = np.zeros((B, T), bool)
  mask[:, P:] = True
  mask[1, 13:] = False                              # a shorter completion (right padding)
  logp = np.where(mask, -1.0, 0.0).astype(np.float32)
  batch = dict(tokens=tokens, gen_logprobs=logp, loss_mask=mask,
               rewards=np.array([1, 0, 0, 1, 1, 1], np.float32),
               prompt_ids=np.array([0, 0, 1, 1, 2, 2], np.int32))
  own = np.asarray(models.forward(params, CFG, jnp.asarray(tokens), return_aux=True)[1]["own_routes"])
  return batch, own


def _learner(params):
  config = common.base_config()
  config.optim.lr = 0.0
  config.optim.warmup_steps = 0
  config.generator.backend = "jax"
  apply_fn = lambda p, t, pos, routes=None: models.forward(p, CFG, t, pos, routes=routes,
                                                           return_aux=True)
  return Learner.for_run(apply_fn, params, common.RunConfig.from_config(config),
                         vocab_size=CFG.vocab_size, route_shape=(R, K, E))


def _plant(own, plants):
  gen = own.copy()
  for b, t, r in plants:
    gen[b, t, r, 0] = (own[b, t, r, 0] + 1) % E
  return gen


def test_learner_reports_planted_router_disagreement():
  params = models.init_params(CFG, jax.random.PRNGKey(0))
  batch, own = _batch(params)
  assert own.shape == batch["tokens"].shape + (R, K)
  weights = np.array([1, 1, 1, 1, 0, 0], np.float32)[:, None] * batch["loss_mask"]   # prompt 2
                                                      # dropped (equal rewards)
  read = [(0, 7, 0), (0, 10, 1), (1, 11, 1), (2, 14, R - 1), (3, 8, R - 1)]
  assert R == 2
  unread = [(0, 2, 0), (1, 12, 1), (1, 14, R - 1), (2, 15, 0), (4, 9, R - 1), (5, 10, 0)]
  gen = _plant(own, read + unread)
  pairs, differ = _reference(own, gen, weights, batch["loss_mask"])
  assert differ == len(read)
  learner = _learner(jax.tree.map(np.array, params))   # lr 0: every step sees the same params
  m = learner.step({**batch, "gen_routes": gen})       # compared, not replayed
  print("router_disagree", m["router_disagree"], "pairs", m["router_pairs"], "reference",
        differ / pairs, pairs)
  assert m["router_pairs"] == pairs
  assert m["router_disagree"] == pytest.approx(differ / pairs, abs=1e-7)
  # Replayed (R3): planted on the LAST MoE layer only, the routers' own choices are those of the
  # unplanted forward (a layer's router reads the hidden state before its own experts), so the
  # metric counts exactly the read plants; with routes = own it is 0.
  last = [(b, t, R - 1) for b, t, _ in read] + [(b, t, R - 1) for b, t, _ in unread]
  m = learner.step({**batch, "routes": _plant(own, last)})
  assert m["router_disagree"] == pytest.approx(len(read) / pairs, abs=1e-7)
  m = learner.step({**batch, "routes": own})
  assert m["router_disagree"] == 0.0 and m["router_pairs"] == pairs


def test_tiny_moe_config_resolves(tmp_path):
  for name, replay in (("scalerl", True), ("scalerl+no_r3", False)):
    c = tiny_moe.get_config()
    c.recipe = name
    c = run_config.apply_recipe(c, frozenset())
    run = recipes.resolve_routing_replay(c, recipes.validate(c, str(tmp_path / name)))
    cfg = model_sections.model_config(run)
    assert cfg.is_moe and models.num_moe_layers(cfg) == cfg.num_layers == 4
    assert run.rl.routing_replay is replay and run.rl.record_routes
    assert run.weights.wire_dtype == "bfloat16" and run.generator.backend == "jax"
    assert run.sft.steps > 0 and not run.model.hf_checkpoint     # its own SFT base, no download
