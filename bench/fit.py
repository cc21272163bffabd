"""Benchmark the vectorized Eq. 1 grid fit against a naive loop of scipy ``curve_fit`` calls.

``python -m bench.fit`` - same data (150 points, Table-1 ScaleRL row + noise 0.01) and the same
grid (the paper's: 71 A x 100 C_mid, B fitted per pair). Prints details, writes ``bench/out/fit.json``
and ``bench/out/fit.png``; the last stdout line is one JSON object (``ratio`` > 1: ours is faster).
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

import numpy as np
from scipy import optimize

from analysis.metrics import RunData
from analysis.plots import plot_curves
from analysis.scaling import fit_sigmoid, paper_grids, sigmoid_curve
from analysis.synthetic import TABLE1
from analysis.uncertainty import bootstrap


def naive_grid_fit(C, y, r0, grids):
  """The paper's appendix literally: for each (A, C_mid) pair, curve_fit B; least SSE wins."""
  best = (np.inf, None)
  for a in grids.A:
    for c in grids.C_mid:
      try:
        with warnings.catch_warnings():
          warnings.simplefilter("ignore")
          (b,), _ = optimize.curve_fit(lambda x, b: sigmoid_curve(x, a, b, c, r0), C, y, p0=[1.0])
      except (RuntimeError, ValueError):
        continue
      sse = float(np.sum((sigmoid_curve(C, a, b, c, r0) - y) ** 2))
      if sse < best[0]:
        best = (sse, (float(a), float(c), float(b)))
  return best


def main(argv=None) -> dict:
  """Run the benchmark; returns the result dict (also printed as the last stdout line)."""
  ap = argparse.ArgumentParser(prog="python -m bench.fit", description=__doc__.splitlines()[0])
  ap.add_argument("--points", type=int, default=150)
  ap.add_argument("--repeats", type=int, default=5, help="timed repeats of our fit (median reported)")
  ap.add_argument("--n-boot", type=int, default=1000)
  ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
  args = ap.parse_args(argv)
  cm, B, A = TABLE1["scalerl"]
  r0 = 0.3
  C = np.linspace(1500, 16000, args.points)
  y = sigmoid_curve(C, A, B, cm, r0) + np.random.default_rng(0).normal(0, 0.01, C.size)
  grids = paper_grids()

  t = time.perf_counter()
  sse_naive, (a_n, c_n, b_n) = naive_grid_fit(C, y, r0, grids)
  peer = time.perf_counter() - t
  print(f"naive curve_fit loop ({len(grids.A)}x{len(grids.C_mid)} pairs): {peer:.3f} s -> "
     f"A={a_n:.3f} C_mid={c_n:.1f} B={b_n:.4f} SSE={sse_naive:.6g}")

  fit_sigmoid(C, y, r0, grids=grids, refine=False)  # warm-up
  times, times_ref = [], []
  for _ in range(args.repeats):
    t = time.perf_counter()
    ours = fit_sigmoid(C, y, r0, grids=grids, refine=False)
    times.append(time.perf_counter() - t)
    t = time.perf_counter()
    refined = fit_sigmoid(C, y, r0, grids=grids)
    times_ref.append(time.perf_counter() - t)
  t_ours, t_ref = float(np.median(times)), float(np.median(times_ref))
  print(f"ours, same grid (median of {args.repeats}): {t_ours:.4f} s -> A={ours.A:.3f} C_mid={ours.C_mid:.1f} "
     f"B={ours.B:.4f} SSE={ours.sse:.6g}; with refinement {t_ref:.4f} s -> A={refined.A:.4f} "
     f"C_mid={refined.C_mid:.1f} B={refined.B:.4f} SSE={refined.sse:.6g}")
  same = bool(np.isclose(ours.A, a_n) and np.isclose(ours.C_mid, c_n))

  t = time.perf_counter()
  boot = bootstrap(C, y, r0, n_boot=args.n_boot, grids=grids, seed=0)
  t_boot = time.perf_counter() - t
  t = time.perf_counter()
  bootstrap(C, y, r0, n_boot=args.n_boot, seed=0)   # timed only: the data-derived grid
  t_boot_auto = time.perf_counter() - t
  print(f"bootstrap x{args.n_boot}: {t_boot:.2f} s (paper grid), {t_boot_auto:.2f} s (data grid); "
     f"95% CI {boot['ci']}")

  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  run = RunData(name="synthetic ScaleRL", compute=C, value=y, step=np.arange(C.size), r0=r0)
  plot_curves([{"run": run, "fit": refined}], out / "fit.png", title="bench: Eq. 1 fit, 150 points")
  result = {"ours": t_ours, "peer": peer, "unit": "s per full-grid fit", "ratio": peer / t_ours,
       "bootstrap_1000_s": t_boot, "bootstrap_1000_data_grid_s": t_boot_auto, "n_boot": args.n_boot,
       "ours_refined_s": t_ref, "points": int(C.size), "grid": [len(grids.A), len(grids.C_mid)],
       "same_winner": same, "B_naive": b_n, "B_ours": ours.B, "sse_naive": sse_naive, "sse_ours": ours.sse,
       "refined": {"A": refined.A, "B": refined.B, "C_mid": refined.C_mid, "r2": refined.r2},
       "truth": {"A": A, "B": B, "C_mid": cm}, "ci": boot["ci"], "png": str(out / "fit.png")}
  (out / "fit.json").write_text(json.dumps(result, indent=2) + "\n")
  print(json.dumps(result))
  return result


if __name__ == "__main__":
  main()
