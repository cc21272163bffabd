"""Learner padding (issue 24): the token axis is bucketed to a multiple (common.padded_length,
never above the config's longest sequence, not the next power of two), rows are length-sorted into
micro-batches and each micro-batch is cut to its own length bucket, with EXACTLY the same loss and
gradient as the unsorted, uncut full batch."""
import functools

import jax
import numpy as np
import optax
import pytest

from scalerl_jax import config as common
from scalerl_jax.learner import LearnerState, RLSpec, make_train_step
from scalerl_jax.learner.batch import (bucket_lengths, length_sorted_order,
                                       microbatch_token_slots, needed_lengths)
from scalerl_jax.training.trainer import pad_time
from test_train_step import _params, apply_fn, model_batch, tree_rel_err


def test_padded_length_is_a_clamped_multiple():
  assert common.padded_length(16_404, 128, 16_448) == 16_448      # clamped (old: 32,768)
  assert common.padded_length(16_300, 128, 16_448) == 16_384
  assert common.padded_length(80, 16, 136) == 80
  assert common.padded_length(81, 16, 136) == 96
  assert common.padded_length(0, 16, 136) == 16
  with pytest.raises(ValueError, match="exceeds the longest the config allows"):
    common.padded_length(16_404, 128, 16_384)
  with pytest.raises(ValueError, match="learner.pad_multiple=0"):
    common.padded_length(10, 0, 100)
  c = common.base_config()          # 8B budgets: 2048 + 12288 + 64 + 2048
  assert common.max_sequence_len(c.rollout) == 16_448
  arrays = {"tokens": np.ones((2, 16_404), np.int32), "loss_mask": np.ones((2, 16_404), bool)}
  assert pad_time(arrays, 128, common.max_sequence_len(c.rollout))["tokens"].shape == (2, 16_448)


def _ragged_batch(seed=11, T=48):
  """model_batch with rows of very different lengths (tokens / masks zero after each length)."""
  batch = model_batch(seed=seed, num_prompts=4, gens=4, seq=T)
  rng = np.random.default_rng(seed)
  lengths = rng.choice([10, 14, 20, 30, 40, 48], size=16)
  for r, L in enumerate(lengths):
    batch["loss_mask"][r, L:] = False
    batch["tokens"][r, L:] = 0
    batch["gen_logprobs"][r, L:] = 0.0
  assert batch["loss_mask"].any(axis=1).all()
  return batch


@functools.lru_cache(maxsize=None)
def _step(microbatches, pad_multiple=0, max_buckets=8):
  return jax.jit(make_train_step(apply_fn, optax.sgd(1.0), RLSpec(), microbatches,
                                 pad_multiple=pad_multiple, max_buckets=max_buckets))


def _run(step, batch):
  state = LearnerState.create(_params(), optax.sgd(1.0))
  new, m = step(state, batch)
  grad = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - np.asarray(b, np.float64),
                      state.params, new.params)
  return grad, {k: float(v) for k, v in m.items()}


@pytest.mark.slow   # compiles the step twice (one branch per bucket): ~30-60 s on 2 busy cores
def test_sorted_bucketed_microbatches_give_the_same_loss_and_gradient():
  batch = _ragged_batch()
  perm = length_sorted_order(batch["loss_mask"], 4)
  assert sorted(perm.tolist()) == list(range(16))
  sorted_batch = {k: np.asarray(v)[perm] for k, v in batch.items()}
  # each strided micro-batch of the sorted batch holds one run of sorted lengths
  need = needed_lengths(sorted_batch["loss_mask"])
  runs = [need[m::4] for m in range(4)]
  assert all(runs[m].max() <= runs[m + 1].min() for m in range(3)), runs
  buckets = bucket_lengths(48, 16, 8)
  assert buckets == (16, 32, 48)
  slots_sorted = microbatch_token_slots(sorted_batch["loss_mask"], 4, buckets)
  slots_unsorted = microbatch_token_slots(batch["loss_mask"], 4, buckets)
  real = int(need.sum())
  assert slots_sorted < slots_unsorted <= 16 * 48
  print(f"\n[padding] real {real} / slots: full {16 * 48}, bucketed unsorted {slots_unsorted}, "
        f"sorted {slots_sorted}")

  g_ref, m_ref = _run(_step(1), batch)                     # one full, uncut batch
  for name, b in (("sorted", sorted_batch), ("unsorted", batch)):
    g, m = _run(_step(4, 16, 8), b)
    e = tree_rel_err(g, g_ref)
    # fp32 sums in another order (4 micro-batches vs 1): 1.7e-6 measured; a wrong aggregation
    # (per-micro-batch normalisation, a dropped row) is off by 1e-2 or more
    assert e <= 1e-5, (name, e)
    for k in ("loss", "denominator", "is_ratio_mean", "is_ratio_max", "kl_k3", "entropy",
              "tokens", "effective_samples"):
      assert abs(m[k] - m_ref[k]) <= 2e-6 * max(1.0, abs(m_ref[k])), (name, k, m[k], m_ref[k])


def test_bucket_lengths_thinned_to_max_buckets():
  assert bucket_lengths(16_448, 128, 8)[-1] == 16_448 and len(bucket_lengths(16_448, 128, 8)) == 8
  assert bucket_lengths(100, 128, 8) == (100,)
  assert bucket_lengths(96, 16, 2) == (48, 96)
