"""AdamW with the paper's schedule (PAPER_NOTES §4): linear warm-up, then constant; global-norm clip."""
from __future__ import annotations

import jax.numpy as jnp
import optax


def warmup_constant_schedule(lr: float, warmup_steps: int) -> optax.Schedule:
  """lr · min(1, (count + 1) / warmup_steps): the first update already uses lr / warmup_steps."""
  lr = float(lr)
  warmup = max(int(warmup_steps), 0)
  if warmup == 0:
    return lambda count: jnp.asarray(lr, jnp.float32)
  return lambda count: lr * jnp.minimum(1.0, (count.astype(jnp.float32) + 1.0) / warmup)


def make_optimizer(optim) -> optax.GradientTransformation:
  """optax chain from ``config.optim``: clip_by_global_norm(max_grad_norm) -> AdamW(schedule).

  Weight decay (decoupled, AdamW) applies to every parameter, as torch.optim.AdamW does when given
  all parameters. ``max_grad_norm <= 0`` disables clipping.
  """
  adamw = optax.adamw(warmup_constant_schedule(optim.lr, optim.warmup_steps), b1=optim.b1,
                      b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay)
  if optim.max_grad_norm and optim.max_grad_norm > 0:
    return optax.chain(optax.clip_by_global_norm(optim.max_grad_norm), adamw)
  return adamw
