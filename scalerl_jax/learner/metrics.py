"""Per-token learner statistics, accumulated as additive sums (or maxima) over micro-batches."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

SUM_KEYS = ("loss_sum", "tokens", "ratio_sum", "k3_sum", "entropy_sum", "clipped_low", "clipped_high",
            "moe_dropped")
MAX_KEYS = ("ratio_max",)
LAG_CLASSES = ("lag0", "lagpos")     # tokens of the learner's current version / of older ones


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


def lag_stats(logp, gen_logp, weights, loss_mask, lags, flags) -> dict[str, jax.Array]:
  """Loss-token counts and k3 sums split by lag class (lag = learner step − token version; lag0:
  engine mismatch alone, lagpos: staleness too), and per rollout-correction flag (bool [B,T],
  rl.correction.stat_names()) its count in each class. Keys ``<name>_<class>``."""
  logp = jax.lax.stop_gradient(logp)
  act = (weights > 0) & loss_mask
  log_ratio = jnp.where(act, logp, 0.0) - jnp.where(act, gen_logp, 0.0)
  k3 = jnp.exp(log_ratio) - 1.0 - log_ratio
  out = {}
  for cls, sel in zip(LAG_CLASSES, (lags == 0, lags != 0)):
    a = act & sel
    out[f"lag_tokens_{cls}"] = a.sum().astype(jnp.float32)
    out[f"k3_sum_{cls}"] = jnp.sum(jnp.where(a, k3, 0.0))
    for name, f in flags.items():
      out[f"rc_{name}_{cls}"] = jnp.sum(a & f).astype(jnp.float32)
  return out


ROUTER_KEYS = ("router_pairs", "router_disagree_sum")


def router_stats(own_routes, gen_routes, weights, loss_mask) -> dict[str, jax.Array]:
  """Router agreement with the generator (docs/LEARNER.md "Router agreement"): over the
  (position, MoE layer) pairs the loss reads, how many top-k expert SETS differ between the
  learner's own router (`own_routes` int [B,T,R,K]) and the generator's recorded routes
  (`gen_routes`, same shape; order within K ignored).

  The loss reads position t-1's routes for loss token t (its logits come from position t-1's
  forward), so a position counts when the NEXT token is an effective loss token
  ((weights > 0) & loss_mask, as token_stats): the last prompt position counts, the last sampled
  token (no forward, no recorded route) does not. Keys ROUTER_KEYS: pairs counted, pairs whose
  sets differ."""
  act = (weights > 0) & loss_mask                                     # [B,T]
  reads = jnp.concatenate([act[:, 1:], jnp.zeros_like(act[:, :1])], axis=1)
  own = jnp.sort(jnp.asarray(own_routes, jnp.int32), axis=-1)
  gen = jnp.sort(jnp.asarray(gen_routes, jnp.int32), axis=-1)
  differ = jnp.any(own != gen, axis=-1)                               # [B,T,R]
  sel = jnp.broadcast_to(reads[..., None], differ.shape)
  return dict(router_pairs=sel.sum().astype(jnp.float32),
              router_disagree_sum=jnp.sum(sel & differ).astype(jnp.float32))


def lag_keys(flag_names) -> tuple[str, ...]:
  """The keys `lag_stats` returns for correction flags `flag_names`."""
  return tuple(k for cls in LAG_CLASSES for k in
               (f"lag_tokens_{cls}", f"k3_sum_{cls}", *(f"rc_{n}_{cls}" for n in flag_names)))


def combine(a, b) -> dict[str, jax.Array]:
  """Merges two stat dicts from disjoint micro-batches (maxima for MAX_KEYS, sums otherwise)."""
  return {k: jnp.maximum(a[k], b[k]) if k in MAX_KEYS else a[k] + b[k] for k in a}


def zeros(keys=SUM_KEYS + MAX_KEYS) -> dict[str, jax.Array]:
  """Zero stats for `keys` (the scan's initial accumulator)."""
  return {k: jnp.zeros((), jnp.float32) for k in keys}


def finalize(stats) -> dict[str, Any]:
  """Ratios of the accumulated sums (0 when there are no tokens). With router stats
  (`router_stats`): ``router_disagree`` and ``router_pairs``. With lag stats (`lag_stats`):
  ``kl_k3_<class>`` and each correction flag's fraction ``rc/<name>_frac_<class>`` of that class's
  loss tokens."""
  n = jnp.maximum(stats["tokens"], 1.0)
  out = dict(tokens=stats["tokens"], entropy=stats["entropy_sum"] / n,
             is_ratio_mean=stats["ratio_sum"] / n, is_ratio_max=stats["ratio_max"],
             kl_k3=stats["k3_sum"] / n, clip_frac_low=stats["clipped_low"] / n,
             clip_frac_high=stats["clipped_high"] / n,
             moe_dropped=stats["moe_dropped"])   # token-expert copies over all layers, rows
  if "router_pairs" in stats:       # router_stats: fraction of read (token, MoE layer) pairs
    out["router_pairs"] = stats["router_pairs"]
    out["router_disagree"] = stats["router_disagree_sum"] / jnp.maximum(stats["router_pairs"], 1.0)
  for cls in LAG_CLASSES:
    if f"lag_tokens_{cls}" not in stats:
      continue
    nc = jnp.maximum(stats[f"lag_tokens_{cls}"], 1.0)
    out[f"tokens_{cls}"] = stats[f"lag_tokens_{cls}"]
    out[f"kl_k3_{cls}"] = stats[f"k3_sum_{cls}"] / nc
    for k in stats:
      if k.startswith("rc_") and k.endswith("_" + cls):
        out[f"rc/{k[3:-len(cls) - 1]}_frac_{cls}"] = stats[k] / nc
  return out
