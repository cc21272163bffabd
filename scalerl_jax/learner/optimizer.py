"""AdamW with the paper's schedule (PAPER_NOTES §4): linear warm-up, then constant; global-norm clip."""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
import optax


def warmup_constant_schedule(lr: float, warmup_steps: int) -> optax.Schedule:
  """lr · min(1, (count + 1) / warmup_steps): the first update already uses lr / warmup_steps."""
  lr = float(lr)
  warmup = max(int(warmup_steps), 0)
  if warmup == 0:
    return lambda count: jnp.asarray(lr, jnp.float32)
  return lambda count: lr * jnp.minimum(1.0, (jnp.asarray(count, jnp.float32) + 1.0) / warmup)


class ClippedAdamW(optax.GradientTransformation):
  """make_optimizer's chain, also carrying its parts: `max_grad_norm` (None = no clip) and the
  `adamw` transformation, so the train step can apply AdamW slice by slice in place
  (train_step.sliced_update) with exactly optax's per-element arithmetic."""

  max_grad_norm: Optional[float]           # set by make_optimizer
  adamw: optax.GradientTransformation


def make_optimizer(optim) -> optax.GradientTransformation:
  """optax chain from ``config.optim``: clip_by_global_norm(max_grad_norm) -> AdamW(schedule).

  Weight decay (decoupled, AdamW) applies to every parameter, as torch.optim.AdamW does when given
  all parameters. ``max_grad_norm <= 0`` disables clipping.
  """
  adamw = optax.adamw(warmup_constant_schedule(optim.lr, optim.warmup_steps), b1=optim.b1,
                      b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
  clip = float(optim.max_grad_norm) if optim.max_grad_norm and optim.max_grad_norm > 0 else None
  chain = optax.chain(optax.clip_by_global_norm(clip), adamw) if clip else adamw
  out = ClippedAdamW(chain.init, chain.update)
  out.max_grad_norm, out.adamw = clip, adamw
  return out
