"""Grid posterior of Eq. 1 under the evaluation noise a run actually has (forecasts, issue #17).

Model of one run's evaluations ``y_k`` at compute ``C_k`` (R0 fixed to the step-0 value)::

    y_k = R0 + (A - R0) / (1 + (C_mid / C_k)^B) + e_k,     e ~ N(0, Sigma)
    Sigma = d I + s^2 R(rho),     R(rho)_{jk} = rho^|j-k|

* ``d``: the binomial variance of mean@n on the held-out set, ``m (1 - m) / n_samples`` with ``m``
  the mean fitted pass rate and ``n_samples`` = held-out prompts x samples per prompt (an upper
  bound: prompts of unequal difficulty make the true sampling variance smaller). 0 when unknown.
* ``s^2 R(rho)``: the excess, correlated along the run (AR(1) in the evaluation index): the
  policy wandering around the curve between evaluations, the held-out set's fixed prompts.
  ``s`` and ``rho`` are estimated by maximum likelihood on the residuals of the best grid fit and
  the total is inflated by ``n / (n - 3)`` for the three fitted parameters.

Prior: ``A`` uniform on ``(R0, 1]``, ``log C_mid`` uniform on ``[C_first / 10, 1000 C_last]``,
``log B`` uniform on ``[0.2, 10]``. The posterior is evaluated exactly on a (A x C_mid x B) grid:
for fixed ``(C_mid, B)`` the whitened chi^2 is a quadratic in ``a = A - R0`` (the same algebra as
``analysis.scaling``), so the whole grid costs two matrix products. Draws (with jitter inside each
grid cell) give every reported quantity: bands at any compute, intervals of A/B/C_mid, the
compute needed to reach a target, the probability that one run ends highest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from scipy.special import log_ndtr, ndtr, ndtri

from analysis.errors import AnalysisError, NoImprovementError, TooFewPointsError
from analysis.metrics import validate_curve
from analysis.scaling import MIN_POINTS, fit_sigmoid, sigmoid_curve

__all__ = ["Posterior", "fit_posterior", "estimate_noise", "whiten", "ar1_matrix", "ar1_excess_ml", "MIN_EVALS", "B_PRIOR", "LEVEL", "MODEL_ERROR",
           "MISSPEC_PRIOR", "MISSPEC_GAIN", "MISSPEC_UP", "LFO_SPLIT", "lfo_excess", "WIDE_BAND",
           "verdict"]

MIN_EVALS = 4            # evaluations after step 0 needed for any forecast
B_PRIOR = (0.2, 10.0)
LEVEL = 0.9              # the band the forecast reports
#: Widening of the noise model (sd factor) for what it leaves out: the mean of a fixed held-out set
#: is not exactly Eq. 1. 1.3 from seed 5 (80 runs) gave 84.5 % on seed 0 (200 runs); 1.5 is set
#: from those, and checked on the fresh seed 1 (docs/ANALYSIS.md).
MODEL_ERROR = 1.5
_RHOS = np.array([0.0, 0.2, 0.4, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95])

#: Misspecification term (issue #29): real curves drift from Eq. 1 (late rises, slow starts,
#: plateaus), which no noise model of Eq. 1 covers. Beyond the last evaluation ``C_last`` the band
#: adds a discrepancy ``N(0, tau(C)^2)``, ``tau(C) = kappa ln(C / C_last)`` (it grows with the
#: extrapolation distance), with ``kappa^2 = MISSPEC_PRIOR^2 + (MISSPEC_GAIN kappa_run)^2``:
#: ``kappa_run`` is the run's own leave-future-out misfit (``lfo_excess``: Eq. 1 fitted on the
#: evaluations up to ``LFO_SPLIT`` of its compute, its error on the later ones beyond what the
#: posterior and the noise explain, per unit of ln compute). Both constants are to be fitted on the
#: calibration half of the real runs in analysis/real_runs/ (``python -m analysis.calibrate
#: --only real``; docs/ANALYSIS.md "Misspecification"). Until then both are 0: the band is Eq. 1's
#: alone, as before (issue #29 is open; the first real runs showed ``kappa_run`` is too noisy on
#: prefixes still before the curve's bend, see NOTES.md of 2026-12-04 (2-core AMD EPYC)).
MISSPEC_PRIOR = 0.0
MISSPEC_GAIN = 0.0
LFO_SPLIT = 0.5
#: Upward drift allowance (issue #29): real long runs keep rising past the asymptote Eq. 1 fits on
#: their first part, and the data inside a run cannot tell (a higher A with a smaller B absorbs a
#: drift that has started; analysis tests: a 0.05 per e-fold drift moves the in-run residual trend
#: by 0.002 against a 0.004 standard error). The paper's own 8B fit moves A from 0.645 (1.5k-50k
#: hours) to 0.655 (0-100k): ~0.015 per e-fold of compute; the published 100k-hour curve was
#: forecast 0.013-0.027 low from 28-56 % cuts. So beyond C_last the band's UPPER edge is raised by
#: z * MISSPEC_UP * ln(C / C_last) (z: the level's normal quantile); the lower edge and the median
#: stay Eq. 1's. On simulated Eq. 1 runs it can only turn upper misses into covers. 0.009, not the
#: paper's ~0.015: the simulated runs' median band width (0.0207 at the budget, one e-fold past
#: the cut) may grow 1.5x at most (0.015 made it 1.83x: 80 runs, seed 21; docs/ANALYSIS.md).
MISSPEC_UP = 0.009
#: A band at the budget wider than this is called out even when Eq. 1's parameters are identifiable.
WIDE_BAND = 0.1


def verdict(identifiable: bool, band_width: float) -> str:
  """The forecast's one-phrase verdict (analysis.forecast and the live forecast say the same)."""
  if not identifiable:
    return "not yet identifiable"
  return "identifiable, wide band" if band_width > WIDE_BAND else "identifiable"


def ar1_matrix(n: int, rho: float) -> np.ndarray:
  """The AR(1) correlation matrix rho^|j-k| (tests and documentation; the fits use ``whiten``)."""
  idx = np.arange(n)
  return rho ** np.abs(idx[:, None] - idx[None, :])


def whiten(M, d, s2, rho) -> tuple[np.ndarray, np.ndarray]:
  """Innovations of the Kalman filter of ``y = x + e``, ``e ~ N(0, d)``, ``x`` AR(1) with variance
    ``s2`` and lag-one correlation ``rho``: a linear map W with ``W Sigma W^T = I`` for
    ``Sigma = d I + s2 R(rho)``, applied to every row of ``M`` (R, n). ``d, s2, rho``: arrays of
    shape (P,) (several noise models at once). Returns (whitened (P, R, n), log det Sigma (P,)),
    in O(P R n) time and without a dense n x n matrix."""
  M = np.atleast_2d(np.asarray(M, float))
  d, s2, rho = (np.atleast_1d(np.asarray(v, float))[:, None] for v in (d, s2, rho))
  P, (R, n) = len(d), M.shape
  q = s2 * (1.0 - rho * rho)
  xh = np.zeros((P, R))
  Pk = s2.copy()                     # prior variance of x_1
  out = np.empty((P, R, n))
  logdet = np.zeros(P)
  for k in range(n):
    if k:
      xh = rho * xh
      Pk = rho * rho * Pk + q
    F = np.maximum(Pk + d, 1e-300)
    v = M[None, :, k] - xh
    out[:, :, k] = v / np.sqrt(F)
    logdet += np.log(F[:, 0])
    K = Pk / F
    xh = xh + K * v
    Pk = (1.0 - K) * Pk
  return out, logdet


def ar1_excess_ml(resid: np.ndarray, d: float, n_params: int = 3) -> tuple[float, float, float]:
  """ML estimate of (s^2, rho) in Sigma = d I + s^2 R(rho) from residuals; returns (s2, rho, inflate)."""
  n = len(resid)
  s2_grid = np.concatenate([[0.0], np.geomspace(1e-8, 1.0, 120)])
  S2, RH = np.meshgrid(s2_grid, _RHOS, indexing="ij")
  S2, RH = S2.ravel(), RH.ravel()
  ok = (S2 > 0) | (d > 0)
  S2, RH = S2[ok], RH[ok]
  wr, logdet = whiten(resid[None], np.full(len(S2), d), S2, RH)
  nll = 0.5 * (logdet + np.sum(wr[:, 0] ** 2, axis=1))
  j = int(np.argmin(nll))
  return float(S2[j]), float(RH[j]), n / max(n - n_params, 1)


@dataclasses.dataclass
class Posterior:
  """Posterior draws of (A, B, C_mid) for one run; R0 fixed. Build with ``fit_posterior``."""

  A: np.ndarray
  B: np.ndarray
  C_mid: np.ndarray
  R0: np.ndarray                # the true step-0 value of each draw (measured + its error)
  r0_measured: float
  C: np.ndarray                 # compute of the fitted evaluations
  y: np.ndarray
  noise: dict                   # d, s2, rho, inflate, sigma (total sd per evaluation)
  map: dict                     # the grid point of highest posterior
  misspec: dict = dataclasses.field(default_factory=lambda: {"kappa": 0.0, "c_last": np.inf})
  value_max: float = 1.0        # the metric's ceiling (a pass rate: 1)

  def curves(self, C) -> np.ndarray:
    """Eq. 1 of every draw at compute ``C``: array (n_draws, len(C))."""
    C = np.atleast_1d(np.asarray(C, float))
    return sigmoid_curve(C[None], self.A[:, None], self.B[:, None], self.C_mid[:, None], self.R0[:, None])

  def misspec_sd(self, C, kappa: float | None = None) -> np.ndarray:
    """sd of the misspecification term at compute ``C``: ``kappa ln(C / C_last)`` beyond the last
    evaluation, 0 up to it (``kappa``: this posterior's ``misspec["kappa"]`` unless given)."""
    C = np.atleast_1d(np.asarray(C, float))
    with np.errstate(divide="ignore"):
      x = np.log(np.maximum(C, 1e-300) / self.misspec["c_last"])
    return (self.misspec["kappa"] if kappa is None else kappa) * np.maximum(x, 0.0)

  def band(self, C, level: float = LEVEL, measurement: bool = False, seed: int = 0,
           kappa: float | None = None, up: float | None = None, ceiling: bool = True) -> dict:
    """Median and central ``level`` band of the curve at compute ``C`` (arrays); with
    ``measurement``, of one evaluation there (the curve plus the noise model's sd). Beyond the
    last evaluation the curve carries the misspecification term (``kappa``: this posterior's
    unless given; 0 = Eq. 1's uncertainty alone) and its upper edge the upward drift allowance
    (``up``: this posterior's ``misspec["up"]``, ``MISSPEC_UP``, unless given), and while the run is not yet identifiable
    (``identifiability``: C_mid not bracketed, so A is not pinned down) the band's upper edge
    there is the metric's ceiling: nothing the data show rules a higher value out (``ceiling``
    False: Eq. 1's edge, as before issue #29). Both bands stay within [0, value_max]."""
    C = np.atleast_1d(np.asarray(C, float))
    cur = self.curves(C)
    tau = self.misspec_sd(C, kappa)
    if np.any(tau > 0):
      cur = cur + np.random.default_rng([seed, 29]).normal(0.0, 1.0, cur.shape) * tau[None, :]
    if measurement:
      cur = cur + np.random.default_rng(seed).normal(0.0, self.noise["sigma"], cur.shape)
    q = np.percentile(cur, [50, (1 - level) / 2 * 100, (1 + level) / 2 * 100], axis=0)
    up = self.misspec.get("up", 0.0) if up is None else up
    if up > 0:
      q[2] = q[2] + ndtri((1 + level) / 2) * self.misspec_sd(C, up)
    q = np.clip(q, 0.0, self.value_max)
    beyond = C > float(self.C[-1])
    if ceiling and beyond.any() and not self.identifiability(level=level)["identifiable"]:
      q[2] = np.where(beyond, self.value_max, q[2])
    return {"pred": q[0], "lo": q[1], "hi": q[2]}

  def interval(self, name: str, level: float = LEVEL) -> list[float]:
    """Central ``level`` interval of parameter ``name`` (A, B or C_mid)."""
    v = getattr(self, name)
    return [float(x) for x in np.percentile(v, [(1 - level) / 2 * 100, (1 + level) / 2 * 100])]

  def hours_to(self, target: float, level: float = LEVEL) -> dict:
    """Compute at which the curve reaches ``target``: median and band over draws (inf where
    A <= target), and ``p_unreachable`` = P(A <= target)."""
    a = self.A - self.R0
    t = target - self.R0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
      h = np.where(self.A > target, self.C_mid * (a / t - 1.0) ** (-1.0 / self.B), np.inf)
    big = np.finfo(float).max
    q = np.percentile(np.where(np.isfinite(h), h, big), [50, (1 - level) / 2 * 100, (1 + level) / 2 * 100],
                      method="lower")
    q = np.where(q >= big, np.inf, q)
    return {"pred": float(q[0]), "lo": float(q[1]), "hi": float(q[2]),
            "p_unreachable": float(np.mean(~np.isfinite(h)))}

  def p_cmid_beyond(self, c: float) -> float:
    """P(C_mid > c)."""
    return float(np.mean(self.C_mid > c))

  def identifiability(self, *, cmid_factor: float = 5.0, level: float = LEVEL) -> dict:
    """Verdict: identifiable once the run has shown its curvature, i.e. C_mid is bracketed: the
    upper ``level`` bound of C_mid is at most ``cmid_factor`` x the last evaluated compute. (On
    simulated runs that bound is 1.4-3.9 x the last compute at the first evaluation past C_mid and
    16-750 x before C_mid/4: analysis.calibrate.) A's interval is reported, not judged: the band
    carries it. Returns the verdict, its reasons and the numbers."""
    c_last = float(self.C[-1])
    a_lo, a_hi = self.interval("A", level)
    _, c_hi = self.interval("C_mid", level)
    bracketed = c_hi <= cmid_factor * c_last
    unstable = self.misspec.get("unstable_at", [])   # alarms inside the data (fit_posterior)
    reasons = []
    if unstable:   # issue #29, 2026-12-05, commit 2696fc8, 2-core Intel Xeon: a stall in an unstable phase reads as the asymptote
      reasons.append(f"KL(generator || learner) alarm at {len(unstable)} step(s) inside the data "
                     f"(first at {unstable[0]:.4g} h): an unstable phase; a stall or dip there "
                     "looks like the asymptote, so Eq. 1 cannot bound the final value from above "
                     "(docs/ANALYSIS.md 'Misspecification')")
    if not bracketed:
      reasons.append(f"C_mid not bracketed yet (P(C_mid > last eval {c_last:.4g} h) = "
                     f"{self.p_cmid_beyond(c_last):.2f}, upper {level:.0%} bound {c_hi:.4g} h = "
                     f"{c_hi / c_last:.3g} x the last eval, needs <= {cmid_factor:g} x)")
      reasons.append(f"A anywhere in {a_lo:.3f}-{a_hi:.3f} ({level:.0%})")
    return {"identifiable": bool(bracketed) and not unstable, "reasons": reasons,
            "p_cmid_beyond_last": self.p_cmid_beyond(c_last), "a_width": a_hi - a_lo,
            "cmid_hi_over_last": c_hi / c_last}


_LOGW_SPAN = 30.0     # grid cells below exp(-30) x the largest posterior weight hold no mass
_COARSE = (90, 70)    # (C_mid, B) grid over the whole prior, to find where the mass is
_FINE = (120, 110)    # (C_mid, B) grid over the box that holds the mass


def _basis(C, cm, bg):
  """s[c, b, i] = 1 / (1 + (C_mid_c / C_i)^B_b) as an array (n_c * n_b, n)."""
  L = np.log(cm)[:, None, None] - np.log(C)[None, None, :]
  with np.errstate(over="ignore"):
    S = 1.0 / (1.0 + np.exp(bg[None, :, None] * L))
  return S.reshape(-1, len(C))


def _cell_stats(C, yp, cm, bg, noise, v0):
  """Per (C_mid, B) cell: the Gaussian in ``a = A - R0`` left after whitening and integrating out
    the step-0 error ``delta ~ N(0, v0)`` (the curve passes through the true R0 = measured + delta):
    ``-2 log p(y | a, cell) = Q - 2 a S1 + a^2 S2 + logdet``. Returns S1, S2, Q, logdet and what
    drawing delta given a needs (``su``, ``uy``, ``uu``)."""
  S = _basis(C, cm, bg)
  f = noise["inflate"]
  n = len(C)
  W, _ = whiten(np.vstack([yp[None], np.ones((1, n)), S]), f * noise["d"], f * noise["s2"], noise["rho"])
  yt, ot, St = W[0, 0], W[0, 1], W[0, 2:]
  Ut = ot[None] - St                                     # whitened (1 - s)
  ss = np.einsum("gi,gi->g", St, St)
  sy = St @ yt
  uu = np.einsum("gi,gi->g", Ut, Ut)
  su = np.einsum("gi,gi->g", St, Ut)
  uy = Ut @ yt
  yy = float(yt @ yt)
  if v0 > 0:
    k = uu + 1.0 / v0
    S2 = ss - su * su / k
    S1 = sy - su * uy / k
    Q = yy - uy * uy / k
    logdet = np.log1p(v0 * uu)
  else:
    k = np.full_like(uu, np.inf)
    S2, S1, Q, logdet = ss, sy, np.full_like(ss, yy), np.zeros_like(ss)
  return {"S1": S1, "S2": S2, "Q": Q, "logdet": logdet, "su": su, "uy": uy, "k": k}


def _log_norm_cdf_diff(lo, hi):
  """log(Phi(hi) - Phi(lo)), stable in both tails."""
  a, b = log_ndtr(hi), log_ndtr(lo)
  with np.errstate(divide="ignore", invalid="ignore"):
    return np.where(b < a, a + np.log1p(-np.exp(np.minimum(b - a, 0.0))), -np.inf)


def _cell_logw(st, a_lo, a_hi):
  """log posterior mass of each (C_mid, B) cell, ``a`` integrated over its uniform prior."""
  S2 = np.maximum(st["S2"], 1e-300)
  mu = st["S1"] / S2
  sd = 1.0 / np.sqrt(S2)
  resid = st["Q"] - st["S1"] * mu                       # chi^2 at the unconstrained best a
  return (-0.5 * resid - 0.5 * st["logdet"] + np.log(sd)
          + _log_norm_cdf_diff((a_lo - mu) / sd, (a_hi - mu) / sd))


def _with_prior(st, cm, bg, prior, r0):
  """The cell statistics and log weights with a family prior (``analysis.family``): a Gaussian on
    A (``prior["A"]`` = (mean, sd)) multiplies each cell's Gaussian in ``a = A - R0`` (precisions
    add), and Gaussians on log C_mid and log B (``prior["log_cmid"]``, ``prior["log_b"]``) add their
    log densities to the cells (the grid is uniform in both logs, so the uniform prior's
    density is a constant). ``prior`` None: unchanged, with no extra term."""
  if not prior:
    return st, 0.0
  st = dict(st)
  if prior.get("A") is not None:
    mu_a, sd_a = float(prior["A"][0]) - r0, float(prior["A"][1])
    p = 1.0 / sd_a ** 2
    st["S2"] = st["S2"] + p
    st["S1"] = st["S1"] + mu_a * p
    st["Q"] = st["Q"] + mu_a * mu_a * p
  extra = np.zeros((len(cm), len(bg)))
  for key, grid, axis in (("log_cmid", np.log(cm), 0), ("log_b", np.log(bg), 1)):
    if prior.get(key) is not None:
      z = (grid - float(prior[key][0])) / float(prior[key][1])
      extra += np.expand_dims(-0.5 * z * z, 1 - axis)
  return st, extra.reshape(-1)


def _box(cm, bg, logw, pad=1):
  """(lo, hi) in log C_mid and log B of the cells holding mass, padded by ``pad`` cells."""
  keep = (logw > logw.max() - _LOGW_SPAN).reshape(len(cm), len(bg))
  ic = np.flatnonzero(keep.any(1))
  ib = np.flatnonzero(keep.any(0))
  lc, lb = np.log(cm), np.log(bg)
  return ([lc[max(ic[0] - pad, 0)], lc[min(ic[-1] + pad, len(cm) - 1)]],
          [lb[max(ib[0] - pad, 0)], lb[min(ib[-1] + pad, len(bg) - 1)]])


def _ls_fit(C, y, r0):
  """``analysis.scaling.fit_sigmoid`` (least squares, R0 fixed), memoised on the data: the noise
    estimate and the Laplace box use the same fit. None with too few points or no fit."""
  key = (C.tobytes(), y.tobytes(), float(r0))
  if _LS_CACHE.get("key") != key:
    fit = None
    if len(C) >= MIN_POINTS:
      try:
        fit = fit_sigmoid(C, y, r0)
      except AnalysisError:
        fit = None
    _LS_CACHE.update(key=key, fit=fit)
  return _LS_CACHE["fit"]


_LS_CACHE: dict = {}


def _laplace_box(C, y, r0, noise, prior_c, prior_b, k=8.0):
  """(log C_mid, log B) box of +-k sd around the least-squares fit (Laplace approximation with the
    whitened Jacobian), or None without a fit; keeps a thin ridge inside the fine grid."""
  fit = _ls_fit(C, y, r0)
  if fit is None:
    return None
  lc, b, a = np.log(fit.C_mid), fit.B, fit.A - r0
  u = np.exp(np.clip(b * (lc - np.log(C)), -700, 700))
  g = 1.0 / (1.0 + u)
  J = np.stack([g, -a * g * g * u * b, -a * g * g * u * (lc - np.log(C)) * b], 0)   # d/d(a, logC, logB)
  f = noise["inflate"]
  Jw, _ = whiten(J, f * noise["d"], f * noise["s2"], noise["rho"])
  H = Jw[0] @ Jw[0].T
  try:
    cov = np.linalg.inv(H)
  except np.linalg.LinAlgError:
    return None
  sd = np.sqrt(np.maximum(np.diag(cov), 0.0))
  if not np.all(np.isfinite(sd)):
    return None
  lb = np.log(b)
  return ([max(lc - k * sd[1], prior_c[0]), min(lc + k * sd[1], prior_c[1])],
          [max(lb - k * sd[2], prior_b[0]), min(lb + k * sd[2], prior_b[1])])


def _point_fit(C, y, r0):
  """Least-squares Eq. 1 curve at the evaluations (residuals for the noise estimate):
    ``analysis.scaling.fit_sigmoid`` with 5+ points, else the best cell of a coarse grid."""
  fit = _ls_fit(C, y, r0)
  if fit is not None:
    return fit.predict(C)
  cm = np.geomspace(C[0] / 10.0, 1000.0 * C[-1], _COARSE[0])
  bg = np.geomspace(*B_PRIOR, _COARSE[1])
  st = _cell_stats(C, y - r0, cm, bg, {"d": 1.0, "s2": 0.0, "rho": 0.0, "inflate": 1.0}, 0.0)
  a = np.clip(st["S1"] / st["S2"], 0.0, 1.0 - r0)
  j = int(np.argmin(st["Q"] - 2 * a * st["S1"] + a * a * st["S2"]))
  ic, ib = np.unravel_index(j, (len(cm), len(bg)))
  return sigmoid_curve(C, r0 + a[j], bg[ib], cm[ic], r0)


def estimate_noise(C, y, r0: float, n_samples: float | None = None) -> dict:
  """The noise model of a run from its evaluations: binomial part ``d`` (from ``n_samples``) and
    the ML AR(1) excess (``s2``, ``rho``) of the least-squares residuals; ``inflate`` = n/(n-3)."""
  fit = _point_fit(C, y, r0)
  resid = y - fit
  m_fit = float(np.clip(np.mean(fit), 0, 1))
  d = m_fit * (1 - m_fit) / float(n_samples) if n_samples else 0.0
  s2, rho, inflate = ar1_excess_ml(resid, d)
  if d == 0.0 and s2 == 0.0:        # a perfect fit with no known noise: a tiny floor, stays finite
    s2 = max(float(np.var(resid)), 1e-10)
  d0 = r0 * (1 - r0) / float(n_samples) if n_samples else 0.0
  return {"d": d, "s2": s2, "rho": rho, "inflate": inflate, "v0": inflate * (d0 + s2)}


def lfo_excess(C, y, r0: float, *, n_samples: float | None = None, split: float = LFO_SPLIT,
               seed: int = 0) -> dict:
  """Leave-future-out misfit of Eq. 1 inside one run: the posterior fitted on the evaluations with
    ``C <= split C_last`` predicts the later ones; ``kappa_run`` is the root mean square of their
    errors beyond the predictive variance (curve draws + noise model), per unit of ln compute
    past the prefix's last evaluation (0 when Eq. 1 explains them, or too few evaluations)."""
  C, y = np.asarray(C, float), np.asarray(y, float)
  m = C <= split * C[-1]
  out = {"kappa_run": 0.0, "lfo_prefix": int(m.sum()), "lfo_future": int((~m).sum())}
  if m.sum() < MIN_EVALS or (~m).sum() < 2:
    return out
  try:
    post = fit_posterior(C[m], y[m], r0, n_samples=n_samples, n_draws=4000, seed=seed, misspec=False)
  except AnalysisError:
    return out
  cur = post.curves(C[~m])
  err = y[~m] - np.median(cur, axis=0)
  var = cur.var(axis=0) + post.noise["sigma"] ** 2
  x = np.log(C[~m] / C[m][-1])
  excess = max(float(np.mean(err ** 2 - var)), 0.0)
  out.update(kappa_run=float(np.sqrt(excess / np.mean(x ** 2))), lfo_mean_err=float(np.mean(err)))
  return out


def _posterior_grid(C, y, yp, r0: float, noise: dict, v0: float, prior, a_lo: float, a_hi: float):
  """fit_posterior's grid over (C_mid, B): a coarse pass over the prior box, then a fine one on
  the box holding the mass (and the Laplace box), widened while the mass touches an edge that is
  not the prior's. Returns (C_mid grid, B grid, per-cell stats, per-cell log weight)."""
  prior_c = (np.log(C[0] / 10.0), np.log(1000.0 * C[-1]))
  prior_b = tuple(np.log(B_PRIOR))
  cm = np.exp(np.linspace(prior_c[0], prior_c[1], _COARSE[0]))
  bg = np.exp(np.linspace(prior_b[0], prior_b[1], _COARSE[1]))
  st, extra = _with_prior(_cell_stats(C, yp, cm, bg, noise, v0), cm, bg, prior, r0)
  box_c, box_b = _box(cm, bg, _cell_logw(st, a_lo, a_hi) + extra)
  lap = _laplace_box(C, y, r0, noise, prior_c, prior_b)
  if lap is not None:
    box_c = [min(box_c[0], lap[0][0]), max(box_c[1], lap[0][1])]
    box_b = [min(box_b[0], lap[1][0]), max(box_b[1], lap[1][1])]
  for _ in range(4):    # widen the box while the mass touches an edge that is not the prior's
    cm = np.exp(np.linspace(box_c[0], box_c[1], _FINE[0]))
    bg = np.exp(np.linspace(box_b[0], box_b[1], _FINE[1]))
    st, extra = _with_prior(_cell_stats(C, yp, cm, bg, noise, v0), cm, bg, prior, r0)
    logw = _cell_logw(st, a_lo, a_hi) + extra
    keep = (logw > logw.max() - _LOGW_SPAN).reshape(len(cm), len(bg))
    grow = False
    for box, edge_lo, edge_hi, lim in ((box_c, keep[0].any(), keep[-1].any(), prior_c),
                                       (box_b, keep[:, 0].any(), keep[:, -1].any(), prior_b)):
      width = box[1] - box[0]
      if edge_lo and box[0] > lim[0] + 1e-9:
        box[0], grow = max(box[0] - width, lim[0]), True
      if edge_hi and box[1] < lim[1] - 1e-9:
        box[1], grow = min(box[1] + width, lim[1]), True
    if not grow:
      break
  return cm, bg, st, logw


def fit_posterior(C, y, r0: float, *, n_samples: float | None = None, n_draws: int = 20000,
                  seed: int = 0, value_max: float = 1.0, noise: dict | None = None,
                  r0_noise: bool = True, model_error: float = MODEL_ERROR,
                  misspec: bool = True, unstable_at=(), prior: dict | None = None) -> Posterior:
  """Posterior of Eq. 1 for evaluations ``(C, y)`` (C > 0) with ``r0`` the measured step-0 value.

    ``n_samples``: generations behind each evaluation (held-out prompts x samples per prompt, e.g.
    1000 x 16); sets the binomial part of the noise (omitted: all noise is estimated from the
    residuals). ``noise``: a fixed noise model (``estimate_noise``'s keys) instead of the estimate.
    ``r0_noise``: treat the step-0 value as a measurement too (its error integrated out).
    ``model_error``: sd factor on the whole noise model (``MODEL_ERROR``; 1 = none).
    ``misspec``: estimate the misspecification term (``MISSPEC_PRIOR``, ``lfo_excess``); False
    gives a band of Eq. 1's uncertainty alone. ``unstable_at``: compute of the run's
    KL(generator || learner) alarms (``RunData.alarms``); one inside the data makes the forecast
    not identifiable (its band's upper edge is the ceiling, ``Posterior.identifiability``).
    ``prior``: a family's shape and A (``analysis.family.family_prior``: Gaussians on log C_mid,
    log B and A, each (mean, sd) or None) on top of the uniform priors (``_with_prior``).
    Returns a ``Posterior`` with ``n_draws`` draws (seeded by ``seed``).
    """
  C, y = validate_curve(C, y, min_points=1, what="forecast input")
  m = C > 0
  C, y = C[m], y[m]
  if len(C) < MIN_EVALS:
    raise TooFewPointsError(f"{len(C)} evaluations after step 0, need at least {MIN_EVALS} to forecast; "
                            "wait for more evaluations (or evaluate more often)")
  if not np.isfinite(r0) or not 0 <= r0 < value_max:
    raise NoImprovementError(f"R0={r0} must be a pass rate below {value_max}; check the step-0 evaluation")
  if not np.max(y) > r0:
    raise NoImprovementError(f"the pass rate never exceeds R0={r0:.4g} (max {np.max(y):.4g}); there is "
                             "no rise to extrapolate yet - wait for more evaluations")
  noise = dict(estimate_noise(C, y, r0, n_samples) if noise is None else noise)
  noise["model_error"] = float(model_error)
  noise["inflate"] = float(noise["inflate"]) * model_error ** 2
  v0 = float(noise.get("v0", 0.0)) * model_error ** 2 if r0_noise else 0.0
  yp = y - r0
  a_lo, a_hi = 1e-6, value_max - r0
  cm, bg, st, logw = _posterior_grid(C, y, yp, r0, noise, v0, prior, a_lo, a_hi)
  w = np.exp(logw - logw.max())
  w /= w.sum()
  rng = np.random.default_rng(seed)
  g = np.searchsorted(np.cumsum(w), rng.random(n_draws) * (1 - 1e-12))
  g = np.minimum(g, len(w) - 1)
  ic, ib = np.unravel_index(g, (len(cm), len(bg)))
  dlc, dlb = np.log(cm[1] / cm[0]), np.log(bg[1] / bg[0])
  cmid = np.exp(np.log(cm[ic]) + (rng.random(n_draws) - 0.5) * dlc)
  b = np.exp(np.log(bg[ib]) + (rng.random(n_draws) - 0.5) * dlb)
  # a | cell: the Gaussian N(S1/S2, 1/S2) truncated to the prior, drawn by inverting its CDF
  S2 = np.maximum(st["S2"][g], 1e-300)
  mu, sd = st["S1"][g] / S2, 1.0 / np.sqrt(S2)
  plo, phi = ndtr((a_lo - mu) / sd), ndtr((a_hi - mu) / sd)
  u = plo + rng.random(n_draws) * (phi - plo)
  a = np.clip(mu + sd * ndtri(np.clip(u, 1e-300, 1 - 1e-16)), a_lo, a_hi)
  if v0 > 0:   # delta | a, cell
    k = st["k"][g]
    delta = (st["uy"][g] - a * st["su"][g]) / k + rng.normal(0.0, 1.0, n_draws) / np.sqrt(k)
  else:
    delta = np.zeros(n_draws)
  R0 = r0 + delta
  j = int(np.argmax(logw))
  jc, jb = np.unravel_index(j, (len(cm), len(bg)))
  a_map = float(np.clip(st["S1"][j] / st["S2"][j], a_lo, a_hi))
  noise["sigma"] = float(np.sqrt(noise["inflate"] * (noise["d"] + noise["s2"])))
  ms: dict[str, Any] = {"kappa_prior": MISSPEC_PRIOR if misspec else 0.0, "gain": MISSPEC_GAIN, "c_last": float(C[-1]),
        "kappa_run": 0.0}
  if misspec and MISSPEC_GAIN > 0:   # one more fit per forecast: only when it counts
    ms.update(lfo_excess(C, y, r0, n_samples=n_samples, seed=seed))
  ms["kappa"] = float(np.hypot(ms["kappa_prior"], ms["gain"] * ms["kappa_run"]))
  ms["up"] = MISSPEC_UP if misspec else 0.0
  ms["unstable_at"] = sorted(float(c) for c in np.atleast_1d(np.asarray(unstable_at, float))
                             if 0 < c <= float(C[-1])) if misspec else []
  return Posterior(A=R0 + a, B=b, C_mid=cmid, R0=R0, r0_measured=float(r0), C=C, y=y, noise=noise,
                   map={"A": r0 + a_map, "B": float(bg[jb]), "C_mid": float(cm[jc])}, misspec=ms,
                   value_max=float(value_max))
