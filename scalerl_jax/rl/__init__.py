"""RL objective library: losses (registry of (sum, denominator) functions), aggregation weights,
group advantages, zero-variance filtering, rollout correction (TIS / ratio masks) and
No-Positive-Resampling. See docs/LEARNER.md.

Public names load lazily so jax-free processes (the rollout buffer) can import
`scalerl_jax.rl.npr` without pulling in jax.
"""
from scalerl_jax import lazy

__getattr__, __all__ = lazy.exports(__name__, {
    "ADV_NORMS": "advantages", "group_advantages": "advantages",
    "AGGREGATIONS": "aggregation", "token_weights": "aggregation",
    "zero_variance_keep": "filtering",
    "LOSSES": "losses", "LossHParams": "losses", "LossOut": "losses", "get_loss": "losses",
    "register_loss": "losses", "loss_metrics": "losses", "check_objective": "losses", "registered_losses": "losses", "clipped_ratio_loss": "losses",
    "PassRateHistory": "npr",
    "Correction": "correction", "check_correction": "correction",
    "correction_scale": "correction", "corrected_weights": "correction",
    "register_aggregation": "aggregation", "register_adv_norm": "advantages",
})
