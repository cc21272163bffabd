"""Group-relative advantages (PAPER_NOTES §3).

All functions are pure ``jax.numpy`` on ``[B]`` arrays (B = prompts x generations, rows in any
order, groups identified by ``prompt_ids``), so they run inside ``jit`` before micro-batching.
Group statistics use a ``[B, B]`` same-group matrix: exact for arbitrary ids and row orders, and
cheap at RL batch sizes (768 rows -> 0.6M entries).
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from scalerl_jax.registry import Registry
from scalerl_jax.rl.aggregation import same_group

# name -> fn(adv [B] (r - group mean, 0 on rows not kept), keep bool [B], same bool [B,B], eps)
# -> normalised adv [B]. Select with rl.adv_norm; a new one is one `@register_adv_norm`.
AdvNormFn = Callable[..., jnp.ndarray]
ADV_NORMS: Registry[AdvNormFn] = Registry("advantage normalization")
register_adv_norm = ADV_NORMS.register


def _group_mean(x, same):
  count = same.sum(axis=1).astype(jnp.float32)
  return (same.astype(jnp.float32) @ x) / jnp.maximum(count, 1.0)


@register_adv_norm("batch")
def batch_norm(adv, keep, same, eps) -> jnp.ndarray:
  """ScaleRL: divide by the population std of all kept advantages in the batch."""
  del same
  n = jnp.maximum(keep.sum().astype(jnp.float32), 1.0)
  mean = adv.sum() / n
  std = jnp.sqrt(jnp.sum(jnp.where(keep, (adv - mean) ** 2, 0.0)) / n)
  return adv / (std + eps)


@register_adv_norm("prompt")
def prompt_norm(adv, keep, same, eps) -> jnp.ndarray:
  """GRPO: divide by the population std of the rewards of the row's own group."""
  del keep
  std = jnp.sqrt(_group_mean(adv ** 2, same))  # group mean of adv is 0 by construction
  return adv / (std + eps)


@register_adv_norm("none")
def no_norm(adv, keep, same, eps) -> jnp.ndarray:
  """Dr.GRPO: no division."""
  del keep, same, eps
  return adv


def group_advantages(rewards, prompt_ids, row_keep, norm: str = "batch", eps: float = 1e-6) -> jnp.ndarray:
  """Â_i = r_i - mean(r of its group), then the registered normalisation `norm` (ADV_NORMS:
  ``batch`` (ScaleRL), ``prompt`` (GRPO), ``none`` (Dr.GRPO)); 0 on rows not kept.
  The division is by ``std + eps`` so constant groups / batches give 0, never NaN.
  """
  fn = ADV_NORMS.get(norm)
  r = jnp.asarray(rewards, jnp.float32)
  keep = jnp.asarray(row_keep, bool)
  r = jnp.where(keep, r, 0.0)
  same = same_group(prompt_ids, keep)
  adv = jnp.where(keep, r - _group_mean(r, same), 0.0)
  return jnp.where(keep, fn(adv, keep, same, eps), 0.0)
