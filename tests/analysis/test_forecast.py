"""analysis.forecast / analysis.posterior (issue #17): the noise model, the posterior, the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from scipy import linalg

from analysis.errors import ForecastInputError, TooFewPointsError
from analysis.forecast import forecast_runs, main
from analysis.metrics import append_metrics, read_run
from analysis.posterior import ar1_matrix, ar1_excess_ml, whiten, fit_posterior
from analysis.scaling import sigmoid_curve
from analysis.synthetic import write_synthetic_run

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "analysis" / "examples"
DEMO = REPO / "tests" / "data" / "demo_run"


def test_whiten_is_the_cholesky_solve_of_the_dense_covariance():
  rng = np.random.default_rng(0)
  n, d, s2, rho = 40, 2e-5, 3e-5, 0.8
  Sigma = d * np.eye(n) + s2 * ar1_matrix(n, rho)
  M = rng.normal(size=(5, n))
  W, logdet = whiten(M, [d], [s2], [rho])
  ref = linalg.solve_triangular(np.linalg.cholesky(Sigma), M.T, lower=True).T
  np.testing.assert_allclose(W[0], ref, rtol=1e-9, atol=1e-9)
  np.testing.assert_allclose(logdet[0], np.linalg.slogdet(Sigma)[1], rtol=1e-10)


def test_noise_ml_recovers_ar1_excess_over_binomial():
  rng = np.random.default_rng(1)
  n, d, s2, rho = 3000, 1.6e-5, 2.5e-5, 0.7
  x = np.empty(n)
  x[0] = rng.normal(0, np.sqrt(s2))
  for k in range(1, n):
    x[k] = rho * x[k - 1] + rng.normal(0, np.sqrt(s2 * (1 - rho ** 2)))
  e = x + rng.normal(0, np.sqrt(d), n)
  s2_hat, rho_hat, inflate = ar1_excess_ml(e, d)
  assert abs(rho_hat - rho) <= 0.1 and abs(s2_hat / s2 - 1) < 0.25
  assert inflate == pytest.approx(n / (n - 3))


def _brute_force_A_quantiles(C, y, r0, sigma, q):
  """Independent reference: a plain 3-D grid posterior (uniform A, log-uniform C_mid and B) around
    the mass, iid Gaussian noise of known sigma, R0 fixed; quantiles of A's marginal."""
  A = np.linspace(0.58, 0.64, 121)
  cm = np.geomspace(2000, 3300, 91)
  B = np.geomspace(1.5, 2.5, 81)
  pred = sigmoid_curve(C[None, None, None], A[:, None, None, None], B[None, None, :, None],
                       cm[None, :, None, None], r0)
  chi = (((pred - y) / sigma) ** 2).sum(-1)
  w = np.exp(-0.5 * (chi - chi.min())).sum((1, 2))
  cdf = np.cumsum(w) / w.sum()
  return np.interp(q, cdf, A)


def test_posterior_matches_a_brute_force_grid_with_known_noise():
  rng = np.random.default_rng(2)
  C = np.arange(100.0, 8001.0, 200.0)
  sigma = 0.004
  y = sigmoid_curve(C, 0.61, 1.92, 2542, 0.3) + rng.normal(0, sigma, len(C))
  post = fit_posterior(C, y, 0.3, noise={"d": sigma ** 2, "s2": 0.0, "rho": 0.0, "inflate": 1.0},
                       r0_noise=False, model_error=1.0, n_draws=40000)
  ref = _brute_force_A_quantiles(C, y, 0.3, sigma, [0.05, 0.5, 0.95])
  got = np.percentile(post.A, [5, 50, 95])
  np.testing.assert_allclose(got, ref, atol=0.0015)
  assert ref[2] - ref[0] > 0.005          # a real interval, not a point


def test_hours_to_target_inverts_eq1_per_draw():
  run = read_run(EXAMPLES / "scalerl")
  post = fit_posterior(*run.window(None, 8000), run.r0, n_samples=16000, n_draws=4000)
  h = post.hours_to(0.58)
  med = h["pred"]
  reach = sigmoid_curve(np.array([med]), post.A[:, None], post.B[:, None], post.C_mid[:, None], post.R0[:, None])[:, 0]
  assert np.mean(reach >= 0.58) == pytest.approx(0.5, abs=0.01)      # half the draws are there at the median
  assert h["lo"] < med < h["hi"] and h["p_unreachable"] == pytest.approx(np.mean(post.A <= 0.58))


def test_forecast_json_fields_and_comparison(tmp_path):
  recs = forecast_runs([EXAMPLES / "scalerl", EXAMPLES / "batch_512"], 16000, 0.6, tmp_path, until=8000,
                       n_samples=16000, n_draws=8000)
  data = json.loads((tmp_path / "forecast.json").read_text())
  assert (tmp_path / "forecast.png").stat().st_size > 10_000
  assert [d["run"] for d in data] == ["scalerl", "batch_512"]
  for d, run in zip(data, ("scalerl", "batch_512")):
    for key in ("run", "budget", "pred", "lo", "hi", "identifiable", "A", "B", "C_mid", "ci", "hours_to_target",
                "p_best"):
      assert key in d
    assert d["lo"] < d["pred"] < d["hi"] and d["identifiable"] is True
    truth = json.loads((EXAMPLES / run / "config.json").read_text())
    assert d["ci"]["A"][0] - 0.01 < truth["A"] < d["ci"]["A"][1] + 0.01
    full = read_run(EXAMPLES / run)
    assert d["lo"] - 0.02 < full.value[-5:].mean() < d["hi"] + 0.02
  assert sum(d["p_best"] for d in data) == pytest.approx(1.0)
  assert data[0]["comparison"]["mode"] == "shared_A" and data[0]["comparison"]["winner"] == "scalerl"
  assert recs[0]["hours_to_target"]["lo"] < recs[0]["hours_to_target"]["pred"]


def test_early_prefix_is_not_identifiable_and_wide(tmp_path):
  rec = forecast_runs([EXAMPLES / "scalerl"], 16000, 0.6, tmp_path, until=600, n_samples=16000, plot=False)[0]
  assert rec["identifiable"] is False and any("C_mid" in r for r in rec["reasons"])
  assert rec["hi"] - rec["lo"] > 0.15


def _tiny_run(path, n_evals):
  for k in range(n_evals):
    append_metrics(path, {"step": 10 * k, "compute_hours": float(k), "val_pass_rate": 0.2 + 0.05 * k})


@pytest.mark.parametrize("case", ["few_evals", "budget_below", "target_high", "target_below_r0"])
def test_cli_bad_input_is_one_clear_line(tmp_path, capsys, case):
  if case == "few_evals":
    _tiny_run(tmp_path / "run", 3)
    argv, needle = [str(tmp_path / "run"), "--budget", "10"], "at least"
  else:
    write_synthetic_run(tmp_path / "run", "scalerl", c_stop=4000, seed=3)
    budget = "3000" if case == "budget_below" else "8000"
    target = {"budget_below": None, "target_high": "1.2", "target_below_r0": "0.1"}[case]
    argv = [str(tmp_path / "run"), "--budget", budget] + (["--target", target] if target else [])
    needle = "below the last measured compute" if case == "budget_below" else "outside [R0, 1]"
  assert main(argv + ["--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_subprocess_prints_table(tmp_path):
  p = subprocess.run([sys.executable, "-m", "analysis.forecast", str(EXAMPLES / "scalerl"), "--budget", "16000",
                      "--until", "700", "--out", str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                     timeout=120)
  assert p.returncode == 0, p.stderr
  assert "NOT YET IDENTIFIABLE" in p.stdout and "Traceback" not in p.stderr
  assert json.loads((tmp_path / "forecast.json").read_text())[0]["identifiable"] is False


def test_errors_are_analysis_errors():
  with pytest.raises(TooFewPointsError):
    fit_posterior([1.0, 2.0, 3.0], [0.3, 0.4, 0.5], 0.2)
  run = read_run(EXAMPLES / "scalerl")
  from analysis.forecast import forecast_run
  with pytest.raises(ForecastInputError):
    forecast_run(run, 100.0)


@pytest.mark.skipif(not (DEMO / "metrics.jsonl").is_file(), reason="no committed demo run")
def test_forecast_of_the_demo_run_at_half_compute_contains_its_final_pass_rate(tmp_path):
  run = read_run(DEMO)
  half = float(run.compute[-1]) / 2
  rec = forecast_runs([DEMO], float(run.compute[-1]), None, tmp_path, until=half, plot=False)[0]
  assert rec["n_evals"] >= 4 and rec["last_compute"] <= half
  assert rec["lo"] <= float(run.value[-1]) <= rec["hi"], rec
