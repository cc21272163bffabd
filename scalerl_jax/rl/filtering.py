"""Zero-variance filtering (PAPER_NOTES §3): prompt groups whose G rewards are all equal are dropped.

Dropped groups get zero advantage AND zero aggregation weight, so they contribute nothing to the loss
sum and nothing to its denominator (the "effective batch"). No resampling in their place.
"""
from __future__ import annotations

import jax.numpy as jnp

from scalerl_jax.rl.aggregation import same_group


def zero_variance_keep(rewards, prompt_ids, row_valid, tol: float = 0.0) -> tuple[jnp.ndarray, jnp.ndarray]:
  """Rows whose prompt group has non-constant rewards.

  Returns:
    keep: bool [B], valid rows of groups whose max - min reward > tol.
    num_dropped_groups: float32 scalar, number of (valid) prompt groups dropped.
  """
  r = jnp.asarray(rewards, jnp.float32)
  valid = jnp.asarray(row_valid, bool)
  same = same_group(prompt_ids, valid)
  gmax = jnp.max(jnp.where(same, r[None, :], -jnp.inf), axis=1)
  gmin = jnp.min(jnp.where(same, r[None, :], jnp.inf), axis=1)
  keep = valid & ((gmax - gmin) > tol)
  dropped = valid & ~keep
  group_size = jnp.maximum(same.sum(axis=1).astype(jnp.float32), 1.0)
  num_dropped = jnp.sum(jnp.where(dropped, 1.0 / group_size, 0.0))
  return keep, num_dropped
