"""Length control helpers (PAPER_NOTES §3), pure numpy so both generator backends share them.

Forced interruption: when thinking exceeds a budget drawn uniformly in [think_budget_min,
think_budget_max], the generator appends the interruption text ("Okay, time is up. ... </think>") and
lets the model answer for up to `answer_budget` more tokens (`think_budget` draws the budget; each
backend injects the tokens its own way). The injected tokens are not the policy's: they are flagged
`policy_mask=False` (kept out of the loss) and carry log-prob 0.
Length penalty (the studied alternative): on correct traces the reward gets
clip((L_max - |y|) / L_cache - 1, -1, 0) added (L_max=14336, L_cache=2048 by default).
"""
from __future__ import annotations

import numpy as np



def think_budget(seed: int, prompt_id: int, sample: int, lo: int, hi: int) -> int:
  """The thinking budget of sample `sample` of prompt `prompt_id`: uniform over the integers in
  [lo, hi] (both inclusive), reproducible per (seed, prompt, sample) whatever the batch around it.
  Both backends draw here (the JAX sampler per row, the vLLM worker per request)."""
  if not 0 <= lo <= hi:
    raise ValueError(f"need 0 <= think_budget_min <= think_budget_max, got [{lo}, {hi}]")
  rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(prompt_id) & 0xFFFFFFFF, int(sample)])
  return int(rng.integers(lo, hi + 1))


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
