"""Per-token learner statistics, accumulated as additive sums (or maxima) over micro-batches."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

SUM_KEYS = ("loss_sum", "tokens", "ratio_sum", "k3_sum", "entropy_sum", "clipped_low", "clipped_high",
            "moe_dropped")
MAX_KEYS = ("ratio_max",)


def token_stats(logp, gen_logp, entropy, weights, loss_mask, loss_stats) -> dict[str, jax.Array]:
  """Sums over the loss tokens of the effective batch (weights > 0 & loss_mask).

  k3 estimator of KL(generator ‖ learner) with samples from the generator:
  k3 = ρ − 1 − log ρ, ρ = π_learner / π_gen (unbiased, non-negative per token).
  """
  logp = jax.lax.stop_gradient(logp)
  act = (weights > 0) & loss_mask
  log_ratio = jnp.where(act, logp, 0.0) - jnp.where(act, gen_logp, 0.0)
  ratio = jnp.exp(log_ratio)
  zero = jnp.zeros((), jnp.float32)
  out = dict(
      tokens=act.sum().astype(jnp.float32),
      ratio_sum=jnp.sum(jnp.where(act, ratio, 0.0)),
      ratio_max=jnp.max(jnp.where(act, ratio, 0.0), initial=0.0),
      k3_sum=jnp.sum(jnp.where(act, ratio - 1.0 - log_ratio, 0.0)),
      entropy_sum=zero if entropy is None else jnp.sum(jnp.where(act, entropy, 0.0)),
      clipped_low=loss_stats["clipped_low"], clipped_high=loss_stats["clipped_high"],
      moe_dropped=zero)   # set by the train step from the model's aux (capacity-mode MoE)
  return out


def combine(a, b) -> dict[str, jax.Array]:
  """Merges two stat dicts from disjoint micro-batches."""
  out = {k: a[k] + b[k] for k in SUM_KEYS}
  out.update({k: jnp.maximum(a[k], b[k]) for k in MAX_KEYS})
  return out


def zeros() -> dict[str, jax.Array]:
  return {k: jnp.zeros((), jnp.float32) for k in SUM_KEYS + MAX_KEYS}


def finalize(stats) -> dict[str, Any]:
  """Ratios of the accumulated sums (0 when there are no tokens)."""
  n = jnp.maximum(stats["tokens"], 1.0)
  return dict(tokens=stats["tokens"], entropy=stats["entropy_sum"] / n,
              is_ratio_mean=stats["ratio_sum"] / n, is_ratio_max=stats["ratio_max"],
              kl_k3=stats["k3_sum"] / n, clip_frac_low=stats["clipped_low"] / n,
              clip_frac_high=stats["clipped_high"] / n,
              moe_dropped=stats["moe_dropped"])   # token-expert copies over all layers, rows
