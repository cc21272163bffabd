"""RL objective library: losses (registry of (sum, denominator) functions), aggregation weights,
group advantages, zero-variance filtering and No-Positive-Resampling. See docs/LEARNER.md."""
from scalerl_jax.rl.advantages import ADV_NORMS, group_advantages
from scalerl_jax.rl.aggregation import AGGREGATIONS, token_weights
from scalerl_jax.rl.filtering import zero_variance_keep
from scalerl_jax.rl.losses import (LossHParams, LossOut, get_loss, register_loss,
                                   registered_losses)
from scalerl_jax.rl.npr import PassRateHistory

__all__ = ["ADV_NORMS", "AGGREGATIONS", "LossHParams", "LossOut", "PassRateHistory", "get_loss",
           "group_advantages", "register_loss", "registered_losses", "token_weights",
           "zero_variance_keep"]
