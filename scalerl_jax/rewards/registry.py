"""The reward table (scalerl_jax.registry.Registry) and name-based scoring."""
from __future__ import annotations

from typing import Callable

from scalerl_jax.registry import Registry

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward")
register = REWARDS.register   # decorator: `@register("name")` on fn(completion_text, answer)


def get(name: str) -> RewardFn:
  """The verifier registered as `name` (ValueError listing the registered ones otherwise)."""
  return REWARDS.get(name)


def names() -> tuple[str, ...]:
  """Registered reward names, sorted."""
  return REWARDS.names()


def compute_reward(name: str, completion_text: str, answer: str) -> float:
  """Scores one completion text against `answer` with the verifier `name`."""
  return float(get(name)(completion_text, answer))
