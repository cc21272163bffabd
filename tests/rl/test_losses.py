"""Every loss × aggregation × advantage normalisation vs the float64 NumPy reference (value and
gradient w.r.t. the learner log-probs), CISPO's stop-gradient, and the invariances.

Tolerance ("scaled"): max|jax − ref| / max(1, max|ref|) ≤ 1e-6 — absolute for O(1) quantities,
relative for larger ones; JAX runs in float32, the reference in float64.
"""
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax import rl
from scalerl_jax.learner.batch import RLSpec, prepare, split_microbatches
import rl_reference as ref

LOSSES = ("cispo", "ppo", "dapo", "gspo", "reinforce")
AGGS = ("prompt", "sample", "token")
NORMS = ("batch", "prompt", "none")
TOL = 1e-6


def scaled_err(x, r):
  x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
  return float(np.max(np.abs(x - r)) / max(1.0, float(np.max(np.abs(r)))))


@functools.partial(jax.jit, static_argnums=(2,))
def jax_objective(batch, logp, spec):
  """(loss, d loss / d logp, prep) from the library (prepare on the full batch + registry loss)."""
  prep = prepare(batch, spec)
  loss_fn = rl.get_loss(spec.loss)

  def f(lp):
    out = loss_fn(lp, batch["gen_logprobs"], prep["adv"], prep["weights"],
                  batch["loss_mask"], spec.hp)
    return out.sum / out.denominator, out

  (loss, out), g = jax.value_and_grad(f, has_aux=True)(logp)
  return loss, g, prep, out


def _batch(seed, loss, **kw):
  rng = np.random.default_rng(seed)
  return ref.make_batch(rng, gspo_scale=(loss == "gspo"), **kw)


@functools.partial(jax.jit, static_argnums=(2,))
def jax_objective_many(batches, logps, specs):
  """Several (batch, spec) objectives in ONE compilation (saves ~0.5 s of XLA compile each)."""
  return [jax_objective.__wrapped__(b, lp, s) for b, lp, s in zip(batches, logps, specs)]


@pytest.mark.parametrize("loss", LOSSES)
def test_value_and_grad_match_numpy_reference(loss):
  combos = [(a, n, True) for a, n in itertools.product(AGGS, NORMS)]
  combos += [(a, n, False) for a, n in zip(AGGS, NORMS)]   # filter off: one per agg/norm
  data = [_batch(100 + k, loss, num_prompts=5, gens=4, seq=20, zero_var_groups=1,
                 big_ratio_frac=0.1 if loss == "cispo" else 0.0) for k in range(len(combos))]
  specs = tuple(RLSpec(loss=loss, aggregation=a, adv_norm=n, zero_variance_filter=z)
                for a, n, z in combos)
  results = jax_objective_many([d[0] for d in data], [d[1] for d in data], specs)
  worst = 0.0
  for (agg, norm, zvf), (batch, logp), (val, grad, prep, _) in zip(combos, data, results):
    rval, rgrad, info = ref.ref_objective(batch, logp, loss, agg, norm, zvf)
    np.testing.assert_allclose(np.asarray(prep["adv"]), info["adv"], atol=1e-5, rtol=1e-5)
    e_val, e_grad = scaled_err(val, rval), scaled_err(grad, rgrad)
    assert e_val <= TOL, (loss, agg, norm, zvf, float(val), rval)
    assert e_grad <= TOL, (loss, agg, norm, zvf, e_grad)
    assert abs(float(prep["denominator"]) - info["denominator"]) <= 1e-5 * info["denominator"]
    assert float(prep["dropped_groups"]) == info["dropped"]
    worst = max(worst, e_val, e_grad)
  print(f"\n[{loss}] max scaled error over 9 agg×norm (+3 unfiltered): {worst:.2e}")


def test_gspo_clipping_is_exercised():
  """The GSPO batch (log-ratio noise 1e-3) must hit the 3e-3/4e-3 clip on some rows and not others."""
  batch, logp = _batch(7, "gspo", num_prompts=6, gens=4, seq=20)
  spec = RLSpec(loss="gspo", aggregation="sample", adv_norm="batch")
  _, grad, _, out = jax_objective(batch, logp, spec)
  clipped_tokens = float(out.stats["clipped_low"] + out.stats["clipped_high"])
  assert 0 < clipped_tokens < batch["loss_mask"].sum()


@pytest.mark.parametrize("agg", AGGS)
def test_cispo_gradient_is_truncated_weight_times_advantage(agg):
  """∂loss/∂logp_t = −min(ρ_t, ε_max)·Â_i·w_t / D exactly (stop-gradient on the IS weight), with
  ρ = 8 > ε_max = 5 on ~25% of tokens: those get −5·Â·w/D (a PPO clip would give 0)."""
  batch, logp = _batch(3, "cispo", num_prompts=4, gens=4, seq=16, big_ratio_frac=0.25)
  spec = RLSpec(loss="cispo", aggregation=agg, adv_norm="batch")
  _, grad, prep, out = jax_objective(batch, logp, spec)
  rho = np.exp(logp.astype(np.float64) - batch["gen_logprobs"].astype(np.float64))
  w = np.asarray(prep["weights"], np.float64)
  d = float(prep["denominator"])
  adv = np.asarray(prep["adv"], np.float64)[:, None]
  expected = np.where(w > 0, -np.minimum(rho, 5.0) * adv * w / d, 0.0)
  big = (rho > 5.0) & (w > 0) & (adv != 0)
  assert big.sum() >= 5
  err = scaled_err(grad, expected)
  assert err <= TOL, err
  np.testing.assert_allclose(np.asarray(grad)[big], (-5.0 * adv * w / d)[big], rtol=1e-6)
  assert float(out.stats["clipped_high"]) == big.sum() + ((rho > 5) & (w > 0) & (adv == 0)).sum()
  print(f"\n[cispo/{agg}] grad == -min(rho,5)·A·w/D: scaled err {err:.2e}; {big.sum()} tokens with rho=8")


@pytest.mark.parametrize("loss", LOSSES)
def test_padding_and_masked_tokens(loss):
  """Padding rows/columns (with NaN junk) change nothing; masked tokens have exactly zero grad."""
  batch, logp = _batch(11, loss, num_prompts=4, gens=3, seq=16)
  spec = RLSpec(loss=loss, aggregation="prompt", adv_norm="batch")
  val, grad, _, _ = jax_objective(batch, logp, spec)
  pb, plp = ref.pad_batch(batch, logp, rows=3, cols=5)
  pval, pgrad, _, _ = jax_objective(pb, plp, spec)
  b, t = logp.shape
  assert np.isfinite(float(pval))
  assert scaled_err(pval, val) <= TOL
  assert scaled_err(np.asarray(pgrad)[:b, :t], grad) <= TOL
  pgrad = np.asarray(pgrad)
  assert np.all(pgrad[b:] == 0) and np.all(pgrad[:, t:] == 0)
  assert np.all(pgrad[:b, :t][~batch["loss_mask"]] == 0)


@pytest.mark.parametrize("loss", LOSSES)
def test_reordering_prompts(loss):
  batch, logp = _batch(12, loss, num_prompts=5, gens=3, seq=16)
  spec = RLSpec(loss=loss, aggregation="prompt", adv_norm="prompt")
  val, grad, _, _ = jax_objective(batch, logp, spec)
  perm = np.random.default_rng(0).permutation(logp.shape[0])
  pval, pgrad, _, _ = jax_objective({k: v[perm] for k, v in batch.items()}, logp[perm], spec)
  assert scaled_err(pval, val) <= TOL
  assert scaled_err(pgrad, np.asarray(grad)[perm]) <= TOL


@pytest.mark.parametrize("agg", AGGS)
def test_zero_variance_group_contributes_nothing(agg):
  """Adding an all-equal-reward group leaves loss and gradient unchanged; the denominator stays that
  of the effective batch (prompt: #kept prompts) and the dropped count is reported."""
  batch, logp = _batch(13, "cispo", num_prompts=5, gens=4, seq=16, zero_var_groups=2)
  spec = RLSpec(loss="cispo", aggregation=agg, adv_norm="batch")
  val, grad, prep, _ = jax_objective(batch, logp, spec)
  assert float(prep["dropped_groups"]) == 2.0 and float(prep["kept_groups"]) == 3.0
  zv = np.zeros(len(batch["rewards"]), bool)
  rewards = batch["rewards"]
  for p in np.unique(batch["prompt_ids"]):
    rs = rewards[batch["prompt_ids"] == p]
    zv |= (batch["prompt_ids"] == p) & (rs.max() == rs.min())
  sub = {k: v[~zv] for k, v in batch.items()}
  sval, sgrad, sprep, _ = jax_objective(sub, logp[~zv], spec)
  assert scaled_err(val, sval) <= TOL
  assert scaled_err(np.asarray(grad)[~zv], sgrad) <= TOL
  assert np.all(np.asarray(grad)[zv] == 0)
  np.testing.assert_allclose(float(prep["denominator"]), float(sprep["denominator"]), rtol=1e-6)
  if agg == "prompt":
    np.testing.assert_allclose(float(prep["denominator"]), 3.0, rtol=1e-6)
  if agg == "sample":
    np.testing.assert_allclose(float(prep["denominator"]), 12.0, rtol=1e-6)


def _partial(batch, logp, spec, rows, weights, adv):
  loss_fn = rl.get_loss(spec.loss)
  def f(lp):
    return loss_fn(lp, batch["gen_logprobs"][rows], adv[rows], weights[rows],
                   batch["loss_mask"][rows], spec.hp)
  out, vjp = jax.vjp(f, jnp.asarray(logp[rows]))
  (g,) = vjp(type(out)(jnp.ones(()), jnp.zeros(()), jax.tree.map(jnp.zeros_like, out.stats)))
  return float(out.sum), float(out.denominator), np.asarray(g)


def test_microbatch_partial_sums_exact_and_naive_differs():
  """4 micro-batches of partial (sum, denominator) pairs with weights from the full batch give the
  full-batch loss and gradient; averaging per-micro-batch prompt-aggregated means does not."""
  batch, logp = _batch(21, "cispo", num_prompts=8, gens=4, seq=24, zero_var_groups=1)
  spec = RLSpec(loss="cispo", aggregation="prompt", adv_norm="batch")
  full_val, full_grad, prep, _ = jax_objective(batch, logp, spec)
  w, adv = np.asarray(prep["weights"]), np.asarray(prep["adv"])
  b = logp.shape[0]
  mb_rows = [np.arange(b)[m::4] for m in range(4)]         # strided, like split_microbatches
  parts = [_partial(batch, logp, spec, r, w, adv) for r in mb_rows]
  tot_sum, tot_den = sum(p[0] for p in parts), sum(p[1] for p in parts)
  acc_grad = np.zeros_like(logp)
  for r, p in zip(mb_rows, parts):
    acc_grad[r] = p[2] / tot_den
  e_val, e_grad = scaled_err(tot_sum / tot_den, full_val), scaled_err(acc_grad, full_grad)
  assert e_val <= TOL and e_grad <= TOL
  # naive: each micro-batch prepared (weights, advantages) on its own, then mean of the means
  naive = []
  for r in mb_rows:
    v, _, _, _ = jax_objective({k: x[r] for k, x in batch.items()}, logp[r], spec)
    naive.append(float(v))
  naive_val = float(np.nanmean(naive))
  assert abs(naive_val - float(full_val)) > 1e-3
  print(f"\n[accum] full {float(full_val):.6f} accumulated {tot_sum / tot_den:.6f} "
        f"(err {e_val:.1e}, grad err {e_grad:.1e}); naive mean-of-means {naive_val:.6f}")


def test_split_microbatches_is_strided():
  x = jnp.arange(8)
  np.testing.assert_array_equal(split_microbatches(x, 4), [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_registry_errors():
  with pytest.raises(ValueError, match="unknown loss"):
    rl.get_loss("nope")
  with pytest.raises(ValueError, match="already registered"):
    rl.register_loss("cispo")(lambda *a: None)
  with pytest.raises(ValueError, match="aggregation"):
    RLSpec(aggregation="group")
  with pytest.raises(ValueError, match="adv_norm"):
    RLSpec(adv_norm="std")
