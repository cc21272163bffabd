"""Length control helpers (PAPER_NOTES §3), pure numpy so every generator backend can share them.

Forced interruption: when thinking exceeds a budget drawn uniformly in [think_budget_min,
think_budget_max], the generator appends the interruption text ("Okay, time is up. ... </think>") and
lets the model answer for up to `answer_budget` more tokens. The injected tokens are not the policy's:
they are flagged `policy_mask=False` (kept out of the loss) and carry log-prob 0.
Length penalty (the studied alternative): on correct traces the reward gets
clip((L_max - |y|) / L_cache - 1, -1, 0) added (L_max=14336, L_cache=2048 by default).
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from scalerl_jax.types import FINISH_INTERRUPTED, Completion, SamplingSpec


def draw_think_budget(rng: np.random.Generator, lo: int, hi: int) -> int:
  """A thinking budget drawn uniformly from the integers in [lo, hi] (both inclusive)."""
  if not 0 < lo <= hi:
    raise ValueError(f"need 0 < think_budget_min <= think_budget_max, got [{lo}, {hi}]")
  return int(rng.integers(lo, hi + 1))


def draw_think_budgets(rng: np.random.Generator, spec: SamplingSpec, n: int) -> np.ndarray:
  """`n` independent budgets (one per sequence) for `spec`'s range, int32."""
  if not 0 < spec.think_budget_min <= spec.think_budget_max:
    raise ValueError(f"bad think budget range [{spec.think_budget_min}, {spec.think_budget_max}]")
  return rng.integers(spec.think_budget_min, spec.think_budget_max + 1, size=n).astype(np.int32)


def must_interrupt(num_think_tokens: int, budget: int, thinking_ended: bool) -> bool:
  """True when a sequence still thinking has used its whole budget (inject the interruption now)."""
  return (not thinking_ended) and num_think_tokens >= budget


def interrupted_completion(prompt_id: int, think_tokens: np.ndarray, think_logprobs: np.ndarray,
                           think_versions: np.ndarray, interruption_tokens: np.ndarray,
                           answer_tokens: np.ndarray, answer_logprobs: np.ndarray,
                           answer_versions: np.ndarray, reward: float = 0.0,
                           injected_version: Optional[int] = None) -> Completion:
  """Builds [thinking | injected interruption | answer] with the injected part flagged not-policy.

  Injected tokens get log-prob 0 and, for version accounting, the version of the last policy token
  before them (or `injected_version`). finish_reason is "interrupted"."""
  parts = [(think_tokens, think_logprobs, think_versions), (answer_tokens, answer_logprobs,
                                                              answer_versions)]
  for name, (t, lp, v) in zip(("think", "answer"), parts):
    if not len(t) == len(lp) == len(v):
      raise ValueError(f"{name}: tokens/logprobs/versions lengths differ "
                       f"({len(t)}, {len(lp)}, {len(v)})")
  inj = np.asarray(interruption_tokens, np.int32)
  if inj.size == 0:
    raise ValueError("interruption_tokens is empty (tokenize SamplingSpec's interruption text)")
  if injected_version is None:
    src = think_versions if len(think_versions) else answer_versions
    if len(src) == 0:
      raise ValueError("no policy token to take the injected tokens' version from")
    injected_version = int(src[-1])
  tokens = np.concatenate([np.asarray(think_tokens, np.int32), inj,
                           np.asarray(answer_tokens, np.int32)])
  logprobs = np.concatenate([np.asarray(think_logprobs, np.float32), np.zeros(inj.size, np.float32),
                             np.asarray(answer_logprobs, np.float32)])
  versions = np.concatenate([np.asarray(think_versions, np.int32),
                             np.full(inj.size, injected_version, np.int32),
                             np.asarray(answer_versions, np.int32)])
  mask = np.concatenate([np.ones(len(think_tokens), bool), np.zeros(inj.size, bool),
                         np.ones(len(answer_tokens), bool)])
  return Completion(prompt_id=prompt_id, tokens=tokens, logprobs=logprobs, versions=versions,
                    policy_mask=mask, finish_reason=FINISH_INTERRUPTED, reward=reward)


def length_penalty(length: int | np.ndarray, l_max: int = 14336, l_cache: int = 2048
                   ) -> float | np.ndarray:
  """clip((L_max - |y|) / L_cache - 1, -1, 0): 0 up to L_max - L_cache, linear to -1 at L_max."""
  if l_cache <= 0 or l_max <= l_cache:
    raise ValueError(f"need 0 < L_cache < L_max, got L_max={l_max}, L_cache={l_cache}")
  p = np.clip((l_max - np.asarray(length, np.float64)) / l_cache - 1.0, -1.0, 0.0)
  return float(p) if np.ndim(p) == 0 else p


def apply_length_penalty(reward: float | np.ndarray, length: int | np.ndarray,
                         correct: bool | np.ndarray, l_max: int = 14336, l_cache: int = 2048
                         ) -> float | np.ndarray:
  """The reward transform: correct traces get `length_penalty` added; others are unchanged."""
  r = np.asarray(reward, np.float64) + np.where(correct, length_penalty(length, l_max, l_cache), 0.0)
  return float(r) if np.ndim(r) == 0 else r
