"""Policy-gradient losses as small pure functions in a registry, each returning (sum, denominator).

Every registered loss has the signature

    fn(logp, gen_logp, adv, weights, loss_mask, hp) -> LossOut(sum, denominator, stats)

  logp      float32 [B, T]  learner log-prob of token t (differentiate w.r.t. this)
  gen_logp  float32 [B, T]  generator (behaviour policy) log-prob of token t
  adv       float32 [B]     per-completion advantage Â_i (broadcast over its tokens)
  weights   float32 [B, T]  aggregation weights from `aggregation.token_weights` (0 = not in loss)
  loss_mask bool    [B, T]  policy-generated completion tokens (used for the statistics)
  hp        LossHParams

and returns ``sum = Σ w·term`` and ``denominator = Σ w`` (the loss to MINIMISE is sum/denominator;
``term`` is the negated per-token surrogate objective). Both are additive over any partition of the
rows, so micro-batches / shards each return partial pairs and the caller divides once.
``stats`` holds token COUNTS (additive too): ``clipped_low`` / ``clipped_high`` = loss tokens whose
gradient the clip (or CISPO truncation, reported as ``clipped_high``) changed.

Tokens outside ``weights > 0`` never influence value or gradient: their log-probs are replaced by 0
before any exp(), so NaN / inf in padding cannot leak through 0·NaN.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from scalerl_jax.registry import Registry
from scalerl_jax.rl.advantages import ADV_NORMS
from scalerl_jax.rl.aggregation import AGGREGATIONS


class LossOut(NamedTuple):
  sum: jax.Array            # Σ_tokens w·term
  denominator: jax.Array    # Σ_tokens w
  stats: dict               # additive token counts: clipped_low, clipped_high


@dataclasses.dataclass(frozen=True)
class LossHParams:
  """Loss hyper-parameters (names follow ``config.rl``)."""
  cispo_eps_max: float = 5.0     # CISPO upper truncation of the IS weight
  clip_eps_low: float = 0.2      # PPO uses this for both sides; DAPO: 1 - eps_low
  clip_eps_high: float = 0.28    # DAPO clip-higher: 1 + eps_high
  gspo_eps_low: float = 3e-3     # GSPO sequence-ratio clip (1e-3 scale)
  gspo_eps_high: float = 4e-3

  @classmethod
  def from_config(cls, rl) -> "LossHParams":
    """From the rl section (scalerl_jax.config.RL; a ConfigDict works too)."""
    values = {f.name: getattr(rl, f.name, None) for f in dataclasses.fields(cls)}
    return cls(**{k: float(v) for k, v in values.items() if v is not None})


LossFn = Callable[..., LossOut]
LOSSES: Registry[LossFn] = Registry("loss")
# loss name -> {metric it adds: the step metric it copies} (e.g. CISPO's `truncated_frac`).
_METRIC_ALIASES: dict[str, dict[str, str]] = {}


def register_loss(name: str, metric_aliases: dict[str, str] | None = None) -> Callable[[LossFn], LossFn]:
  """Decorator: adds a loss function under `name`; `metric_aliases` {new metric: step metric}
  names the step metrics the loss reports under its own words as well."""
  _METRIC_ALIASES[name] = dict(metric_aliases or {})
  return LOSSES.register(name)


def loss_metrics(name: str, metrics: dict) -> dict:
  """The loss `name`'s own metrics, copied from the step's `metrics` (its aliases)."""
  return {new: metrics[old] for new, old in _METRIC_ALIASES.get(name, {}).items()}


def get_loss(name: str) -> LossFn:
  """The loss registered as `name` (ValueError listing the registered ones otherwise)."""
  return LOSSES.get(name)


def registered_losses() -> tuple[str, ...]:
  """Names of the registered losses, sorted."""
  return LOSSES.names()


def check_objective(loss: str, aggregation: str, adv_norm: str) -> None:
  """ValueError unless `loss` is registered and `aggregation` / `adv_norm` are known names (the
  learner's RLSpec and the config's rl section both check with this)."""
  get_loss(loss)  # raises on unknown names
  if aggregation not in AGGREGATIONS:
    raise ValueError(f"unknown aggregation {aggregation!r}; expected {AGGREGATIONS}")
  if adv_norm not in ADV_NORMS:
    raise ValueError(f"unknown adv_norm {adv_norm!r}; expected {ADV_NORMS}")


# ----------------------------------------------------------------------------- helpers

def _active(weights, loss_mask):
  return (jnp.asarray(weights) > 0) & jnp.asarray(loss_mask, bool)


def _safe_log_ratio(logp, gen_logp, active):
  """log ρ = logp − gen_logp on active tokens, exactly 0 elsewhere (no NaN/inf leakage)."""
  return jnp.where(active, logp, 0.0) - jnp.where(active, gen_logp, 0.0)


def _reduce(term, weights, active, clipped_low, clipped_high) -> LossOut:
  w = jnp.where(active, weights, 0.0)
  total = jnp.sum(jnp.where(active, w * term, 0.0))
  stats = dict(clipped_low=jnp.sum(active & clipped_low).astype(jnp.float32),
               clipped_high=jnp.sum(active & clipped_high).astype(jnp.float32))
  return LossOut(total, jnp.sum(w), stats)


def _clipped_surrogate(ratio, a, eps_low, eps_high):
  """−min(ρ·A, clip(ρ, 1−ε_lo, 1+ε_hi)·A) and where the clipped branch is the active one."""
  unclipped = ratio * a
  clipped = jnp.clip(ratio, 1.0 - eps_low, 1.0 + eps_high) * a
  term = -jnp.minimum(unclipped, clipped)
  hit_low = (a < 0) & (ratio < 1.0 - eps_low)
  hit_high = (a > 0) & (ratio > 1.0 + eps_high)
  return term, hit_low, hit_high


# ----------------------------------------------------------------------------- losses

@register_loss("cispo", metric_aliases={"truncated_frac": "clip_frac_high"})
def cispo(logp, gen_logp, adv, weights, loss_mask, hp: LossHParams) -> LossOut:
  """CISPO: term = −sg(min(ρ, ε_max))·Â·log π; upper truncation only, gradient via log π only."""
  act = _active(weights, loss_mask)
  ratio = jnp.exp(_safe_log_ratio(logp, gen_logp, act))
  is_w = jax.lax.stop_gradient(jnp.minimum(ratio, hp.cispo_eps_max))
  a = adv[:, None]
  term = -is_w * a * jnp.where(act, logp, 0.0)
  truncated = jax.lax.stop_gradient(ratio) > hp.cispo_eps_max
  return _reduce(term, weights, act, jnp.zeros_like(act), truncated)


def clipped_ratio_loss(logp, gen_logp, adv, weights, loss_mask, eps_low: float,
                       eps_high: float) -> LossOut:
  """The clipped surrogate with the clip range [1 − ε_low, 1 + ε_high] (PPO: ε_low = ε_high)."""
  act = _active(weights, loss_mask)
  ratio = jnp.exp(_safe_log_ratio(logp, gen_logp, act))
  term, lo, hi = _clipped_surrogate(ratio, adv[:, None], eps_low, eps_high)
  return _reduce(term, weights, act, lo, hi)


@register_loss("ppo")
def ppo(logp, gen_logp, adv, weights, loss_mask, hp: LossHParams) -> LossOut:
  """PPO / GRPO clipped surrogate, symmetric ε = hp.clip_eps_low."""
  return clipped_ratio_loss(logp, gen_logp, adv, weights, loss_mask, hp.clip_eps_low,
                            hp.clip_eps_low)


@register_loss("dapo")
def dapo(logp, gen_logp, adv, weights, loss_mask, hp: LossHParams) -> LossOut:
  """DAPO clip-higher: asymmetric clip [1 − ε_low, 1 + ε_high]."""
  return clipped_ratio_loss(logp, gen_logp, adv, weights, loss_mask, hp.clip_eps_low,
                            hp.clip_eps_high)


@register_loss("gspo")
def gspo(logp, gen_logp, adv, weights, loss_mask, hp: LossHParams) -> LossOut:
  """GSPO: sequence ratio s_i = exp(mean_t log ρ_t) over the row's loss tokens, clipped at 1e-3 scale.

  The sequence term −min(s_i·Â_i, clip(s_i)·Â_i) is assigned to every loss token of the row, so the
  aggregation weights decide how sequences are averaged (sample aggregation = the GSPO paper).
  The gradient flows through s_i to every token of the row (d s_i / d log π_t = s_i / |y_i|).
  """
  act = _active(weights, loss_mask)
  log_ratio = _safe_log_ratio(logp, gen_logp, act)
  n_tok = jnp.maximum(act.sum(axis=1).astype(jnp.float32), 1.0)
  seq_ratio = jnp.exp(log_ratio.sum(axis=1) / n_tok)                 # [B]
  term, lo, hi = _clipped_surrogate(seq_ratio, adv, hp.gspo_eps_low, hp.gspo_eps_high)
  bcast = lambda x: jnp.broadcast_to(x[:, None], act.shape)
  return _reduce(bcast(term), weights, act, bcast(lo), bcast(hi))


@register_loss("reinforce")
def reinforce(logp, gen_logp, adv, weights, loss_mask, hp: LossHParams) -> LossOut:
  """REINFORCE with the group baseline: term = −Â·log π (no importance weight)."""
  del gen_logp, hp
  act = _active(weights, loss_mask)
  term = -adv[:, None] * jnp.where(act, logp, 0.0)
  none = jnp.zeros_like(act)
  return _reduce(term, weights, act, none, none)
