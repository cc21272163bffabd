"""Unit tests for scalerl_jax.generation.interruption (budgets, injected tokens, length penalty)."""
import numpy as np
import pytest

from scalerl_jax.generation import interruption as it
from scalerl_jax.types import FINISH_INTERRUPTED, SamplingSpec


def test_budget_uniform_within_range():
  rng = np.random.default_rng(0)
  lo, hi = 10, 19
  draws = np.array([it.draw_think_budget(rng, lo, hi) for _ in range(20000)])
  assert draws.min() == lo and draws.max() == hi            # both ends inclusive, nothing outside
  counts = np.bincount(draws - lo, minlength=hi - lo + 1)
  expected = len(draws) / (hi - lo + 1)
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 27.9                                        # chi-square, 9 dof, p = 0.001


def test_budgets_paper_range_and_vectorized():
  spec = SamplingSpec()
  b = it.draw_think_budgets(np.random.default_rng(1), spec, 5000)
  assert b.dtype == np.int32 and b.min() >= 10240 and b.max() <= 12288
  assert abs(b.mean() - (10240 + 12288) / 2) < 30
  with pytest.raises(ValueError):
    it.draw_think_budget(np.random.default_rng(0), 5, 4)


def test_must_interrupt():
  assert it.must_interrupt(100, 100, thinking_ended=False)
  assert not it.must_interrupt(99, 100, thinking_ended=False)
  assert not it.must_interrupt(500, 100, thinking_ended=True)


def test_injected_tokens_flagged_not_policy():
  think = np.arange(5, dtype=np.int32)
  inj = np.array([900, 901, 902], np.int32)
  ans = np.array([7, 8], np.int32)
  c = it.interrupted_completion(3, think, -np.ones(5, np.float32), np.array([1, 1, 2, 2, 2]), inj,
                                ans, np.full(2, -0.5, np.float32), np.array([3, 3]), reward=1.0)
  assert c.finish_reason == FINISH_INTERRUPTED and c.prompt_id == 3 and c.reward == 1.0
  np.testing.assert_array_equal(c.tokens, [0, 1, 2, 3, 4, 900, 901, 902, 7, 8])
  np.testing.assert_array_equal(c.policy_mask, [1, 1, 1, 1, 1, 0, 0, 0, 1, 1])
  np.testing.assert_array_equal(c.logprobs[5:8], 0.0)
  np.testing.assert_array_equal(c.versions, [1, 1, 2, 2, 2, 2, 2, 2, 3, 3])
  assert c.tokens.dtype == np.int32 and c.logprobs.dtype == np.float32
  assert len({len(c.tokens), len(c.logprobs), len(c.versions), len(c.policy_mask)}) == 1
  with pytest.raises(ValueError):
    it.interrupted_completion(0, think, np.zeros(4), np.zeros(5), inj, ans, np.zeros(2), np.zeros(2))
  with pytest.raises(ValueError):
    it.interrupted_completion(0, think, np.zeros(5), np.zeros(5), [], ans, np.zeros(2), np.zeros(2))


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
