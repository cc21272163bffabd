"""Eq. 1 of ScaleRL and its fits: ``R_C - R_0 = (A - R_0) / (1 + (C_mid / C)^B)``.

The paper's procedure (grid over A and C_mid, fit B for each pair, least squared residuals wins) is
computed exactly but vectorized. For fixed (C_mid, B) the sum of squared residuals is a quadratic in
``a = A - R0``: ``SSE = Syy - 2 a S1 + a^2 S2`` with ``S1 = sum w (y-R0) s``, ``S2 = sum w s^2`` and
``s = 1 / (1 + (C_mid/C)^B)``. So we evaluate ``s`` once on a (C_mid, B) grid (B on a fine log grid),
get ``S1, S2`` by matrix products (for many curves / bootstrap weights at once), and pick, for each
(C_mid, B), the A grid value nearest the unconstrained optimum ``S1/S2`` (a convex quadratic's
minimum over a grid). The global minimum over (A, C_mid, B) is thus the same as the paper's loop.
B is then polished by parabolic interpolation and a bounded 1-D solve at the winning (A, C_mid)
(what ``curve_fit`` on B does), and, by default, (A, C_mid, B) are refined continuously with
``scipy.optimize.least_squares`` within two grid cells of the winner.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np
from scipy import optimize

from analysis.errors import NoImprovementError
from analysis.metrics import validate_curve

__all__ = ["sigmoid_curve", "power_law_curve", "FitResult", "Grids", "default_grids", "paper_grids",
      "fit_sigmoid", "fit_sigmoid_many", "fit_sigmoid_free", "fit_power_law", "r_squared",
      "sse_surface", "sigmoid_basis", "prepare_window", "MIN_POINTS"]

MIN_POINTS = 5
B_RANGE = (0.05, 20.0)
_MAX_ELEMS = 3_000_000  # chunk size of the (C_mid, B, point) basis tensor


def sigmoid_curve(C, A, B, C_mid, R0):
  """Eq. 1: ``R0 + (A - R0) / (1 + (C_mid / C)^B)`` (equals R0 at C = 0)."""
  C = np.asarray(C, dtype=float)
  with np.errstate(divide="ignore", over="ignore"):
    return R0 + (A - R0) / (1.0 + np.exp(B * (np.log(C_mid) - np.log(C))))


def power_law_curve(C, A, B, D):
  """The power law ``A - D / C^B`` (what Eq. 1 tends to for C >> C_mid)."""
  C = np.asarray(C, dtype=float)
  return A - D * C ** (-B)


def r_squared(y, pred, w=None) -> float:
  """Coefficient of determination ``1 - SSE/SST`` (optionally weighted)."""
  y = np.asarray(y, float)
  w = np.ones_like(y) if w is None else np.asarray(w, float)
  mean = np.sum(w * y) / np.sum(w)
  sst = np.sum(w * (y - mean) ** 2)
  return float(1.0 - np.sum(w * (y - pred) ** 2) / sst) if sst > 0 else float("nan")


@dataclasses.dataclass(frozen=True)
class Grids:
  """Search grids: A values (absolute), C_mid values, and the fine log grid for B."""

  A: np.ndarray
  C_mid: np.ndarray
  B: np.ndarray


def paper_grids() -> Grids:
  """The paper's grids: A in 0.450..0.800 step 0.005, C_mid 100 linear values in [100, 40000]."""
  return Grids(A=np.round(np.arange(0.450, 0.8000001, 0.005), 6), C_mid=np.linspace(100, 40000, 100),
         B=np.geomspace(*B_RANGE, 200))


def default_grids(C, y, r0: float, *, value_range=(0.0, 1.0), a_step: float = 0.005, n_cmid: int = 120,
         n_b: int = 200) -> Grids:
  """Grids chosen from the data.

    A: step ``a_step`` from ``R0 + 0.5 (max y - R0)`` up to the metric's upper bound (1 for pass
    rates; ``R0 + 3 (max y - R0)`` if unbounded), at most 400 values. C_mid: ``n_cmid`` geometric
    values in ``[C_first/10, 10 C_last]``. B: ``n_b`` geometric values in [0.05, 20].
    """
  C = np.asarray(C, float)
  y = np.asarray(y, float)
  gain = float(np.max(y) - r0)
  if not gain > 0:
    raise NoImprovementError(f"the metric never exceeds R0={r0:.4g} (max {np.max(y):.4g}); Eq. 1 needs "
                 "a rising curve - check R0 (first evaluation) and the fit window")
  hi = value_range[1] if value_range is not None and np.isfinite(value_range[1]) else r0 + 3 * gain
  lo = r0 + 0.5 * gain
  if (hi - lo) / a_step + 1 > 400:
    A = np.linspace(lo, hi, 400)
  else:  # multiples of a_step (like the paper's 0.450, 0.455, ...), plus the upper bound itself
    A = np.arange(np.ceil(lo / a_step - 1e-9), np.floor(hi / a_step + 1e-9) + 1) * a_step
    A = np.unique(np.round(np.append(A, hi), 12))
  c_lo = max(C[0], C[-1] / 1000.0) / 10.0
  return Grids(A=A, C_mid=np.geomspace(c_lo, 10.0 * C[-1], n_cmid), B=np.geomspace(*B_RANGE, n_b))


@dataclasses.dataclass
class FitResult:
  """A fitted curve. ``kind`` is 'sigmoid' (R0 fixed), 'sigmoid_free' (4 params) or 'power_law'."""

  kind: str
  A: float
  B: float
  C_mid: float | None
  R0: float | None
  D: float | None
  sse: float
  r2: float
  n_points: int
  c_range: tuple[float, float]
  grid_winner: dict | None = None

  def predict(self, C) -> np.ndarray:
    """Evaluate the fitted curve at compute ``C``."""
    if self.kind == "power_law":
      return power_law_curve(C, self.A, self.B, self.D)
    return sigmoid_curve(C, self.A, self.B, self.C_mid, self.R0)

  def to_dict(self) -> dict:
    """JSON-friendly dict of the parameters and fit statistics."""
    d = dataclasses.asdict(self)
    d["c_range"] = list(self.c_range)
    return {k: v for k, v in d.items() if v is not None}


# ----------------------------------------------------------------------------------------- grid core
def sigmoid_basis(C, cm_grid, b_grid, c_slice=slice(None)):
  """s[c, b, i] = 1 / (1 + (C_mid_c / C_i)^B_b) as a 2-D array (rows: C_mid-major, B-minor)."""
  L = np.log(cm_grid[c_slice])[:, None] - np.log(C)[None, :]
  with np.errstate(over="ignore"):
    s = np.multiply(b_grid[None, :, None], L[:, None, :])
    np.exp(s, out=s)
  s += 1.0
  np.reciprocal(s, out=s)
  return s.reshape(-1, len(C))


def _basis_sums(C, Yp, W, cm_grid, b_grid, basis=None):
  """S1[k,c,b] = sum_i W[k,i] Yp[k,i] s[c,b,i] and S2[k,c,b] = sum_i W[k,i] s[c,b,i]^2.

    ``basis``: optional precomputed ``(s, s^2)`` from ``sigmoid_basis`` (reused across bootstrap chunks)."""
  K, n = Yp.shape
  nc, nb = len(cm_grid), len(b_grid)
  WY = Yp if W is None else W * Yp
  if basis is not None:
    s, s2 = basis
    S1 = (WY @ s.T).reshape(K, nc, nb)
    S2 = (s2.sum(1)[None] if W is None else W @ s2.T).reshape(-1, nc, nb)
    return S1, np.broadcast_to(S2, (K, nc, nb))
  S1 = np.empty((K, nc, nb))
  S2 = np.empty((K, nc, nb))
  step = max(1, _MAX_ELEMS // (nb * n))
  for c0 in range(0, nc, step):
    sl = slice(c0, min(nc, c0 + step))
    s = sigmoid_basis(C, cm_grid, b_grid, sl)
    S1[:, sl] = (WY @ s.T).reshape(K, -1, nb)
    s *= s
    S2[:, sl] = (s.sum(1)[None] if W is None else W @ s.T).reshape(-1, sl.stop - sl.start, nb)
  return S1, S2


def _grid_select(S1, S2, Syy, r0, A_grid):
  """Winner over (A grid, C_mid grid, B grid) per curve: indices and its SSE, with parabolic B."""
  K, nc, nb = S1.shape
  r0 = np.broadcast_to(np.asarray(r0, float), (K,))
  with np.errstate(divide="ignore", invalid="ignore"):
    a_star = S1 / S2 + r0[:, None, None]
  a_star = np.nan_to_num(a_star, nan=A_grid[0])
  dA = np.diff(A_grid)
  if len(A_grid) == 1:
    ia = np.zeros(a_star.shape, dtype=np.intp)
  elif np.allclose(dA, dA[0], rtol=1e-9, atol=0):  # uniform grid: nearest index by rounding
    ia = np.clip(np.rint((a_star - A_grid[0]) / dA[0]), 0, len(A_grid) - 1).astype(np.intp)
  else:
    j = np.clip(np.searchsorted(A_grid, a_star), 1, len(A_grid) - 1)
    ia = np.where(np.abs(A_grid[j - 1] - a_star) <= np.abs(A_grid[j] - a_star), j - 1, j)
  a = A_grid[ia] - r0[:, None, None]
  sse = Syy[:, None, None] - 2 * a * S1 + a * a * S2
  flat = sse.reshape(K, -1).argmin(1)
  ic, ib = np.unravel_index(flat, (nc, nb))
  k = np.arange(K)
  a_w = a[k, ic, ib]
  # parabolic interpolation in log B at the winning (A, C_mid)
  jb = np.clip(ib, 1, nb - 2)
  f = [Syy - 2 * a_w * S1[k, ic, jb + d] + a_w ** 2 * S2[k, ic, jb + d] for d in (-1, 0, 1)]
  den = f[0] - 2 * f[1] + f[2]
  with np.errstate(divide="ignore", invalid="ignore"):
    shift = np.where(den > 0, 0.5 * (f[0] - f[2]) / den, 0.0)
  shift = np.clip(np.nan_to_num(shift), -1.0, 1.0) + (jb - ib)
  return ia[k, ic, ib], ic, ib, shift, sse[k, ic, ib]


def _residual_fn(C, y, sw, r0, fixed: dict, free: Sequence[str]):
  """Residuals and Jacobian of Eq. 1 in parameters (A, logC_mid, B, R0), some of them fixed."""
  logC = np.log(C)

  def unpack(x):
    p = dict(fixed)
    p.update(zip(free, x))
    return p

  def fun(x):
    p = unpack(x)
    u = np.exp(np.clip(p["B"] * (p["logC_mid"] - logC), -700, 700))
    return sw * (p["R0"] + (p["A"] - p["R0"]) / (1 + u) - y)

  def jac(x):
    p = unpack(x)
    u = np.exp(np.clip(p["B"] * (p["logC_mid"] - logC), -700, 700))
    g = 1 / (1 + u)
    a = p["A"] - p["R0"]
    cols = {"A": g, "R0": 1 - g, "logC_mid": -a * g * g * u * p["B"],
        "B": -a * g * g * u * (p["logC_mid"] - logC)}
    return sw[:, None] * np.stack([cols[name] for name in free], axis=1)

  return fun, jac, unpack


def _refine(C, y, w, r0, A, C_mid, B, bounds: dict, fixed_names=("R0",)):
  """Bounded continuous least-squares refinement; returns (A, B, C_mid, R0, sse)."""
  x0 = {"A": A, "logC_mid": np.log(C_mid), "B": B, "R0": r0}
  free = [k for k in ("A", "logC_mid", "B", "R0") if k not in fixed_names and bounds[k][1] > bounds[k][0]]
  fixed = {k: v for k, v in x0.items() if k not in free}
  sw = np.ones_like(y) if w is None else np.sqrt(w)
  fun, jac, unpack = _residual_fn(C, y, sw, r0, fixed, free)
  if free:
    lb = np.array([bounds[k][0] for k in free])
    ub = np.array([bounds[k][1] for k in free])
    start = np.clip([x0[k] for k in free], lb + 1e-12 * (ub - lb), ub - 1e-12 * (ub - lb))
    # scipy's jac is unannotated (a default of "2-point"): a type checker infers str, not callable
    res = optimize.least_squares(fun, start, jac=jac,  # pyright: ignore[reportArgumentType]
                                 bounds=(lb, ub), method="trf", x_scale="jac",
                   xtol=1e-10, ftol=1e-12, gtol=1e-12)
    p, sse = unpack(res.x), float(np.sum(res.fun ** 2))
    base = float(np.sum(fun(np.array([x0[k] for k in free])) ** 2))
    if base < sse:  # never worse than the start
      p, sse = unpack(np.array([x0[k] for k in free])), base
  else:
    p, sse = x0, float(np.sum(fun(np.array([])) ** 2))
  return p["A"], p["B"], float(np.exp(p["logC_mid"])), p["R0"], sse


def _cell_bounds(grid, i, cells=2, log=False):
  g = np.log(grid) if log else np.asarray(grid, float)
  if len(g) == 1:
    return float(g[0]), float(g[0])
  return float(g[max(0, i - cells)]), float(g[min(len(g) - 1, i + cells)])


def fit_sigmoid_many(C, Y, r0, grids: Grids, *, W=None, refine: bool = True, polish: bool = True,
           progress=None, basis=None) -> list[dict]:
  """Fit Eq. 1 to several curves sharing compute points ``C`` (rows of ``Y``; optional weights ``W``).

    Returns one dict per row: A, B, C_mid, R0, sse and the grid winner. Used for bootstrap and
    multi-seed studies; ``fit_sigmoid`` is the validated single-curve entry point. ``basis``:
    optional ``(s, s**2)`` from ``sigmoid_basis(C, grids.C_mid, grids.B)`` to reuse across calls.
    """
  C = np.asarray(C, float)
  Y = np.atleast_2d(np.asarray(Y, float))
  K = Y.shape[0]
  r0v = np.broadcast_to(np.asarray(r0, float), (K,))
  Wm = None if W is None else np.atleast_2d(np.asarray(W, float))
  Yp = Y - r0v[:, None]
  Syy = np.sum((Yp * Yp) if Wm is None else Wm * Yp * Yp, axis=1)
  S1, S2 = _basis_sums(C, Yp, Wm, grids.C_mid, grids.B, basis=basis)
  ia, ic, ib, shift, sse_grid = _grid_select(S1, S2, Syy, r0v, grids.A)
  logb = np.log(grids.B)
  dlogb = logb[1] - logb[0]
  out = []
  it = range(K) if progress is None else progress(range(K))
  for k in it:
    A_w, cm_w = float(grids.A[ia[k]]), float(grids.C_mid[ic[k]])
    B_w = float(np.exp(logb[ib[k]] + shift[k] * dlogb))
    w = None if Wm is None else Wm[k]
    lo_b, hi_b = float(np.exp(logb[max(ib[k] - 1, 0)])), float(np.exp(logb[min(ib[k] + 1, len(logb) - 1)]))
    if polish:  # the paper's per-pair fit of B at the winning (A, C_mid)
      _, B_w, _, _, sse_w = _refine(C, Y[k], w, r0v[k], A_w, cm_w, B_w,
                     {"A": (A_w, A_w), "logC_mid": (np.log(cm_w),) * 2,
                      "B": (lo_b, hi_b), "R0": (r0v[k],) * 2})
    else:
      sse_w = float(sse_grid[k])
    B_w, sse_w = float(B_w), float(sse_w)
    res = {"A": A_w, "B": B_w, "C_mid": cm_w, "R0": float(r0v[k]), "sse": sse_w,
        "grid_winner": {"A": A_w, "B": B_w, "C_mid": cm_w, "sse": sse_w}}
    if refine:
      bounds = {"A": _cell_bounds(grids.A, ia[k]), "logC_mid": _cell_bounds(grids.C_mid, ic[k], log=True),
           "B": B_RANGE, "R0": (r0v[k], r0v[k])}
      A, B, cm, _, sse = _refine(C, Y[k], w, r0v[k], A_w, cm_w, B_w, bounds)
      res.update(A=float(A), B=float(B), C_mid=float(cm), sse=float(sse))
    out.append(res)
  return out


def prepare_window(C, y, r0, cutoff, value_range, grids, A_fixed=None):
  """The fit window of a curve: validated points with C > 0 (and >= `cutoff`), and grids whose A
  range fits the metric (A pinned to `A_fixed` when given)."""
  C, y = validate_curve(C, y, value_range=value_range, min_points=1, what="fit input")
  m = C > 0 if cutoff is None else (C > 0) & (C >= cutoff)
  C, y = C[m], y[m]
  validate_curve(C, y, value_range=value_range, min_points=MIN_POINTS, what="fit window")
  if r0 is None or not np.isfinite(r0):
    raise NoImprovementError(f"R0={r0} is not a finite number; pass the step-0 evaluation value")
  if grids is None:
    grids = default_grids(C, y, float(r0), value_range=value_range)
  if A_fixed is not None:
    grids = dataclasses.replace(grids, A=np.array([float(A_fixed)]))
  return C, y, grids


def fit_sigmoid(C, y, r0: float, *, cutoff: float | None = None, grids: Grids | None = None,
        refine: bool = True, A: float | None = None, value_range=(0.0, 1.0)) -> FitResult:
  """Fit Eq. 1 with R0 fixed, by the paper's grid procedure (vectorized) plus optional refinement.

    ``C``/``y``: compute (hours) and pass rates; points with ``C <= 0`` or ``C < cutoff`` are dropped.
    ``grids``: ``default_grids`` from the data when None (``paper_grids()`` for the paper's).
    ``A``: fix the asymptote (used by the shared-A comparison). ``refine``: continuous least-squares
    polish within two grid cells of the winner (otherwise the grid winner with its fitted B).
    """
  C, y, grids = prepare_window(C, y, r0, cutoff, value_range, grids, A_fixed=A)
  res = fit_sigmoid_many(C, y[None], float(r0), grids, refine=refine)[0]
  pred = sigmoid_curve(C, res["A"], res["B"], res["C_mid"], res["R0"])
  return FitResult(kind="sigmoid", A=res["A"], B=res["B"], C_mid=res["C_mid"], R0=res["R0"], D=None,
           sse=res["sse"], r2=r_squared(y, pred), n_points=len(C), c_range=(float(C[0]), float(C[-1])),
           grid_winner=res["grid_winner"])


def fit_sigmoid_free(C, y, r0: float, *, cutoff: float | None = None, grids: Grids | None = None,
           value_range=(0.0, 1.0)) -> FitResult:
  """Free 4-parameter fit (R0 also fitted), started from the R0-fixed grid fit."""
  start = fit_sigmoid(C, y, r0, cutoff=cutoff, grids=grids, value_range=value_range)
  C, y, grids = prepare_window(C, y, r0, cutoff, value_range, grids)
  lo, hi = value_range if value_range is not None else (-np.inf, np.inf)
  bounds = {"A": (lo, hi), "logC_mid": (np.log(grids.C_mid[0]), np.log(grids.C_mid[-1])), "B": B_RANGE,
       "R0": (lo, hi)}
  A, B, cm, R0, sse = _refine(C, y, None, start.R0, start.A, start.C_mid, start.B, bounds, fixed_names=())
  pred = sigmoid_curve(C, A, B, cm, R0)
  return FitResult(kind="sigmoid_free", A=float(A), B=float(B), C_mid=cm, R0=float(R0), D=None, sse=sse,
           r2=r_squared(y, pred), n_points=len(C), c_range=(float(C[0]), float(C[-1])))


def fit_power_law(C, y, *, cutoff: float | None = None, value_range=(0.0, 1.0),
         b_grid=None) -> FitResult:
  """Fit ``A - D / C^B`` (A bounded by the metric's range): linear least squares in (A, D) for
    each B on a log grid, then a continuous least-squares refinement of the winner."""
  C, y = validate_curve(C, y, value_range=value_range, min_points=1, what="fit input")
  m = C > 0 if cutoff is None else (C > 0) & (C >= cutoff)
  C, y = C[m], y[m]
  validate_curve(C, y, value_range=value_range, min_points=MIN_POINTS, what="fit window")
  hi = value_range[1] if value_range is not None else np.inf
  b_grid = np.geomspace(0.01, 5.0, 300) if b_grid is None else np.asarray(b_grid, float)
  X = C[None, :] ** (-b_grid[:, None])                       # (nb, n)
  xm, ym = X.mean(1), y.mean()
  cov = ((X - xm[:, None]) * (y - ym)).sum(1)
  var = ((X - xm[:, None]) ** 2).sum(1)
  D = -cov / var
  A = np.minimum(ym + D * xm, hi)
  D = np.where(A >= hi, ((A[:, None] - y) * X).sum(1) / (X * X).sum(1), D)
  sse = ((A[:, None] - D[:, None] * X - y) ** 2).sum(1)
  j = int(np.argmin(sse))
  x0 = np.array([A[j], b_grid[j], np.log(max(D[j], 1e-300))])

  def fun(x):
    return x[0] - np.exp(x[2] - x[1] * np.log(C)) - y

  res = optimize.least_squares(fun, x0, bounds=([-np.inf, 1e-4, -700], [hi, 20.0, 700]), x_scale="jac")
  Af, Bf, Df = float(res.x[0]), float(res.x[1]), float(np.exp(res.x[2]))
  pred = power_law_curve(C, Af, Bf, Df)
  return FitResult(kind="power_law", A=Af, B=Bf, C_mid=None, R0=None, D=Df,
           sse=float(np.sum((pred - y) ** 2)), r2=r_squared(y, pred), n_points=len(C),
           c_range=(float(C[0]), float(C[-1])))


def sse_surface(C, y, r0: float, grids: Grids) -> dict:
  """The paper's full table: for every (A, C_mid) pair the best B (log-grid + parabolic
    interpolation) and its SSE. Returns arrays ``B[nA, nC]`` and ``sse[nA, nC]`` (diagnostics)."""
  C = np.asarray(C, float)
  y = np.asarray(y, float)
  S1, S2 = _basis_sums(C, (y - r0)[None], None, grids.C_mid, grids.B)
  S1, S2 = S1[0], S2[0]
  Syy = float(np.sum((y - r0) ** 2))
  a = (grids.A - r0)[:, None, None]
  sse = Syy - 2 * a * S1[None] + a * a * S2[None]          # (nA, nC, nB)
  ib = sse.argmin(-1)
  jb = np.clip(ib, 1, len(grids.B) - 2)
  f = [np.take_along_axis(sse, (jb + d)[..., None], -1)[..., 0] for d in (-1, 0, 1)]
  den = f[0] - 2 * f[1] + f[2]
  with np.errstate(divide="ignore", invalid="ignore"):
    shift = np.clip(np.nan_to_num(np.where(den > 0, 0.5 * (f[0] - f[2]) / den, 0.0)), -1, 1)
  logb = np.log(grids.B)
  best = np.where(den > 0, f[1] - 0.25 * (f[0] - f[2]) * shift, f[1])
  return {"B": np.exp(logb[jb] + shift * (logb[1] - logb[0])), "sse": np.minimum(best, sse.min(-1)),
      "A": grids.A, "C_mid": grids.C_mid}
