"""Unit tests for scalerl_jax.generation.interruption (budgets, injected tokens, length penalty)."""
import numpy as np
import pytest

from scalerl_jax.generation import interruption as it
from scalerl_jax.types import SamplingSpec


def test_budget_uniform_within_range():
  lo, hi = 10, 19
  draws = np.array([it.think_budget(3, pid, j, lo, hi) for pid in range(2000) for j in range(10)])
  assert draws.min() == lo and draws.max() == hi            # both ends inclusive, nothing outside
  counts = np.bincount(draws - lo, minlength=hi - lo + 1)
  expected = len(draws) / (hi - lo + 1)
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 27.9                                        # chi-square, 9 dof, p = 0.001


def test_budgets_paper_range_and_reproducible_per_sample():
  spec = SamplingSpec()
  b = np.array([it.think_budget(1, pid, 0, spec.think_budget_min, spec.think_budget_max)
                for pid in range(5000)])
  assert b.min() >= 10240 and b.max() <= 12288
  assert abs(b.mean() - (10240 + 12288) / 2) < 30
  # the same (seed, prompt, sample) gets the same budget; another sample or seed another one
  assert it.think_budget(7, 42, 3, 10, 10_000) == it.think_budget(7, 42, 3, 10, 10_000)
  assert len({it.think_budget(7, 42, j, 10, 10_000) for j in range(8)}) == 8
  assert it.think_budget(8, 42, 3, 10, 10_000) != it.think_budget(7, 42, 3, 10, 10_000)
  with pytest.raises(ValueError, match="think_budget_min <= think_budget_max"):
    it.think_budget(0, 0, 0, 5, 4)


def test_both_backends_draw_budgets_here():
  """The JAX sampler and the vLLM worker import the one budget function (no copies)."""
  from scalerl_jax.generation import sampler
  from scalerl_jax.generation.vllm import worker
  assert sampler.think_budget is it.think_budget and worker.think_budget is it.think_budget


@pytest.mark.parametrize("length,expected", [
    (0, 0.0), (12288, 0.0),              # up to L_max - L_cache: no penalty
    (12289, -1 / 2048), (13312, -0.5),   # linear ramp
    (14336, -1.0), (20000, -1.0),        # at and beyond L_max: clipped at -1
])
def test_length_penalty_boundaries(length, expected):
  assert it.length_penalty(length) == pytest.approx(expected, abs=1e-12)


def test_apply_length_penalty_only_on_correct():
  assert it.apply_length_penalty(1.0, 13312, True) == pytest.approx(0.5)
  assert it.apply_length_penalty(0.0, 13312, False) == 0.0
  assert it.apply_length_penalty(1.0, 100, True) == 1.0
  r = it.apply_length_penalty(np.array([1.0, 1.0, 0.0]), np.array([14336, 12288, 14336]),
                              np.array([True, True, False]))
  np.testing.assert_allclose(r, [0.0, 1.0, 0.0])
  with pytest.raises(ValueError):
    it.length_penalty(10, l_max=100, l_cache=0)
