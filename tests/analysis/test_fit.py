"""Eq. 1 fitting: Table-1 parameter recovery, brute-force references, power law, extrapolation,
bootstrap, shared-A comparison and invalid inputs."""

import numpy as np
import pytest
from scipy import optimize

from analysis.compare import compare_runs, comparison_markdown
from analysis.errors import (AnalysisError, NoImprovementError, NonFiniteError, NonIncreasingComputeError,
               PassRateRangeError, TooFewPointsError)
from analysis.metrics import RunData
from analysis.scaling import (Grids, default_grids, fit_power_law, fit_sigmoid, fit_sigmoid_free,
               fit_sigmoid_many, paper_grids, sigmoid_curve, sse_surface)
from analysis.synthetic import TABLE1, synthetic_curve
from analysis.uncertainty import bootstrap, extrapolate

R0 = 0.3
SEEDS = 20
ROWS = list(TABLE1)


def _seeds(name, c_stop=None):
  cm, B, A = TABLE1[name]
  curves = [synthetic_curve(A, B, cm, R0, seed=s) for s in range(SEEDS)]
  C = curves[0][0]
  return C, np.stack([c[1] for c in curves]), np.stack([c[2] for c in curves])


@pytest.mark.parametrize("name", ROWS)
def test_table1_parameter_recovery(name):
  cm, B, A = TABLE1[name]
  C, Y, _ = _seeds(name)
  grids = default_grids(C, Y.max(0), R0)
  fits = fit_sigmoid_many(C, Y, R0, grids)                 # the 20 seeds share compute points
  single = fit_sigmoid(C, Y[0], R0)                        # the public one-curve path agrees
  assert single.A == pytest.approx(fits[0]["A"], abs=2e-3)
  assert single.B == pytest.approx(fits[0]["B"], rel=2e-2)
  eA = np.array([f["A"] - A for f in fits])
  eB = np.array([f["B"] / B - 1 for f in fits])
  eC = np.array([f["C_mid"] / cm - 1 for f in fits])
  ok = (np.abs(eA) <= 0.015) & (np.abs(eB) <= 0.15) & (np.abs(eC) <= 0.20)
  print(f"{name}: ok {ok.sum()}/{SEEDS} max|dA| {np.abs(eA).max():.4f} max|dB/B| {np.abs(eB).max():.3f} "
     f"max|dC/C| {np.abs(eC).max():.3f}")
  assert ok.mean() >= 0.9


def _brute_force(C, y, r0):
  """Independent reference: multi-start scipy least_squares over (A, log C_mid, B), R0 fixed."""
  best = None
  for A0 in (0.5, 0.65, 0.9):
    for cm0 in (500.0, 3000.0, 15000.0):
      for B0 in (0.7, 2.0, 4.0):
        r = optimize.least_squares(
          lambda x: r0 + (x[0] - r0) / (1 + np.exp(x[2] * (x[1] - np.log(C)))) - y,
          [A0, np.log(cm0), B0], bounds=([r0 + 1e-3, np.log(10), 0.05], [1.0, np.log(1e6), 20]))
        if best is None or r.cost < best.cost:
          best = r
  return best.x[0], best.x[2], float(np.exp(best.x[1])), 2 * best.cost


@pytest.mark.parametrize("name", ["scalerl", "scalerl_32k_gen", "scout", "mathcode_code"])
def test_matches_brute_force_least_squares(name):
  cm, B, A = TABLE1[name]
  C, y, _ = synthetic_curve(A, B, cm, R0, seed=3)
  f = fit_sigmoid(C, y, R0)
  A_ref, B_ref, cm_ref, sse_ref = _brute_force(C, y, R0)
  assert f.sse <= sse_ref * (1 + 1e-6)
  assert f.A == pytest.approx(A_ref, abs=1e-3)
  assert f.B == pytest.approx(B_ref, rel=1e-2)
  assert f.C_mid == pytest.approx(cm_ref, rel=1e-2)
  grid = np.geomspace(C[0], C[-1], 200)
  assert np.max(np.abs(f.predict(grid) - sigmoid_curve(grid, A_ref, B_ref, cm_ref, R0))) < 1e-3


def test_grid_winner_matches_naive_curve_fit_loop():
  """The vectorized grid procedure picks the same (A, C_mid) as a loop of curve_fit calls on B."""
  cm, B, A = TABLE1["scalerl"]
  C, y, _ = synthetic_curve(A, B, cm, R0, seed=1)
  grids = Grids(A=np.round(np.arange(0.58, 0.6401, 0.005), 6), C_mid=np.linspace(1500, 4000, 26),
         B=np.geomspace(0.05, 20, 200))
  best = (np.inf, None)
  for a in grids.A:
    for c in grids.C_mid:
      (b,), _ = optimize.curve_fit(lambda x, b: sigmoid_curve(x, a, b, c, R0), C, y, p0=[1.5],
                     bounds=(0.05, 20))
      sse = np.sum((sigmoid_curve(C, a, b, c, R0) - y) ** 2)
      best = min(best, (sse, (a, c, b)), key=lambda t: t[0])
  f = fit_sigmoid(C, y, R0, grids=grids, refine=False)
  a, c, b = best[1]
  assert (f.A, f.C_mid) == (pytest.approx(a), pytest.approx(c))
  assert f.B == pytest.approx(b, rel=1e-4)
  assert f.sse == pytest.approx(best[0], rel=1e-6)
  surf = sse_surface(C, y, R0, grids)                      # per-pair B for the whole grid
  ia, ic = np.unravel_index(np.argmin(surf["sse"]), surf["sse"].shape)
  assert (grids.A[ia], grids.C_mid[ic]) == (pytest.approx(a), pytest.approx(c))
  for i, j in [(0, 0), (5, 10), (12, 25)]:
    (bij,), _ = optimize.curve_fit(lambda x, b: sigmoid_curve(x, grids.A[i], b, grids.C_mid[j], R0), C, y,
                    p0=[1.5], bounds=(0.05, 20))
    assert surf["B"][i, j] == pytest.approx(bij, rel=2e-3)


def test_paper_grid_with_refinement_recovers_small_cmid():
  """The paper's C_mid grid step (~403 h) is coarse for C_mid = 1675; the refinement fixes it."""
  cm, B, A = TABLE1["mathcode_code"]
  C, y, _ = synthetic_curve(A, B, cm, R0, seed=0)
  coarse = fit_sigmoid(C, y, R0, grids=paper_grids(), refine=False)
  fine = fit_sigmoid(C, y, R0, grids=paper_grids())
  assert fine.sse <= coarse.sse
  assert abs(fine.C_mid / cm - 1) < 0.2 and abs(fine.A - A) < 0.015


@pytest.mark.parametrize("name", ROWS)
def test_powerlaw_overestimates_ceiling(name):
  cm, B, A = TABLE1[name]
  C, Y, _ = _seeds(name)
  over = np.array([fit_power_law(C, y).A - A for y in Y[:5]])
  sig = fit_sigmoid(C, Y[0], R0)
  print(f"{name}: power-law A - true A: min {over.min():.3f} mean {over.mean():.3f}")
  assert np.all(over > 0.01) and over.min() > abs(sig.A - A)


@pytest.mark.parametrize("name", ROWS)
def test_extrapolation_from_half_budget(name):
  cm, B, A = TABLE1[name]
  C, Y, T = _seeds(name)
  m = C <= C[-1] / 2
  grids = default_grids(C[m], Y[:, m].max(0), R0)
  fits = fit_sigmoid_many(C[m], Y[:, m], R0, grids)
  pred = np.array([sigmoid_curve(C[-1], f["A"], f["B"], f["C_mid"], R0) for f in fits])
  err_true = np.abs(pred - T[:, -1])                      # vs the noiseless final pass rate
  err_meas = np.abs(pred - Y[:, -1])                      # vs the measured (noisy) final point
  print(f"{name}: ok {np.sum(err_true < 0.02)}/{SEEDS} |pred-true| median {np.median(err_true):.4f} "
     f"max {err_true.max():.4f}; "
     f"|pred-measured| median {np.median(err_meas):.4f}")
  assert np.mean(err_true < 0.02) >= 0.9 and np.median(err_true) < 0.01


def test_extrapolate_api_band_and_errors():
  cm, B, A = TABLE1["scalerl"]
  C, y, truth = synthetic_curve(A, B, cm, R0, seed=0)
  ex = extrapolate(C, y, R0, fit_until=8000, n_boot=150, seed=0)
  p = ex["prediction"]
  assert p["final_compute"] == C[-1] and p["final_true"] == y[-1]
  assert p["abs_error"] == pytest.approx(abs(p["final_pred"] - y[-1]))
  assert abs(p["final_pred"] - truth[-1]) < 0.02
  lo, hi = p["final_pred_band"]
  assert lo < truth[-1] < hi and lo < p["final_pred"] < hi
  assert p["final_band"][1] - p["final_band"][0] < hi - lo
  assert len(p["compute"]) == np.sum(C > 8000) == len(p["error"])
  with pytest.raises(TooFewPointsError, match="beyond the last evaluation"):
    extrapolate(C, y, R0, fit_until=C[-1])


def test_bootstrap_ci_covers_truth_and_is_fast():
  cm, B, A = TABLE1["scalerl"]
  C, y, _ = synthetic_curve(A, B, cm, R0, seed=2, c_stop=16000, c_step=100)
  boot = bootstrap(C, y, R0, n_boot=300, seed=0)
  ci = boot["ci"]
  assert ci["A"][0] < A < ci["A"][1] and ci["B"][0] < B < ci["B"][1] and ci["C_mid"][0] < cm < ci["C_mid"][1]
  assert 0.001 < ci["A"][1] - ci["A"][0] < 0.03
  assert boot["samples"].shape == (300, 3)
  res = bootstrap(C, y, R0, n_boot=100, method="residual", seed=0)
  assert res["ci"]["A"][0] < A < res["ci"]["A"][1]


def test_free_four_parameter_fit():
  cm, B, A = TABLE1["scalerl"]
  C, y, _ = synthetic_curve(A, B, cm, 0.3, seed=0, c_start=100)
  f = fit_sigmoid_free(C, y, r0=0.25)                      # wrong R0 start; R0 is fitted
  assert f.kind == "sigmoid_free" and f.R0 == pytest.approx(0.3, abs=0.01)
  assert f.A == pytest.approx(A, abs=0.01) and f.B == pytest.approx(B, rel=0.1)


def _run(name, seed):
  cm, B, A = TABLE1[name]
  C, y, _ = synthetic_curve(A, B, cm, R0, seed=seed)
  return RunData(name=name, compute=C, value=y, step=np.arange(len(C)), r0=R0)


def test_compare_shared_A_larger_B_wins():
  runs = [_run("batch_512", 1), _run("scalerl", 2)]      # A 0.605 vs 0.610, B 1.77 vs 1.92
  cmp = compare_runs(runs)
  assert cmp["mode"] == "shared_A" and cmp["spread_A"] <= 0.02
  assert cmp["A_shared"] == pytest.approx(np.mean([r["A"] for r in cmp["rows"]]))
  assert cmp["winner"] == "scalerl"
  rows = {r["run"]: r for r in cmp["rows"]}
  assert rows["scalerl"]["B_shared"] > rows["batch_512"]["B_shared"]
  assert cmp["shared_fits"]["scalerl"].A == pytest.approx(cmp["A_shared"])
  assert "higher B wins: scalerl" in comparison_markdown(cmp)


def test_compare_different_A_higher_A_wins():
  cmp = compare_runs([_run("scalerl", 0), _run("batch_2048", 0)])  # 0.610 vs 0.645
  assert cmp["mode"] == "A" and cmp["winner"] == "batch_2048" and cmp["spread_A"] > 0.02
  assert "higher A wins: batch_2048" in comparison_markdown(cmp)


@pytest.mark.parametrize("C, y, r0, err, words", [
  (np.arange(1, 4) * 1000.0, [0.4, 0.5, 0.55], 0.3, TooFewPointsError, "need at least 5"),
  (np.arange(1, 7) * 1000.0, [0.4, 0.5, np.nan, 0.55, 0.56, 0.57], 0.3, NonFiniteError, "NaN/inf"),
  ([1e3, 2e3, 2e3, 3e3, 4e3, 5e3], [0.4, 0.5, 0.52, 0.55, 0.56, 0.57], 0.3, NonIncreasingComputeError,
   "strictly increasing"),
  (np.arange(1, 7) * 1000.0, [40, 50, 52, 55, 56, 57], 0.3, PassRateRangeError, "divide percentages by 100"),
  (np.arange(1, 7) * 1000.0, [0.2, 0.21, 0.2, 0.22, 0.2, 0.21], 0.3, NoImprovementError, "never exceeds R0"),
])
def test_invalid_inputs_one_line_errors(C, y, r0, err, words):
  with pytest.raises(err) as exc:
    fit_sigmoid(C, y, r0)
  msg = str(exc.value)
  assert words in msg and "\n" not in msg and isinstance(exc.value, (AnalysisError, ValueError))


def test_cutoff_leaving_too_few_points():
  C, y, _ = synthetic_curve(0.61, 1.92, 2542, R0, seed=0)
  with pytest.raises(TooFewPointsError, match="fit window: 2 evaluation points"):
    fit_sigmoid(C, y, R0, cutoff=C[-2])


@pytest.mark.parametrize("A, B, cm, r0, scale", [(0.2, 1.5, 3000, 0.05, 1e-3),     # low pass rates, tiny run
                         (0.95, 1.2, 2000, 0.6, 1.0),      # near the top of [0, 1]
                         (0.61, 1.92, 2542, 0.3, 100.0)])  # 100x larger compute
def test_default_grids_adapt_to_metric_range_and_compute_scale(A, B, cm, r0, scale):
  C, y, _ = synthetic_curve(A, B, cm, r0, seed=0, sigma=0.005)
  g = default_grids(C * scale, y, r0)
  assert g.A[0] < A <= g.A[-1] <= 1.0 and g.C_mid[0] < cm * scale < g.C_mid[-1]
  f = fit_sigmoid(C * scale, y, r0)
  assert f.A == pytest.approx(A, abs=0.015) and f.B == pytest.approx(B, rel=0.15)
  assert f.C_mid == pytest.approx(cm * scale, rel=0.2)
