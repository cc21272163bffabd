"""RL objective library: losses (registry of (sum, denominator) functions), aggregation weights,
group advantages, zero-variance filtering and No-Positive-Resampling. See docs/LEARNER.md.

Attributes load lazily (PEP 562) so jax-free processes (the rollout buffer) can import
`scalerl_jax.rl.npr` without pulling in jax.
"""
import importlib

_EXPORTS = {
    "ADV_NORMS": "advantages", "group_advantages": "advantages",
    "AGGREGATIONS": "aggregation", "token_weights": "aggregation",
    "zero_variance_keep": "filtering",
    "LossHParams": "losses", "LossOut": "losses", "get_loss": "losses",
    "register_loss": "losses", "registered_losses": "losses",
    "PassRateHistory": "npr",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name in _EXPORTS:
    return getattr(importlib.import_module(f"scalerl_jax.rl.{_EXPORTS[name]}"), name)
  if name in ("advantages", "aggregation", "filtering", "losses", "npr"):
    return importlib.import_module(f"scalerl_jax.rl.{name}")
  raise AttributeError(f"module 'scalerl_jax.rl' has no attribute {name!r}")
