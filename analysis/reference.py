"""Reference-calibrated forecasts: correct a run's forecast by how finished runs of the same setup
were forecast (issue #29, 2026-12-05, commit 97f7cd7, 2-core Intel Xeon; docs/ANALYSIS.md "Reference runs").

On real runs the forecast from a prefix is precise but biased, and the bias belongs to the setup
(task, evaluation set, base policy), not to the run: on the step axis the 50 % cut of 30 runs
from one base policy was forecast +0.038 high (each within 0.005 of that), of 13 runs from another
0.017 low. A run's own prefix does not show it; finished runs of the same setup do. The rule
(declared before its held-out test ran):

1. ``rho = budget / x_last`` (the target's extrapolation distance); each reference is forecast by
   the same posterior from its evaluations with ``x <= x_end / rho``; its residual is its final
   measured value minus that forecast's median at ``x_end`` (``reference_residuals``);
2. only references whose prefix holds a KL alarm iff the target's does (all when none matches);
3. corrected median = the target's own median + the residuals' median;
4. band, split conformal: with ``n`` residuals sorted, ``k_lo = floor((n+1)(1-level)/2)`` and
   ``k_hi = ceil((n+1)(1+level)/2)``; the edges are the target's median plus those residuals (the
   target's own band edge plus the median residual where ``k`` falls outside 1..n: too few
   references); clipped to [0, 1]; a KL alarm in the target's prefix makes the upper edge the
   ceiling (``calibrate``).

The band is one of a measured value at the budget (the residuals are against measured finals).
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np
from scipy.stats import t as student_t

from analysis.errors import AnalysisError, ForecastInputError
from analysis.metrics import RunData
from analysis.posterior import LEVEL, fit_posterior

__all__ = ["reference_residuals", "calibrate", "parametric_edges", "alarm_before", "recovered_from_alarm", "SMALL_MIN",
           "RECOVERY_EVALS"]

#: fewest residuals a family's alarm stratum or parametric band is built from (``calibrate(small=True)``)
SMALL_MIN = 3
#: evaluations averaged on each side of ``recovered_from_alarm``'s comparison
RECOVERY_EVALS = 3


def alarm_before(run: RunData, x_last: float) -> bool:
  """Whether a KL(generator || learner) alarm of ``run`` falls inside its prefix (0, x_last]."""
  a = np.asarray(run.alarms, float)
  return bool(np.any((a > 0) & (a <= x_last)))


def recovered_from_alarm(run: RunData, x_last: float, k: int = RECOVERY_EVALS) -> bool:
  """Whether ``run``'s prefix (0, x_last] holds a KL alarm and has come back from it: the mean of its
    last ``k`` evaluations is at or above the mean of the ``k`` evaluations up to (and at) its first
    alarm, so any dip the unstable phase caused is over (issue #48, third round; declared in
    docs/ANALYSIS.md before its held-out test). False without an alarm, or with no evaluation
    before the first alarm."""
  a = np.asarray(run.alarms, float)
  a = a[(a > 0) & (a <= x_last)]
  if not len(a):
    return False
  m = (run.compute > 0) & (run.compute <= x_last)
  C, y = run.compute[m], run.value[m]
  before = y[C <= a.min()]
  if not len(before):
    return False
  return bool(np.mean(y[-k:]) >= np.mean(before[-k:]))


def reference_residuals(refs: Sequence[RunData], ratio: float, *, level: float = LEVEL, seed: int = 0,
                        n_draws: int = 8000, n_samples_of: Callable[[RunData], float | None] | None = None,
                        cache: dict | None = None,
                        prior_of: Callable[[RunData], dict | None] | None = None,
                        prior_key=None) -> list[dict]:
  """Each finished reference run forecast from its evaluations with ``x <= x_end / ratio`` to its
    last evaluation ``x_end``, as a target at extrapolation distance ``ratio`` is: ``{run, residual
    (final - median), pred, final, x_cut, alarm}``. A reference whose prefix cannot be forecast
    (too few evaluations, no rise yet) is left out. ``n_samples_of(ref)``: generations behind one
    of its evaluations (None: estimated). ``cache``: a dict shared between calls (the fits keyed by
    the run and its number of evaluations in the prefix; ``n_samples_of`` asked once per run).
    ``prior_of(ref)``: the prior each reference is forecast with (a family's, ``analysis.family``;
    None: the uniform prior, as before); ``prior_key``: a hashable naming that prior in the cache keys
    (e.g. the family's members), so fits under different priors never mix."""
  if not (math.isfinite(ratio) and ratio >= 1.0):
    raise ForecastInputError(f"extrapolation ratio {ratio}: expected budget / last evaluation >= 1")
  out = []
  for j, ref in enumerate(refs):
    x_end = float(ref.compute[-1])
    m = (ref.compute > 0) & (ref.compute <= x_end / ratio * (1 + 1e-12))
    key = (ref.name, ref.run_dir, int(m.sum()), float(x_end), level, prior_key)
    if cache is not None and key in cache:
      rec = cache[key]
    else:
      rec = None
      try:
        post = fit_posterior(ref.compute[m], ref.value[m], ref.r0, seed=seed + j, n_draws=n_draws,
                             n_samples=_n_samples(ref, n_samples_of, cache), unstable_at=ref.alarms,
                             prior=prior_of(ref) if prior_of else None)
        pred = float(post.band([x_end], level, measurement=True, seed=seed + j)["pred"][0])
        x_cut = float(ref.compute[m][-1])
        rec = {"run": ref.name, "residual": float(ref.value[-1]) - pred, "pred": pred,
               "final": float(ref.value[-1]), "x_cut": x_cut, "x_end": x_end,
               "alarm": alarm_before(ref, x_cut)}
      except AnalysisError:
        rec = None
      if cache is not None:
        cache[key] = rec
    if rec is not None:
      out.append(rec)
  return out


def _n_samples(ref: RunData, n_samples_of, cache: dict | None) -> float | None:
  """``n_samples_of(ref)``, asked once per reference while ``cache`` lives (it may read a file)."""
  if n_samples_of is None:
    return None
  if cache is None:
    return n_samples_of(ref)
  key = ("n_samples", ref.name, ref.run_dir)
  if key not in cache:
    cache[key] = n_samples_of(ref)
  return cache[key]


def calibrate(pred: float, lo: float, hi: float, residuals: Sequence[dict], *, target_alarm: bool,
              level: float = LEVEL, value_max: float = 1.0, small: bool = False, recovered: bool = False) -> dict:
  """The reference-calibrated forecast from the target's own measurement-band median ``pred`` and
    edges ``lo``/``hi`` and the references' ``residuals`` (``reference_residuals``): ``{pred, lo,
    hi, shift (the median residual), n (residuals used), n_all, alarm, conformal_lo,
    conformal_hi (whether each edge is a residual, not the fallback), parametric}``.

    ``small`` (a family's residuals, issue #48, declared 2026-12-07 before its held-out test): the
    alarm stratum is used only when it holds ``SMALL_MIN`` residuals (else all); an edge the
    residuals are too few for (``k`` outside 1..n) is the parametric prediction edge ``pred + shift
    +- t(level, n-1) * sd * sqrt(1 + 1/n)`` (``parametric_edges``) instead of the target's own band.
    A KL alarm in the target's prefix makes the upper edge the ceiling either way (dropping that for
    a matched stratum was tried on the Xeon family and lost coverage, 89 % -> 83 %: docs/ANALYSIS.md),
    except, with ``small``, for a prefix that has ``recovered`` from its alarm
    (``recovered_from_alarm``; issue #48, third round): its band is its alarm stratum's."""
  if not residuals:
    raise ForecastInputError("no reference run could be forecast at this extrapolation distance; "
                             "give finished runs of the same setup with enough evaluations")
  same = [r for r in residuals if bool(r["alarm"]) == bool(target_alarm)]
  matched = len(same) >= (SMALL_MIN if small else 1)
  r = np.sort([float(x["residual"]) for x in (same if matched else residuals)])
  n = len(r)
  shift = float(np.median(r))
  alpha = 1.0 - level
  k_lo = math.floor((n + 1) * alpha / 2 + 1e-9)        # 1e-9: 1 - 0.9 is 0.0999...98 in floating point
  k_hi = math.ceil((n + 1) * (1 - alpha / 2) - 1e-9)
  par = small and n >= SMALL_MIN and (k_lo < 1 or k_hi > n)
  p_lo, p_hi = parametric_edges(pred + shift, r, level) if par else (lo + shift, hi + shift)
  new_lo = pred + r[k_lo - 1] if k_lo >= 1 else p_lo
  new_hi = pred + r[k_hi - 1] if k_hi <= n else p_hi
  if target_alarm and not (small and recovered):
    new_hi = value_max
  return {"pred": float(np.clip(pred + shift, 0.0, value_max)),
          "lo": float(np.clip(new_lo, 0.0, value_max)), "hi": float(np.clip(new_hi, 0.0, value_max)),
          "shift": shift, "n": n, "n_all": len(residuals), "alarm": bool(target_alarm),
          "conformal_lo": k_lo >= 1, "conformal_hi": k_hi <= n, "parametric": bool(par),
          "recovered": bool(target_alarm and small and recovered)}


def parametric_edges(centre: float, residuals, level: float = LEVEL) -> tuple[float, float]:
  """The normal-theory prediction interval of one more residual around ``centre``: ``centre +-
    t_{(1+level)/2, n-1} * s * sqrt(1 + 1/n)`` (``s``: the residuals' sample sd, n >= 2)."""
  r = np.asarray(residuals, float)
  n = len(r)
  if n < 2:
    raise ForecastInputError(f"a parametric band needs at least 2 residuals, got {n}")
  half = float(student_t.ppf(0.5 + level / 2, n - 1)) * float(np.std(r, ddof=1)) * math.sqrt(1.0 + 1.0 / n)
  return centre - half, centre + half
