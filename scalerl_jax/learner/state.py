"""`LearnerState`: (params, opt_state, step) as one pytree, so orbax checkpoints it directly."""
from __future__ import annotations

from typing import Any

import flax.struct
import jax.numpy as jnp
import optax


class LearnerState(flax.struct.PyTreeNode):
  """Everything the learner updates. ``step`` counts APPLIED updates (skipped steps don't count)."""
  params: Any
  opt_state: Any
  step: Any     # int32 [] (in the sharding tree of state_shardings: its sharding)

  @classmethod
  def create(cls, params, optimizer: optax.GradientTransformation) -> "LearnerState":
    return cls(params=params, opt_state=optimizer.init(params), step=jnp.zeros((), jnp.int32))
