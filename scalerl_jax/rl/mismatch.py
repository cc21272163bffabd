"""How far two policies' log-probs of the same tokens are apart: the generator's (vLLM, the JAX
sampler) against the learner's or a float64 reference. NumPy only (no JAX): the learner's parity
gate (training/health.py) and the vLLM parity tool (generation/vllm/parity.py) both read it."""
from __future__ import annotations

from typing import Sequence

import numpy as np


def parity_stats(gen_lp: Sequence[np.ndarray], ref_lp: Sequence[np.ndarray],
                 mask: Sequence[np.ndarray] | None = None) -> dict:
  """|Δ log-prob| mean/max/p99 and KL(π_gen||π_ref) estimates k1, k3 over all policy tokens."""
  g = np.concatenate([np.asarray(x, np.float64) for x in gen_lp])
  r = np.concatenate([np.asarray(x, np.float64) for x in ref_lp])
  if mask is not None:
    m = np.concatenate([np.asarray(x, bool) for x in mask])
    g, r = g[m], r[m]
  d = g - r
  log_ratio = r - g                     # log(π_ref / π_gen) on samples from π_gen
  return {"tokens": int(d.size), "mean_abs": float(np.abs(d).mean()),
          "max_abs": float(np.abs(d).max()), "p99_abs": float(np.quantile(np.abs(d), 0.99)),
          "mean": float(d.mean()), "kl_k1": float(d.mean()),
          "kl_k3": float(np.mean(np.expm1(log_ratio) - log_ratio)),
          "is_ratio_max": float(np.exp(log_ratio).max()), "is_ratio_min": float(np.exp(log_ratio).min())}
