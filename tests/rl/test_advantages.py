"""Advantages, zero-variance filter and No-Positive-Resampling vs independent float64 NumPy."""
import json

import numpy as np
import pytest

from scalerl_jax import rl


def np_adv(rewards, pids, norm, eps=1e-6):
  """Vectorised NumPy reference (different formulation from the JAX [B,B] matrices)."""
  r = np.asarray(rewards, np.float64)
  adv = np.zeros_like(r)
  for p in np.unique(pids):
    m = pids == p
    adv[m] = r[m] - r[m].mean()
    if norm == "prompt":
      adv[m] /= r[m].std() + eps
  if norm == "batch":
    adv = adv / (adv.std() + eps)
  return adv


@pytest.mark.parametrize("norm", tuple(rl.ADV_NORMS))
def test_group_advantages(norm):
  rng = np.random.default_rng(0)
  pids = rng.permutation(np.repeat(np.arange(10, 16), 8))
  rewards = rng.integers(0, 2, pids.size).astype(np.float32) + rng.random(pids.size).astype(np.float32)
  adv = np.asarray(rl.group_advantages(rewards, pids, np.ones(pids.size, bool), norm))
  np.testing.assert_allclose(adv, np_adv(rewards, pids, norm), rtol=1e-5, atol=1e-6)
  for p in np.unique(pids):                          # group baseline: zero mean per group
    assert abs(adv[pids == p].mean()) < 1e-5


def test_advantages_epsilon_safe_and_row_keep():
  pids = np.array([1, 1, 2, 2, -1])
  rewards = np.array([1.0, 1.0, 0.0, 0.0, np.nan], np.float32)   # constant groups, NaN padding
  keep = pids >= 0
  for norm in rl.ADV_NORMS:
    adv = np.asarray(rl.group_advantages(rewards, pids, keep, norm))
    assert np.all(adv == 0.0), (norm, adv)


def test_zero_variance_filter_counts_groups():
  pids = np.array([3, 3, 3, 7, 7, 7, 9, 9, 9, 4, 4, 4, -1, -1])
  rewards = np.array([1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 0, 1, 5, 6], np.float32)
  keep, dropped = rl.zero_variance_keep(rewards, pids, pids >= 0)
  np.testing.assert_array_equal(np.asarray(keep), [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0])
  assert float(dropped) == 2.0


def test_npr_retires_at_threshold_and_roundtrips_json():
  h = rl.PassRateHistory(threshold=0.9)
  assert h.update(1, [1] * 9 + [0]) == 0.9          # 0.9 ≥ 0.9 -> retired
  assert h.update(2, [1] * 8 + [0] * 2) == 0.8
  h.update_batch(np.array([5, 5, 6, 6, -1]), np.array([1, 1, 0, 1, 1.0]))
  assert h.is_retired(1) and not h.is_retired(2) and h.is_retired(5) and not h.is_retired(6)
  assert h.active([6, 1, 2, 5, 99]) == [6, 2, 99]
  assert h.pass_rate(6) == 0.5 and h.pass_rate(42) is None and h.num_retired == 2
  h.update(1, [0, 0])                                # retirement is permanent
  assert h.is_retired(1)
  d = json.loads(json.dumps(h.to_dict()))
  h2 = rl.PassRateHistory.from_dict(d)
  assert h2.to_dict() == h.to_dict() and h2.active([1, 2, 5, 6]) == [2, 6]


def test_npr_errors():
  with pytest.raises(ValueError, match="threshold"):
    rl.PassRateHistory(threshold=0.0)
  h = rl.PassRateHistory()
  with pytest.raises(ValueError, match="non-finite"):
    h.update(1, [np.nan, 1.0])
  with pytest.raises(ValueError, match="empty"):
    h.update(1, [])
