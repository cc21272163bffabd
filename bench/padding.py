"""Fraction of learner token slots that are padding, on a run's dumped batches (debug_dump_every).

    python -m bench.padding WORKDIR/batches [--pad_multiple 16] [--max_len 136] [--microbatches 8]

Before (the old trainer): every row padded to the next power-of-two multiple of 32 of the batch's
longest row. After: `run_config.padded_length` (a multiple of pad_multiple, clamped to max_len); with
M > 1 micro-batches also the length-sorted rows and each micro-batch cut to its own bucket
(`learner.batch.microbatch_token_slots`, as the learner step chooses them).
"""
import argparse
import glob
import json
import os

import numpy as np

from scalerl_jax import config as run_config
from scalerl_jax.learner.batch import bucket_lengths, length_sorted_order, microbatch_token_slots


def _old_len(T: int, bucket: int = 32) -> int:
  t = bucket
  while t < T:
    t *= 2
  return t


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("batches")
  ap.add_argument("--pad_multiple", type=int, default=16)
  ap.add_argument("--max_len", type=int, default=136)
  ap.add_argument("--microbatches", type=int, default=8)
  ap.add_argument("--max_buckets", type=int, default=8)
  a = ap.parse_args()
  real = old = new = sorted_mb = 0
  files = sorted(glob.glob(os.path.join(a.batches, "*.npz")))
  for f in files:
    z = np.load(f)
    tok, mask = z["tokens"], z["loss_mask"].astype(bool)
    nz = (tok != 0) | mask
    lengths = np.where(nz.any(1), tok.shape[1] - np.argmax(nz[:, ::-1], axis=1), 0)
    B, T = len(lengths), int(lengths.max())
    real += int(lengths.sum())
    old += B * _old_len(T)
    Tn = run_config.padded_length(T, a.pad_multiple, a.max_len)
    new += B * Tn
    m = a.microbatches
    perm = length_sorted_order(mask[:, :Tn] if mask.shape[1] >= Tn else mask, m)
    sorted_mb += microbatch_token_slots(mask[perm], m, bucket_lengths(Tn, a.pad_multiple,
                                                                      a.max_buckets))
  print(json.dumps(dict(batches=len(files), real_tokens=real,
                        pad_frac_old_pow2=round(1 - real / old, 4),
                        pad_frac_multiple=round(1 - real / new, 4),
                        pad_frac_sorted_microbatches=round(1 - real / sorted_mb, 4),
                        microbatches=a.microbatches, pad_multiple=a.pad_multiple)))


if __name__ == "__main__":
  main()
