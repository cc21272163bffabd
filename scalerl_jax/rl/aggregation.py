"""Loss aggregation as per-token weights computed from the FULL batch (before any split).

Every aggregation mode is expressed as a weight ``w[b, t] >= 0`` per token such that

    loss = sum_{b,t} w[b,t] * term[b,t]  /  sum_{b,t} w[b,t]

where ``term`` is the per-token loss. The weights are normalised so that their sum over one
"unit" of averaging is exactly 1:

  token   (DAPO)     w = 1                           -> denominator = number of loss tokens
  sample  (GRPO)     w = 1 / |y_i|                   -> denominator = number of completions
  prompt  (ScaleRL)  w = 1 / sum_{g in group} |y_g|  -> denominator = number of prompts

Because both the numerator ``sum(w * term)`` and the denominator ``sum(w)`` are plain sums over
tokens, they are additive over ANY partition of the rows (micro-batches, data-parallel shards):
summing the partial (sum, denominator) pairs of the parts and dividing once gives the full-batch
loss exactly. The weights must be computed on the full batch because ``|y_i|`` and
``sum_g |y_g|`` are properties of a whole row / prompt group, which a partition may split.
"""
from __future__ import annotations

from typing import Callable

import jax.numpy as jnp

from scalerl_jax.registry import Registry

# mode -> fn(maskf float32 [B,T] (loss tokens of kept rows), prompt_ids [B], keep bool [B]) ->
# weights float32 [B,T]. Select with rl.aggregation; a new mode is one `@register_aggregation`.
AggregationFn = Callable[..., jnp.ndarray]
AGGREGATIONS: Registry[AggregationFn] = Registry("aggregation")
register_aggregation = AGGREGATIONS.register


def same_group(prompt_ids, row_valid) -> jnp.ndarray:
  """bool [B, B]: rows i and j are valid and belong to the same prompt group."""
  ids = jnp.asarray(prompt_ids)
  valid = jnp.asarray(row_valid, bool)
  return (ids[:, None] == ids[None, :]) & valid[:, None] & valid[None, :]


@register_aggregation("prompt")
def prompt_weights(maskf, prompt_ids, keep) -> jnp.ndarray:
  """ScaleRL: w = 1 / Σ_{g in group} |y_g| (denominator = number of prompts)."""
  row_tokens = maskf.sum(axis=1)                                   # |y_i|
  group_tokens = same_group(prompt_ids, keep).astype(jnp.float32) @ row_tokens  # sum_g |y_g|
  return maskf * (1.0 / jnp.maximum(group_tokens, 1.0))[:, None]


@register_aggregation("sample")
def sample_weights(maskf, prompt_ids, keep) -> jnp.ndarray:
  """GRPO: w = 1 / |y_i| (denominator = number of completions)."""
  del prompt_ids, keep
  return maskf * (1.0 / jnp.maximum(maskf.sum(axis=1), 1.0))[:, None]


@register_aggregation("token")
def token_weights_token(maskf, prompt_ids, keep) -> jnp.ndarray:
  """DAPO: w = 1 (denominator = number of loss tokens)."""
  del prompt_ids, keep
  return maskf


def token_weights(loss_mask, prompt_ids, row_keep, mode: str) -> jnp.ndarray:
  """Per-token aggregation weights ``float32 [B, T]`` (zero outside ``loss_mask`` / kept rows).

  Args:
    loss_mask: bool [B, T], true only for policy-generated completion tokens.
    prompt_ids: int [B], group id of each row (padding rows may carry any id; they are not kept).
    row_keep: bool [B], rows that enter the loss (valid and not filtered out).
    mode: a registered name of ``AGGREGATIONS``.
  Returns:
    float32 [B, T] weights; ``weights.sum()`` is the loss denominator.
  """
  fn = AGGREGATIONS.get(mode)
  keep = jnp.asarray(row_keep, bool)
  mask = jnp.asarray(loss_mask, bool) & keep[:, None]
  return fn(mask.astype(jnp.float32), prompt_ids, keep)
