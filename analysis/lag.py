"""Staleness summary of a run: the trained tokens' lag histogram (learner step − token version,
from the buffer's per-batch `lag_hist`), its mean per step, and the k3 KL per step, as
``RUN_DIR/fit/lag.json`` and ``lag.png`` (the demo's staleness plot, beside curves.png)."""
from __future__ import annotations

import json
import os

import numpy as np

from analysis.metrics import METRICS_FILE, read_metrics_lines
from analysis.plots import plot_lag
from scalerl_jax import storage


def lag_summary(run_dir: str | os.PathLike) -> dict:
  """{"lag_hist": total trained tokens per lag, "mean_lag": token-weighted, "max_lag",
  "max_kl_k3", "steps", "mean_lag_per_step", "kl_k3_per_step"} from the train lines."""
  lines = read_metrics_lines(storage.join(str(run_dir), METRICS_FILE))
  train = [r for r in lines if r.get("kind") == "train" and "lag_hist" in r]
  width = max((len(r["lag_hist"]) for r in train), default=0)
  total = np.zeros(width, np.int64)
  per_step = []
  for r in train:
    h = np.asarray(r["lag_hist"], np.int64)
    total[:len(h)] += h
    per_step.append(float((h * np.arange(len(h))).sum() / max(h.sum(), 1)))
  kl = [float(r.get("kl_k3", float("nan"))) for r in train]
  n = max(int(total.sum()), 1)
  return dict(lag_hist=total.tolist(), mean_lag=float((total * np.arange(width)).sum() / n),
              max_lag=int(np.nonzero(total)[0][-1]) if total.any() else 0,
              max_kl_k3=float(np.nanmax(kl)) if kl else float("nan"),
              steps=[int(r["step"]) for r in train], mean_lag_per_step=per_step,
              kl_k3_per_step=kl)


def write_lag_summary(run_dir: str | os.PathLike, out_dir: str | os.PathLike) -> dict:
  """`lag_summary` into OUT_DIR/lag.json and its figure OUT_DIR/lag.png (left: the lag histogram
  of every trained token; right: mean lag and k3 KL per step). Returns the summary."""
  s = lag_summary(run_dir)
  storage.makedirs(str(out_dir))
  storage.write_text(storage.join(str(out_dir), "lag.json"), json.dumps(s))
  plot_lag(s, storage.join(str(out_dir), "lag.png"))
  return s
