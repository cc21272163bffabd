"""Figures: data + Eq. 1 fit + extrapolation band, and run comparisons.

Uses ``matplotlib.figure.Figure`` directly (rendered by the Agg canvas), so importing this module never
changes the global pyplot backend and works headless.
"""

from __future__ import annotations

import numpy as np

from analysis.metrics import AXIS_UNITS
from scalerl_jax import lazy, storage
from scalerl_jax.config import Forecast

# matplotlib costs ~0.6 CPU-s to import; the training process imports this module but plots once.
_agg = lazy.module("matplotlib.backends.backend_agg")
_mpl_figure = lazy.module("matplotlib.figure")


def _save(fig, path) -> None:
  """Saves `fig` to a local path or gs:// (through scalerl_jax.storage; format from the suffix)."""
  with storage.open(str(path), "wb") as f:
    fig.savefig(f, format=str(path).rsplit(".", 1)[-1] if "." in str(path) else "png")


def _figure(**kw):
  fig = _mpl_figure.Figure(**kw)
  _agg.FigureCanvasAgg(fig)
  return fig

__all__ = ["plot_curves", "plot_curve_panels", "plot_comparison", "plot_forecast", "plot_lag"]


def _label(name, fit):
  return f"{name}: A={fit.A:.3f}, B={fit.B:.2f}, C_mid={fit.C_mid:.4g}"


def plot_curves(entries: list[dict], path, *, title: str = "Eq. 1 fits") -> str:
  """One axis, one color per run. Each entry: ``run`` (RunData), ``fit`` (FitResult), optional
    ``prediction`` (extrapolate()['prediction']), ``cutoff``, ``fit_until``. Saves a PNG at ``path``."""
  fig = _figure(figsize=(8, 5.2), dpi=110)
  ax = fig.subplots()
  _draw_curves(ax, entries)
  ax.set_title(title + "  (filled: fit window; hollow: held out / cut; bands: 95% curve & prediction)",
         fontsize=9)
  fig.tight_layout()
  _save(fig, path)
  return str(path)


def plot_curve_panels(panels: list[tuple[str, list[dict]]], path, *,
                      title: str = "Eq. 1 fits per task") -> str:
  """Side by side, one panel per metric (e.g. overall, math, code, as the paper's math+code figure):
    ``panels`` = [(metric name, entries as for plot_curves), ...]. Saves a PNG at ``path``."""
  fig = _figure(figsize=(5.2 * len(panels), 4.8), dpi=110)
  axes = np.atleast_1d(fig.subplots(1, len(panels), squeeze=False)[0])
  for ax, (name, entries) in zip(axes, panels):
    _draw_curves(ax, entries)
    ax.set_title(name, fontsize=10)
  fig.suptitle(title + "  (filled: fit window; hollow: held out / cut; bands: 95% curve & "
               "prediction)", fontsize=9)
  fig.tight_layout()
  _save(fig, path)
  return str(path)


def _draw_curves(ax, entries: list[dict]) -> None:
  """Data, fit, extrapolation and bands of each entry on one axis (see plot_curves)."""
  for i, e in enumerate(entries):
    run, fit, color = e["run"], e["fit"], f"C{i % 10}"
    C, y = run.compute, run.value
    lo = max(C[C > 0].min() if (C > 0).any() else 1.0, 1e-9)
    used = (C > 0) & (C >= (e.get("cutoff") or 0)) & (C <= (e.get("fit_until") or np.inf))
    ax.scatter(C[used], y[used], s=9, color=color, alpha=0.75)
    if (~used & (C > 0)).any():
      ax.scatter(C[~used & (C > 0)], y[~used & (C > 0)], s=11, facecolors="none", edgecolors=color,
            alpha=0.8)
    grid = np.geomspace(lo, C.max() * 1.05, 300)
    split = e.get("fit_until") or np.inf
    ax.plot(grid[grid <= split], fit.predict(grid[grid <= split]), color=color, lw=2, label=_label(run.name, fit))
    if (grid > split).any():  # extrapolation
      ax.plot(grid[grid >= split], fit.predict(grid[grid >= split]), color=color, lw=2, ls="--")
    pred = e.get("prediction")
    if pred:
      pc = np.asarray(pred["compute"])
      band = np.asarray(pred["band"])
      pband = np.asarray(pred["pred_band"])
      ax.fill_between(pc, pband[:, 0], pband[:, 1], color=color, alpha=0.12, lw=0)
      ax.fill_between(pc, band[:, 0], band[:, 1], color=color, alpha=0.3, lw=0)
      ax.axvline(pred["fit_until"], color=color, ls=":", lw=1)
    ax.axhline(fit.A, color=color, ls="--", lw=0.8, alpha=0.6)
  ax.set_xscale("log")
  ax.set_xlabel("compute (accelerator-hours)")
  ax.set_ylabel("validation pass rate")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8, loc="lower right")


def plot_comparison(runs, fits, cmp: dict, path, ci: dict | None = None) -> str:
  """Left: data and curves (shared-A refits in shared-A mode); right: B (shared A) or A per run
    with bootstrap intervals when ``ci`` ({run: {param: [lo, hi]}}) is given. Saves a PNG."""
  fig = _figure(figsize=(12, 4.8), dpi=110)
  ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
  shared = cmp.get("shared_fits") or {}
  for i, (run, fit) in enumerate(zip(runs, fits)):
    color = f"C{i % 10}"
    f = shared.get(run.name, fit)
    m = run.compute > 0
    ax.scatter(run.compute[m], run.value[m], s=8, color=color, alpha=0.6)
    grid = np.geomspace(run.compute[m].min(), run.compute.max() * 1.05, 300)
    ax.plot(grid, f.predict(grid), color=color, lw=2, label=_label(run.name, f))
  ax.set_xscale("log")
  ax.set_xlabel("compute (accelerator-hours)")
  ax.set_ylabel("validation pass rate")
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=8, loc="lower right")
  ax.set_title(f"shared A = {cmp['A_shared']:.3f}" if cmp["mode"] == "shared_A" else "independent fits",
         fontsize=10)
  rows = cmp["rows"]
  key = cmp["key"]
  vals = [r[key] for r in rows]
  names = [r["run"] for r in rows]
  colors = [f"C{[x.name for x in runs].index(n) % 10}" for n in names]
  err = None
  if ci:
    p = "B" if key == "B_shared" else "A"
    lo = [max(0.0, v - ci[n][p][0]) for n, v in zip(names, vals)]
    hi = [max(0.0, ci[n][p][1] - v) for n, v in zip(names, vals)]
    err = np.array([lo, hi])
  bx.bar(range(len(vals)), vals, color=colors, yerr=err, capsize=4)
  bx.set_xticks(range(len(vals)), names, rotation=20, fontsize=8)
  bx.set_ylabel("B at shared A" if key == "B_shared" else "A")
  if key == "A":
    bx.set_ylim(min(vals) - 0.05, max(vals) + 0.03)
  bx.set_title(f"winner: {cmp['winner']}", fontsize=10)
  fig.tight_layout()
  _save(fig, path)
  return str(path)


def plot_forecast(runs, posts, recs, path, *, budget: float, target: float | None = None,
                  until: float | None = None, level: float = 0.9, axis: str = Forecast.axis) -> str:
  """Forecast figure: data (filled: used; hollow: after ``until``), posterior median curve and
    ``level`` band up to past the budget, the budget line and the target line; a run calibrated by
    reference runs (``rec["reference"]``) gets its calibrated value and band as a marker at the
    budget. ``axis``: "compute" (accelerator-hours) or "step". Saves a PNG."""
  fig = _figure(figsize=(8, 5.2), dpi=110)
  ax = fig.subplots()
  c_hi = budget
  for rec in recs:
    h = rec.get("hours_to_target")
    if h and h.get("hi") and h["hi"] < 5 * budget:
      c_hi = max(c_hi, h["hi"])
  for i, (run, post, rec) in enumerate(zip(runs, posts, recs)):
    color = f"C{i % 10}"
    C, y = run.compute, run.value
    used = (C > 0) & (C <= (until if until is not None else np.inf))
    ax.scatter(C[used], y[used], s=9, color=color, alpha=0.75)
    if (~used & (C > 0)).any():
      ax.scatter(C[~used & (C > 0)], y[~used & (C > 0)], s=11, facecolors="none", edgecolors=color, alpha=0.8)
    grid = np.geomspace(C[C > 0].min(), 1.15 * max(c_hi, C.max()), 200)
    b = post.band(grid, level)
    tag = "" if rec["identifiable"] else " (not yet identifiable)"
    ref = rec.get("reference")
    ax.plot(grid, b["pred"], color=color, lw=2,
            label=(f"{rec['run']}: Eq. 1 alone" if ref else
                   f"{rec['run']}: {rec['pred']:.3f} [{rec['lo']:.3f}, {rec['hi']:.3f}] at budget{tag}"))
    ax.fill_between(grid, b["lo"], b["hi"], color=color, alpha=0.2, lw=0)
    if ref:
      ax.errorbar([budget], [rec["pred"]], yerr=[[rec["pred"] - rec["lo"]], [rec["hi"] - rec["pred"]]],
                  fmt="D", color=color, capsize=4,
                  label=f"{rec['run']}: {rec['pred']:.3f} [{rec['lo']:.3f}, {rec['hi']:.3f}] calibrated by "
                        f"{ref['n']} reference runs{tag}")
  unit = AXIS_UNITS[axis]
  ax.axvline(budget, color="k", ls="--", lw=1, label=f"budget {budget:.4g} {unit}")
  if target is not None:
    ax.axhline(target, color="k", ls=":", lw=1, label=f"target {target:.3f}")
  ax.set_xscale("log")
  ax.set_xlabel("compute (accelerator-hours)" if axis == "compute" else "training step")
  ax.set_ylabel("validation pass rate")
  ax.set_title(f"Forecast: posterior median and {level:.0%} band (filled: evaluations used; hollow: later)",
               fontsize=9)
  ax.grid(alpha=0.3, which="both")
  ax.legend(fontsize=7, loc="lower right")
  fig.tight_layout()
  _save(fig, path)
  return str(path)


def plot_lag(s: dict, path) -> str:
  """The staleness figure of analysis.lag.lag_summary `s`: left, the lag histogram of every
    trained token; right, mean lag and k3 KL per step. Saves a PNG."""
  fig = _figure(figsize=(11, 4.2), dpi=110)
  ax, bx = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 3]})
  h = np.asarray(s["lag_hist"], np.float64)
  lags, frac = np.arange(len(h)), h / max(h.sum(), 1.0)
  ax.bar(lags, frac, color="C0")
  for i, f in zip(lags, frac):   # the fraction on each bar of >= 0.5 % (the docs tables' cut)
    if f >= 0.005:
      ax.text(i, f, f"{f:.2f}", ha="center", va="bottom", fontsize=8)
  ax.set_xticks(lags[::max(1, -(-len(h) // 16))])    # integer lags, at most 16 ticks
  ax.set_xlim(-0.6, max(len(h), 2) - 0.4)
  ax.set_ylim(0, 1.08)
  ax.set_xlabel("lag (learner step − token version)")
  ax.set_ylabel("fraction of trained tokens")
  ax.set_title(f"lag histogram (mean {s['mean_lag']:.2f}, max {s['max_lag']})", fontsize=10)
  bx.plot(s["steps"], s["mean_lag_per_step"], color="C0", label="mean lag")
  bx.set_xlabel("step")
  bx.set_ylabel("mean lag")
  cx = bx.twinx()
  cx.plot(s["steps"], s["kl_k3_per_step"], color="C3", lw=0.8, label="kl_k3")
  cx.set_yscale("log")
  cx.set_ylabel("kl_k3 (generator ‖ learner)", color="C3")
  bx.set_title(f"per step (max kl_k3 {s['max_kl_k3']:.3g})", fontsize=10)
  fig.tight_layout()
  _save(fig, path)
  return str(path)
