"""Rollout correction (scalerl_jax/rl/correction.py): every switch × every registered loss, value and
gradient vs a float64 NumPy reference written with explicit loops (tests/rl_reference.py's
losses evaluated with the corrected weights), on ragged batches with NaN/inf padding; masks never
touch tokens outside the loss; the denominator / aggregation units are unchanged; the train step's
lag-0 / lag>0 statistics; config errors for a band that excludes everything.

Tolerance: max|jax − ref| / max(1, max|ref|) ≤ 2e-6 (test_losses.py: 1e-6; the TIS weights up
to 10 amplify float32 rounding).
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from scalerl_jax import recipes

from scalerl_jax import config as common
from scalerl_jax import rl
from scalerl_jax.learner import LearnerState, make_train_step, token_logprobs
from scalerl_jax.learner.batch import RLSpec, prepare
from scalerl_jax.rl.correction import Correction
import rl_reference as ref

LOSSES = ("cispo", "ppo", "dapo", "gspo", "reinforce")
SWITCHES = {   # one setting per switch (each alone), plus all four together
    "token_tis": Correction(token_tis_cap=1.5),
    "token_band": Correction(token_mask_low=0.7, token_mask_high=1.4),
    "seq_band": Correction(seq_mask_low=0.9, seq_mask_high=1.1),
    "seq_tis": Correction(seq_tis_cap=10.0),
    "all": Correction(token_tis_cap=2.0, token_mask_low=0.5, token_mask_high=3.0,
                      seq_mask_low=0.8, seq_mask_high=1.25, seq_tis_cap=3.0),
}
TOL = 2e-6   # scales up to 10 (TIS caps) amplify the float32 rounding of the weights


def scaled_err(x, r):
  x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
  return float(np.max(np.abs(x - r)) / max(1.0, float(np.max(np.abs(r)))))


def ref_scale(logp, gen, w, mask, c: Correction):
  """float64 loops: (scale [B,T], {flag: bool [B,T]}) of the module docstring's formulas."""
  b, t = logp.shape
  scale = np.zeros((b, t))
  flags = {k: np.zeros((b, t), bool) for k in rl.correction.stat_names()}
  for i in range(b):
    toks = [tt for tt in range(t) if mask[i, tt] and w[i, tt] > 0]
    if not toks:
      continue
    lr = {tt: float(logp[i, tt]) - float(gen[i, tt]) for tt in toks}
    row = sum(lr.values())
    geo = math.exp(row / len(toks))
    seq_keep = not (c.seq_mask_low or c.seq_mask_high) or c.seq_mask_low <= geo <= c.seq_mask_high
    seq_c = min(math.exp(min(row, 700.0)), c.seq_tis_cap) if c.seq_tis_cap else 1.0
    for tt in toks:
      rho = math.exp(min(lr[tt], 700.0))
      s = min(rho, c.token_tis_cap) if c.token_tis_cap else 1.0
      flags["token_tis_truncated"][i, tt] = bool(c.token_tis_cap) and rho > c.token_tis_cap
      if c.token_mask_low or c.token_mask_high:
        keep = c.token_mask_low <= rho <= c.token_mask_high
        flags["token_masked"][i, tt] = not keep
        s = s if keep else 0.0
      flags["seq_masked"][i, tt] = not seq_keep
      flags["seq_tis_truncated"][i, tt] = bool(c.seq_tis_cap) and row > math.log(c.seq_tis_cap)
      scale[i, tt] = s * seq_c * (1.0 if seq_keep else 0.0)
  return scale, flags


@functools.partial(jax.jit, static_argnums=(2,))
def jax_corrected(batch, logp, spec):
  """(loss, d loss / d logp, scale, flags, prep): prepare on the full batch, the correction on the
  weights, the registry loss, divided by the UNCORRECTED denominator (as the train step does)."""
  prep = prepare(batch, spec)
  loss_fn = rl.get_loss(spec.loss)

  def f(lp):
    scale, flags = rl.correction_scale(lp, batch["gen_logprobs"], prep["weights"],
                                       batch["loss_mask"], spec.correction)
    out = loss_fn(lp, batch["gen_logprobs"], prep["adv"], prep["weights"] * scale,
                  batch["loss_mask"], spec.hp)
    return out.sum / prep["denominator"], (scale, flags)

  (loss, (scale, flags)), g = jax.value_and_grad(f, has_aux=True)(logp)
  return loss, g, scale, flags, prep


def _batch(seed, loss):
  rng = np.random.default_rng(seed)
  batch, logp = ref.make_batch(rng, num_prompts=5, gens=4, seq=20, zero_var_groups=1,
                               gspo_scale=(loss == "gspo"), big_ratio_frac=0.1)
  if loss == "gspo":   # a few rows far off so the sequence band / TIS act at GSPO's 1e-3 scale too
    batch["gen_logprobs"][::3] = np.minimum(batch["gen_logprobs"][::3] + 0.3, -1e-4)
  pb, plp = ref.pad_batch(batch, logp, rows=2, cols=3)
  plp[-1, :] = np.inf                        # padding row claims inf log-probs on its loss tokens
  pb["gen_logprobs"][:, -1] = -np.inf        # padding column: -inf generator log-probs
  return pb, plp


@pytest.mark.parametrize("loss", LOSSES)
def test_value_and_grad_match_numpy_reference(loss):
  """Each switch (and all together) × this loss: value, gradient, scale and flags vs float64; the
  gradient is exactly zero outside the loss tokens and on masked ones; finite despite NaN/inf."""
  worst = 0.0
  for k, (name, corr) in enumerate(SWITCHES.items()):
    batch, logp = _batch(200 + k, loss)
    spec = RLSpec(loss=loss, aggregation="prompt", adv_norm="batch", correction=corr)
    val, grad, scale, flags, prep = jax_corrected(batch, logp, spec)
    assert np.isfinite(float(val)) and np.all(np.isfinite(np.asarray(grad))), name
    f64 = lambda x: np.asarray(x, np.float64)
    keep, _ = ref.ref_keep(batch["rewards"], batch["prompt_ids"])
    adv = ref.ref_advantages(batch["rewards"], batch["prompt_ids"], keep, "batch")
    w = ref.ref_weights(batch["loss_mask"], batch["prompt_ids"], keep, "prompt")
    rscale, rflags = ref_scale(f64(logp), f64(batch["gen_logprobs"]), w, batch["loss_mask"], corr)
    np.testing.assert_allclose(np.asarray(scale), rscale, rtol=1e-5, atol=1e-7, err_msg=name)
    for f in rflags:
      assert (np.asarray(flags[f]) == rflags[f]).all(), (name, f)
    wc = w * rscale
    s, _, g = ref.ref_loss_and_grad(loss, f64(logp), f64(batch["gen_logprobs"]), adv, wc,
                                    batch["loss_mask"])
    d = w.sum()                                         # the UNCORRECTED denominator
    assert abs(float(prep["denominator"]) - d) <= 1e-5 * d
    e_val, e_grad = scaled_err(val, s / d), scaled_err(grad, g / d)
    assert e_val <= TOL and e_grad <= TOL, (loss, name, e_val, e_grad)
    outside = ~((w > 0) & batch["loss_mask"])
    assert (np.asarray(scale)[outside] == 0).all() and (np.asarray(grad)[outside] == 0).all()
    assert not any(np.asarray(flags[f])[outside].any() for f in flags)
    assert (np.asarray(grad)[(rscale == 0) & ~outside] == 0).all()
    acted = int(np.logical_or.reduce(list(rflags.values())).sum())
    assert 0 < acted < int((~outside).sum()), (name, acted)   # the switch acted, not on all
    worst = max(worst, e_val, e_grad)
  print(f"\n[{loss}] max scaled error over {len(SWITCHES)} correction settings: {worst:.2e}")


def test_off_is_identity_and_units_hold():
  """Correction off: scale = 1 on loss tokens (the plain loss); a band containing every ratio
  changes nothing; with a mask acting, the loss equals Σ w·scale·term / Σ w over the full batch
  (denominator = number of prompts under prompt aggregation, unchanged)."""
  batch, logp = _batch(5, "cispo")
  base = RLSpec(loss="cispo", aggregation="prompt", adv_norm="batch")
  v0, g0, s0, _, prep = jax_corrected(batch, logp, base)
  act = (np.asarray(prep["weights"]) > 0) & batch["loss_mask"]
  assert (np.asarray(s0)[act] == 1).all()
  wide = RLSpec(loss="cispo", aggregation="prompt", adv_norm="batch",
                correction=Correction(token_mask_low=1e-30, token_mask_high=np.inf))
  v1, g1, _, _, _ = jax_corrected(batch, logp, wide)
  assert float(v1) == float(v0) and np.array_equal(np.asarray(g1), np.asarray(g0))
  assert float(prep["denominator"]) == pytest.approx(float(prep["kept_groups"]), rel=1e-6)


def test_band_that_excludes_everything_is_a_config_error():
  for kw in (dict(token_mask_low=2.0, token_mask_high=1.0), dict(seq_mask_low=1.0),
             dict(seq_mask_low=1.0, seq_mask_high=1.0), dict(token_tis_cap=-1.0)):
    with pytest.raises(ValueError, match="rc_"):
      Correction(**kw)
  c = common.base_config()
  c.rl.rc_token_mask_low, c.rl.rc_token_mask_high = 3.0, 0.5
  # rl/'s bounds load JAX: main checks them at resolve time (recipes.validate calls check_objective)
  with pytest.raises(common.ConfigError, match=r"rl: rc_token_mask band \[3.0, 0.5\]"):
    recipes.check_objective(common.RunConfig.from_config(c).rl)
  c = common.base_config()
  c.rl.rc_token_mask_low, c.rl.rc_token_mask_high = 0.5, 2.0
  assert RLSpec.from_config(common.RunConfig.from_config(c).rl).correction.token_band


def test_train_step_lag_split_statistics_and_microbatch_additivity():
  """Through make_train_step (1 and 2 micro-batches, logits as the parameters): the loss equals the
  corrected reference, and each switch's fraction per lag class (lag 0 / lag > 0, from `lags`)
  and kl_k3 per class equal the NumPy counts over that class's loss tokens."""
  rng = np.random.default_rng(3)
  batch, _ = ref.make_batch(rng, num_prompts=4, gens=4, seq=16, zero_var_groups=1)
  b, t = batch["tokens"].shape
  vocab = 97
  table = rng.standard_normal((t, vocab)).astype(np.float32)     # logits by position
  logp = np.asarray(token_logprobs(jnp.asarray(np.broadcast_to(table, (b, t, vocab))),
                                   jnp.asarray(batch["tokens"]))[0])
  batch["gen_logprobs"] = np.minimum(logp + 0.4 * rng.standard_normal((b, t)), -1e-4
                                     ).astype(np.float32)
  batch["lags"] = rng.integers(0, 3, (b, t)).astype(np.int32)
  corr = SWITCHES["all"]
  spec = RLSpec(loss="cispo", aggregation="prompt", adv_norm="batch", correction=corr)
  apply = lambda p, tokens, positions: p[positions]
  m = {}
  for mbs in (1, 2):
    step = jax.jit(make_train_step(apply, optax.sgd(1.0), spec, mbs))
    state = LearnerState.create(jnp.asarray(table), optax.sgd(1.0))
    _, m[mbs] = jax.device_get(step(state, {k: jnp.asarray(v) for k, v in batch.items()}))
  no_lags = {k: v for k, v in batch.items() if k != "lags"}
  val, _, _, _, prep = jax_corrected(no_lags, jnp.asarray(logp), spec)
  w = np.asarray(prep["weights"], np.float64)
  act = (w > 0) & batch["loss_mask"]
  _, rflags = ref_scale(logp.astype(np.float64), batch["gen_logprobs"].astype(np.float64), w,
                        batch["loss_mask"], corr)
  lr = logp.astype(np.float64) - batch["gen_logprobs"]
  k3 = np.exp(lr) - 1 - lr
  for mbs in (1, 2):
    assert float(m[mbs]["loss"]) == pytest.approx(float(val), rel=2e-6, abs=1e-7)
    for cls, sel in (("lag0", batch["lags"] == 0), ("lagpos", batch["lags"] != 0)):
      n = (act & sel).sum()
      assert m[mbs][f"tokens_{cls}"] == n > 0
      assert m[mbs][f"kl_k3_{cls}"] == pytest.approx(k3[act & sel].mean(), rel=1e-5)
      for f, fl in rflags.items():
        assert m[mbs][f"rc/{f}_frac_{cls}"] == pytest.approx((fl & sel).sum() / n, abs=1e-7), f
  assert any(m[1][f"rc/{f}_frac_lagpos"] > 0 for f in rflags)
