"""Group-relative advantages (PAPER_NOTES §3).

All functions are pure ``jax.numpy`` on ``[B]`` arrays (B = prompts x generations, rows in any
order, groups identified by ``prompt_ids``), so they run inside ``jit`` before micro-batching.
Group statistics use a ``[B, B]`` same-group matrix: exact for arbitrary ids and row orders, and
cheap at RL batch sizes (768 rows -> 0.6M entries).
"""
from __future__ import annotations

import jax.numpy as jnp

from scalerl_jax.rl.aggregation import same_group

ADV_NORMS = ("batch", "prompt", "none")


def _group_mean(x, same):
  count = same.sum(axis=1).astype(jnp.float32)
  return (same.astype(jnp.float32) @ x) / jnp.maximum(count, 1.0)


def group_advantages(rewards, prompt_ids, row_keep, norm: str = "batch", eps: float = 1e-6) -> jnp.ndarray:
  """Â_i = r_i - mean(r of its group), optionally divided by a std (0 on rows not kept).

  norm:
    ``batch``  (ScaleRL) divide by the population std of all kept advantages in the batch;
    ``prompt`` (GRPO)    divide by the population std of the rewards of the row's own group;
    ``none``   (Dr.GRPO) no division.
  The division is by ``std + eps`` so constant groups / batches give 0, never NaN.
  """
  if norm not in ADV_NORMS:
    raise ValueError(f"unknown advantage normalization {norm!r}; expected one of {ADV_NORMS}")
  r = jnp.asarray(rewards, jnp.float32)
  keep = jnp.asarray(row_keep, bool)
  r = jnp.where(keep, r, 0.0)
  same = same_group(prompt_ids, keep)
  adv = jnp.where(keep, r - _group_mean(r, same), 0.0)
  if norm == "batch":
    n = jnp.maximum(keep.sum().astype(jnp.float32), 1.0)
    mean = adv.sum() / n
    std = jnp.sqrt(jnp.sum(jnp.where(keep, (adv - mean) ** 2, 0.0)) / n)
    adv = adv / (std + eps)
  elif norm == "prompt":
    std = jnp.sqrt(_group_mean(adv ** 2, same))  # group mean of adv is 0 by construction
    adv = adv / (std + eps)
  return jnp.where(keep, adv, 0.0)
