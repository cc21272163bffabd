"""Comparing runs by their Eq. 1 fits, with the paper's +-0.02 rule on A.

When all fitted A are within ``tol`` (0.02: three seeds of one recipe varied A by <= 0.015), the
runs are refitted with the common (averaged) A fixed and compared by B (higher B wins: it reaches
the shared ceiling with less compute). Otherwise the run with the highest A wins.
"""

from __future__ import annotations

import numpy as np

from analysis.metrics import RunData
from analysis.scaling import FitResult, fit_sigmoid

__all__ = ["compare_runs", "comparison_markdown", "A_TOLERANCE"]

A_TOLERANCE = 0.02


def compare_runs(runs: list[RunData], fits: list[FitResult] | None = None, *, tol: float = A_TOLERANCE,
         cutoff: float | None = None, fit_until: float | None = None, grids=None) -> dict:
  """Compare several runs. Returns ``mode`` ('shared_A' or 'A'), ``A_shared`` (or None),
    ``winner`` (run name), ``spread_A`` and ``rows`` (per run: run, A, B, C_mid, and in shared-A mode
    the refit ``B_shared``, ``C_mid_shared``, ``r2_shared``), sorted best first."""
  if len(runs) < 2:
    raise ValueError(f"compare_runs needs at least 2 runs, got {len(runs)}; pass several run directories")
  names = [r.name for r in runs]
  if len(set(names)) != len(names):
    raise ValueError(f"run names are not unique ({names}); give the run directories distinct names")
  if fits is None:
    fits = [fit_sigmoid(*r.window(cutoff, fit_until), r.r0, grids=grids) for r in runs]
  A = np.array([f.A for f in fits])
  spread = float(A.max() - A.min())
  rows = [{"run": r.name, "A": f.A, "B": f.B, "C_mid": f.C_mid, "R0": f.R0, "r2": f.r2}
      for r, f in zip(runs, fits)]
  if spread <= tol:
    A_shared = float(A.mean())
    shared = []
    for r, row in zip(runs, rows):
      sf = fit_sigmoid(*r.window(cutoff, fit_until), r.r0, grids=grids, A=A_shared)
      row.update(B_shared=sf.B, C_mid_shared=sf.C_mid, r2_shared=sf.r2)
      shared.append(sf)
    order = np.argsort([-row["B_shared"] for row in rows])
    mode, key = "shared_A", "B_shared"
  else:
    A_shared, shared = None, None
    order = np.argsort(-A)
    mode, key = "A", "A"
  rows = [rows[i] for i in order]
  return {"mode": mode, "A_shared": A_shared, "tol": tol, "spread_A": spread, "key": key,
      "winner": rows[0]["run"], "rows": rows,
      "shared_fits": None if shared is None else {runs[i].name: shared[i] for i in range(len(runs))}}


def comparison_markdown(cmp: dict) -> str:
  """The comparison as a markdown table with a one-line verdict."""
  lines = ["# Run comparison (Eq. 1 fits)", ""]
  if cmp["mode"] == "shared_A":
    lines.append(f"All A within {cmp['tol']:.3f} (spread {cmp['spread_A']:.4f}): refit with the shared "
           f"A = {cmp['A_shared']:.4f} fixed; **higher B wins: {cmp['winner']}**.")
    lines += ["", "| rank | run | A | B | C_mid | B (shared A) | C_mid (shared A) | R² (shared A) |",
         "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(cmp["rows"], 1):
      lines.append(f"| {i} | {r['run']} | {r['A']:.4f} | {r['B']:.3f} | {r['C_mid']:.4g} | "
             f"{r['B_shared']:.3f} | {r['C_mid_shared']:.4g} | {r['r2_shared']:.4f} |")
  else:
    lines.append(f"A differ by {cmp['spread_A']:.4f} > {cmp['tol']:.3f}: **higher A wins: {cmp['winner']}**.")
    lines += ["", "| rank | run | A | B | C_mid | R² |", "|---|---|---|---|---|---|"]
    for i, r in enumerate(cmp["rows"], 1):
      lines.append(f"| {i} | {r['run']} | {r['A']:.4f} | {r['B']:.3f} | {r['C_mid']:.4g} | {r['r2']:.4f} |")
  return "\n".join(lines) + "\n"
