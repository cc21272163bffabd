"""Bootstrap confidence intervals for (A, B, C_mid) and extrapolation with a prediction band."""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from analysis.scaling import (FitResult, Grids, fit_sigmoid, fit_sigmoid_many, prepare_window,
                              sigmoid_basis, sigmoid_curve)
from analysis.errors import TooFewPointsError

__all__ = ["bootstrap", "extrapolate"]

PARAMS = ("A", "B", "C_mid")
_BASIS_CACHE_ELEMS = 12_000_000  # ~100 MB for s and s^2 together


def _tqdm(enabled: bool, total: int, desc: str):
  if not enabled:
    return None
  return lambda it: tqdm(it, total=total, desc=desc, leave=False)


def bootstrap(C, y, r0: float, *, n_boot: int = 1000, method: str = "pairs", level: float = 0.95,
       cutoff: float | None = None, grids: Grids | None = None, A: float | None = None,
       fit: FitResult | None = None, seed: int = 0, chunk: int = 100, progress: bool = False,
       refine: bool = True, value_range=(0.0, 1.0)) -> dict:
  """Bootstrap the Eq. 1 fit (the full grid procedure on every resample, vectorized over resamples).

    ``method='pairs'`` resamples evaluation points with replacement (multinomial weights);
    ``'residual'`` adds resampled residuals of the point fit to it. Returns ``samples`` (n_boot x 3
    array of A, B, C_mid), ``ci`` ({A, B, C_mid} -> [lo, hi] percentile interval at ``level``),
    ``std`` and the point ``fit``.
    """
  if method not in ("pairs", "residual"):
    raise ValueError(f"bootstrap method {method!r} is unknown; use 'pairs' or 'residual'")
  if not n_boot >= 1:
    raise ValueError(f"n_boot={n_boot} must be >= 1; use e.g. 1000")
  Cw, yw, grids = prepare_window(C, y, r0, cutoff, value_range, grids, A_fixed=A)
  fit = fit or fit_sigmoid(Cw, yw, r0, grids=grids, A=A, value_range=value_range)
  rng = np.random.default_rng(seed)
  n = len(Cw)
  resid = yw - fit.predict(Cw)
  samples = np.empty((n_boot, 3))
  basis = None
  if len(grids.C_mid) * len(grids.B) * n <= _BASIS_CACHE_ELEMS:  # reuse s and s^2 across chunks
    s = sigmoid_basis(Cw, grids.C_mid, grids.B)
    basis = (s, s * s)
  wrap = _tqdm(progress, n_boot, "bootstrap")
  bar = wrap(range(n_boot)) if wrap else None
  for b0 in range(0, n_boot, chunk):
    k = min(chunk, n_boot - b0)
    if method == "pairs":
      W = rng.multinomial(n, np.full(n, 1.0 / n), size=k).astype(float)
      Y = np.broadcast_to(yw, (k, n))
    else:
      W = None
      Y = fit.predict(Cw)[None] + rng.choice(resid, size=(k, n), replace=True)
    res = fit_sigmoid_many(Cw, Y, r0, grids, W=W, refine=refine, polish=False, basis=basis)
    samples[b0:b0 + k] = [[r["A"], r["B"], r["C_mid"]] for r in res]
    if bar is not None:
      bar.update(k)
  if bar is not None:
    bar.close()
  q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
  ci = {p: [float(v) for v in np.percentile(samples[:, i], q)] for i, p in enumerate(PARAMS)}
  return {"samples": samples, "ci": ci, "std": {p: float(samples[:, i].std(ddof=1)) if n_boot > 1 else 0.0
                         for i, p in enumerate(PARAMS)},
      "fit": fit, "level": level, "method": method, "n_boot": n_boot, "sigma": float(resid.std(ddof=3))}


def extrapolate(C, y, r0: float, fit_until: float, *, cutoff: float | None = None, n_boot: int = 1000,
        level: float = 0.95, grids: Grids | None = None, seed: int = 0, progress: bool = False,
        method: str = "pairs", value_range=(0.0, 1.0), smooth_last: int = 5) -> dict:
  """Fit on ``cutoff <= C <= fit_until``, predict every later point, with bootstrap bands.

    Returns the ``fit``, ``bootstrap`` result and ``prediction``: per held-out point ``compute``,
    ``true``, ``pred``, ``error`` (pred - true), ``band`` (confidence band of the curve) and
    ``pred_band`` (adds the residual noise, an interval for a new measurement), plus ``final_true``,
    ``final_pred``, ``abs_error``, ``final_band``, ``mean_abs_error``, ``max_abs_error`` and the same
    final comparison on the mean of the last ``smooth_last`` points (``abs_error_smoothed``).
    """
  C = np.asarray(C, float)
  y = np.asarray(y, float)
  later = C > fit_until
  if not later.any():
    raise TooFewPointsError(f"fit_until={fit_until} is at or beyond the last evaluation "
                f"(compute {C[-1] if C.size else 'none'}); choose a value below it to extrapolate")
  Cf, yf = C[~later], y[~later]
  boot = bootstrap(Cf, yf, r0, n_boot=n_boot, level=level, cutoff=cutoff, grids=grids, seed=seed,
           progress=progress, method=method, value_range=value_range)
  fit = boot["fit"]
  Cp, yp = C[later], y[later]
  pred = fit.predict(Cp)
  s = boot["samples"]
  curves = sigmoid_curve(Cp[None], s[:, :1], s[:, 1:2], s[:, 2:3], r0)      # (n_boot, m)
  rng = np.random.default_rng(seed + 1)
  noisy = curves + rng.normal(0.0, boot["sigma"], curves.shape)
  q = [(1 - level) / 2 * 100, (1 + level) / 2 * 100]
  band = np.percentile(curves, q, axis=0)
  pband = np.percentile(noisy, q, axis=0)
  err = pred - yp
  prediction = {
    "fit_until": float(fit_until), "compute": Cp.tolist(), "true": yp.tolist(), "pred": pred.tolist(),
    "error": err.tolist(), "band": band.T.tolist(), "pred_band": pband.T.tolist(),
    "final_compute": float(Cp[-1]), "final_true": float(yp[-1]), "final_pred": float(pred[-1]),
    "abs_error": float(abs(err[-1])), "final_band": band[:, -1].tolist(),
    "final_pred_band": pband[:, -1].tolist(), "mean_abs_error": float(np.mean(np.abs(err))),
    "max_abs_error": float(np.max(np.abs(err))), "level": level,
  }
  k = min(smooth_last, len(Cp))  # the measured final value is noisy: also compare the mean of the last k
  prediction.update(smooth_last=k, final_true_smoothed=float(yp[-k:].mean()),
           final_pred_smoothed=float(pred[-k:].mean()),
           abs_error_smoothed=float(abs(pred[-k:].mean() - yp[-k:].mean())))
  return {"fit": fit, "bootstrap": boot, "prediction": prediction}
