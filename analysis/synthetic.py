"""Synthetic Eq. 1 curves from the paper's Table 1 (tests, examples, notebook)."""

from __future__ import annotations

import numpy as np

from analysis.metrics import append_metrics, write_config
from analysis.scaling import sigmoid_curve

__all__ = ["TABLE1", "synthetic_curve", "write_synthetic_run"]

#: Table 1 of the paper: name -> (C_mid, B, A); R0 = 0.3 in the synthetic studies.
TABLE1 = {
  "scalerl": (2542, 1.92, 0.610),
  "scalerl_32k_gen": (11272, 1.89, 0.645),
  "gens_8": (2542, 2.44, 0.585),
  "gens_24": (3054, 2.22, 0.590),
  "gens_32": (2936, 2.07, 0.595),
  "scout": (4242, 1.65, 0.710),
  "batch_512": (2818, 1.77, 0.605),
  "batch_2048": (10909, 1.70, 0.645),
  "mathcode_math": (2896, 2.05, 0.595),
  "mathcode_code": (1675, 1.09, 0.615),
}


def synthetic_curve(A: float, B: float, C_mid: float, R0: float = 0.3, *, sigma: float = 0.01,
          c_start: float = 1500.0, c_stop: float | None = None, c_step: float = 100.0,
          seed=0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Sample Eq. 1 like the paper: a point every ``c_step`` hours from ``c_start`` to
    ``max(16000, 4 C_mid)`` (or ``c_stop``), plus Gaussian noise ``sigma`` (clipped to [0, 1]).
    Returns ``(C, y_noisy, y_true)``."""
  stop = max(16000.0, 4.0 * C_mid) if c_stop is None else c_stop
  C = np.arange(c_start, stop + 1e-9, c_step)
  truth = sigmoid_curve(C, A, B, C_mid, R0)
  rng = np.random.default_rng(seed)
  return C, np.clip(truth + rng.normal(0.0, sigma, C.shape), 0.0, 1.0), truth


def write_synthetic_run(run_dir, name: str, *, R0: float = 0.3, sigma: float = 0.01, seed: int = 0,
            c_step: float = 100.0, c_stop: float | None = None, hours_per_step: float = 2.0,
            train_every: int = 0) -> None:
  """Write a Table-1 run as ``metrics.jsonl`` + ``config.json`` in ``run_dir`` (step-0 eval at
    compute 0 with value R0 + noise; optional train-metric lines every ``train_every`` evals)."""
  C_mid, B, A = TABLE1[name]
  C, y, _ = synthetic_curve(A, B, C_mid, R0, sigma=sigma, c_start=c_step, c_stop=c_stop, c_step=c_step, seed=seed)
  rng = np.random.default_rng(seed + 10_000)
  r0_meas = float(np.clip(R0 + rng.normal(0.0, sigma), 0, 1))
  write_config(run_dir, {"name": name, "synthetic": True, "A": A, "B": B, "C_mid": C_mid, "R0": R0,
              "sigma": sigma, "seed": seed, "hours_per_step": hours_per_step})
  append_metrics(run_dir, {"step": 0, "compute_hours": 0.0, "val_pass_rate": round(r0_meas, 5)})
  for i, (c, v) in enumerate(zip(C, y), 1):
    step = int(round(c / hours_per_step))
    if train_every and i % train_every == 0:
      append_metrics(run_dir, {"step": step - 1, "compute_hours": round(float(c) - 0.5, 3),
                   "loss": round(float(rng.normal(0, 0.1)), 5), "lr": 5e-7})
    append_metrics(run_dir, {"step": step, "compute_hours": round(float(c), 3),
                 "val_pass_rate": round(float(v), 5)})
