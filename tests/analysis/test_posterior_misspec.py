"""The forecast band's misspecification terms (issue #29; analysis/posterior.py, docs/ANALYSIS.md
"Misspecification"): the symmetric term's sd is kappa ln(C / C_last) beyond the last evaluation
and widens the band only there (its constants stay 0: the real runs did not call for it); the
upward drift allowance (MISSPEC_UP) raises the upper edge and covers a planted late drift that
Eq. 1's band misses; a not-yet-identifiable prefix's band reaches the ceiling; the run's
leave-future-out misfit sees a drift inside the data and not an Eq. 1 curve;
`analysis.calibrate --only real` reports every cut of the real runs in analysis/real_runs/."""
import dataclasses

import numpy as np
import pytest

from analysis import calibrate, real_runs
from analysis.metrics import append_metrics
from analysis.posterior import MISSPEC_GAIN, MISSPEC_PRIOR, MISSPEC_UP, fit_posterior, lfo_excess
from analysis.scaling import sigmoid_curve

C_MID, B, A, R0 = 2000.0, 2.0, 0.6, 0.3
C = np.arange(0.0, 16001.0, 200.0)


def _curve(drift: float, start: float = 4000.0):
  """Eq. 1, plus from `start` on a rise of `drift` per e-fold of compute past it (beyond A)."""
  y = sigmoid_curve(np.maximum(C, 1e-9), A, B, C_MID, R0)
  y[0] = R0
  return y + drift * np.log(np.maximum(C, start) / start)


def test_term_is_zero_up_to_the_last_evaluation_and_grows_with_ln_distance():
  y = _curve(0.0) + np.random.default_rng(0).normal(0.0, 0.004, len(C))
  m = (C > 0) & (C <= 8000)
  post = fit_posterior(C[m], y[m], R0, n_samples=16000)
  assert (MISSPEC_PRIOR, MISSPEC_GAIN) == (0.0, 0.0) and post.misspec["kappa"] == 0.0
  base = post.band([16000.0], up=0.0)
  np.testing.assert_allclose(base["lo"], post.band([16000.0], kappa=0.0, up=0.0)["lo"])
  post.misspec["kappa"] = 0.02
  sd = post.misspec_sd([4000.0, 8000.0, 8000.0 * np.e, 8000.0 * np.e ** 2])
  np.testing.assert_allclose(sd, [0, 0, 0.02, 0.04])
  wide = post.band([4000.0, 16000.0], up=0.0)
  np.testing.assert_allclose(wide["lo"][0], post.band([4000.0])["lo"][0])   # inside: unchanged
  np.testing.assert_allclose(wide["hi"][0], post.band([4000.0])["hi"][0])
  w0, w1 = base["hi"][0] - base["lo"][0], wide["hi"][1] - wide["lo"][1]
  # ~ sqrt(w0^2 + (2 * 1.645 * 0.02 ln 2)^2), up to the draws' randomness
  assert abs(w1 - np.hypot(w0, 2 * 1.645 * 0.02 * np.log(2))) < 0.004, (w0, w1)


def test_lfo_excess_sees_a_drift_inside_the_data_and_not_eq1():
  rng = np.random.default_rng(1)
  m = C > 0
  noise = rng.normal(0.0, 0.003, len(C))
  flat = lfo_excess(C[m], (_curve(0.0) + noise)[m], R0, n_samples=16000)
  drift = lfo_excess(C[m], (_curve(0.06, start=6000.0) + noise)[m], R0, n_samples=16000)
  assert flat["lfo_prefix"] == 40 and flat["lfo_future"] == 40
  assert flat["kappa_run"] < 0.004, flat
  assert drift["kappa_run"] > 0.01 and drift["lfo_mean_err"] > 0, drift


def test_real_study_reports_every_cut_of_every_run(tmp_path):
  names = ["scalerl_s0", "scalerl_s1"]                 # one calibration run, one held out
  assert names[0] in real_runs.CALIBRATION and names[1] not in real_runs.CALIBRATION
  for i, name in enumerate(names):
    y = _curve(0.0) + np.random.default_rng(i).normal(0.0, 0.004, len(C))
    for k in range(0, len(C), 2):
      append_metrics(tmp_path / name, {"step": k, "compute_hours": float(C[k]),
                                       "val_pass_rate": float(np.clip(y[k] if k else R0, 0, 1)),
                                       "val_samples": 16000})
  res = calibrate.real_study(tmp_path, priors=(0.0, 0.01), gains=(0.0, 1.0))
  assert res["runs"] == names and res["calibration_runs"] == names[:1] and not res["skipped_cuts"]
  assert len(res["grid"]) == 4 and res["fitted"]["prior"] in (0.0, 0.01)
  for split in ("calibration", "held_out"):
    for table in ("with_term", "without_term"):
      assert sorted(res[split][table]) == ["0.25", "0.5", "0.75"] and all(
          v["n"] == 1 for v in res[split][table].values()), res[split]
  # the held-out run is calibrated against the calibration half (here: scalerl_s0 alone); the
  # calibration run has no reference left (itself excluded)
  ref = res["held_out"]["reference"]
  assert sorted(ref) == ["0.25", "0.5", "0.75"] and all(v["median_references"] == 1 for v in ref.values())
  assert res["calibration"]["reference"] == {} and "held_out_2026_12_05" not in res
  md = calibrate.markdown_real(res)
  assert md.count("| held-out |") == 3 and md.count("| calibration |") == 3
  assert md.count("| - | - | - | - |") == 3      # no reference row for the calibration run


def test_a_prefix_before_the_bend_gets_the_ceiling_as_its_upper_edge():
  """Before C_mid is bracketed (not yet identifiable) A is not pinned down: beyond the last
  evaluation the band reaches the metric's ceiling (the run's final value can be anything up to
  it; on the real runs the 25 % cuts' old bands missed finals of 0.90 by 0.1). Up to the last
  evaluation, and for an identifiable prefix, the band is Eq. 1's as before, within [0, 1]."""
  y = _curve(0.0) + np.random.default_rng(3).normal(0.0, 0.004, len(C))
  early = (C > 0) & (C <= 1000)
  post = fit_posterior(C[early], y[early], R0, n_samples=16000)
  assert not post.identifiability()["identifiable"]
  b = post.band([800.0, 16000.0])
  assert b["hi"][1] == 1.0 and b["hi"][0] < 0.5 and b["lo"][1] < b["pred"][1] < 1.0
  late = (C > 0) & (C <= 8000)
  post = fit_posterior(C[late], y[late], R0, n_samples=16000)
  assert post.identifiability()["identifiable"]
  b = post.band([16000.0], measurement=True)
  assert b["hi"][0] < 0.7 and 0.0 <= b["lo"][0] <= b["pred"][0] <= b["hi"][0] <= 1.0


def test_late_upward_drift_beyond_the_asymptote_is_covered_where_the_old_band_missed():
  """Eq. 1 (A = 0.6) that keeps rising by 0.04 per e-fold of compute from C = 4000 on (past its
  bend at C_mid = 2000): forecast from the first half (C <= 8000), at the budget 16000 the
  noise-free value is 0.651, beyond A. Eq. 1's band (no misspecification term) misses it for
  every noise seed; the band with the upward drift allowance (MISSPEC_UP) covers it; its lower
  edge and median are Eq. 1's."""
  assert MISSPEC_UP == 0.009
  true = _curve(0.04, start=4000.0)
  m = (C > 0) & (C <= 8000)
  for seed in range(3):
    y = true + np.random.default_rng(seed).normal(0.0, 0.004, len(C))
    post = fit_posterior(C[m], y[m], R0, n_samples=16000)
    assert post.identifiability()["identifiable"] and post.misspec["up"] == MISSPEC_UP
    old = post.band([16000.0], kappa=0.0, up=0.0)
    new = post.band([16000.0])
    assert old["hi"][0] < true[-1] <= new["hi"][0], (seed, old, new, true[-1])
    np.testing.assert_allclose([new["lo"][0], new["pred"][0]], [old["lo"][0], old["pred"][0]])
    assert new["hi"][0] - old["hi"][0] == pytest.approx(1.6449 * 0.009 * np.log(2), abs=1e-4)


def test_a_kl_alarm_inside_the_data_makes_the_forecast_not_identifiable():
  """2026-12-05, commit 2696fc8, 2-core Intel Xeon: a real run (xeon_scalerl_s14, analysis/real_runs/) stalled and dipped in an unstable
  phase (KL(generator || learner) alarms at steps 102 and 122; 0.734 at step 90, 0.628 at 110) and
  climbed to 0.897 after. Forecast from its first half, Eq. 1 reads the stall as the asymptote: the
  band misses the final value. With the run's alarms (`health/kl_alarm` lines, RunData.alarms) the
  forecast is not identifiable, says why, and its upper edge is the ceiling."""
  from analysis.forecast import eval_samples, forecast_run
  from analysis.metrics import read_run
  d = real_runs.OUT + "/xeon_scalerl_s14"
  run = read_run(d)
  assert len(run.alarms) == 2 and np.all(np.diff(run.alarms) > 0)
  budget, final = float(run.compute[-1]), float(run.value[-1])
  rec, post = forecast_run(run, budget, until=budget / 2, n_samples=eval_samples(d), n_draws=8000)
  assert post.misspec["unstable_at"] == sorted(run.alarms[run.alarms <= budget / 2].tolist())
  assert not rec["identifiable"] and rec["verdict"] == "not yet identifiable"
  assert "KL(generator || learner) alarm" in rec["reasons"][0]
  assert rec["hi"] == rec["pred_hi"] == 1.0 and rec["pred_lo"] <= final
  assert rec["pred"] < final - 0.15                    # the median is Eq. 1's: still low
  quiet = dataclasses.replace(run, alarms=np.zeros(0))
  rec0, _ = forecast_run(quiet, budget, until=budget / 2, n_samples=eval_samples(d), n_draws=8000)
  assert rec0["identifiable"] and rec0["pred_hi"] < final - 0.05   # the band as before: a miss


def test_real_run_curves_keep_the_kl_alarm_lines(tmp_path):
  from analysis.metrics import KL_ALARM, append_metrics as append, read_run
  p = tmp_path / "metrics.jsonl"
  append(tmp_path, {"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.2, "val_samples": 64})
  append(tmp_path, {"step": 5, "compute_hours": 0.01, "loss": 1.0, KL_ALARM: 0, "kl_k3": 0.01})
  append(tmp_path, {"step": 6, "compute_hours": 0.012, "loss": 1.0, KL_ALARM: 1, "kl_k3": 0.3})
  append(tmp_path, {"step": 10, "compute_hours": 0.02, "val_pass_rate": 0.4, "val_samples": 64})
  lines = real_runs.eval_lines(str(p))
  assert lines == [{"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.2, "val_samples": 64},
                   {"step": 6, "compute_hours": 0.012, KL_ALARM: 1},
                   {"step": 10, "compute_hours": 0.02, "val_pass_rate": 0.4, "val_samples": 64}]
  np.testing.assert_allclose(read_run(tmp_path).alarms, [0.012])


def test_the_step_axis_replaces_compute_and_moves_the_alarms_to_their_steps():
  """`analysis.metrics.on_axis` (the diagnosis of the compute axis, 2026-12-05, commit 7b92b4a, 2-core Intel Xeon): "step" forecasts on
  the evaluations' steps, a KL alarm at compute between two evaluations lands between their steps;
  "compute" is the run as read; any other axis is refused with the choices."""
  from analysis.errors import ForecastInputError
  from analysis.metrics import RunData, on_axis
  run = RunData(name="r", compute=np.array([0.0, 0.5, 0.6, 2.0]), value=np.array([0.2, 0.4, 0.5, 0.6]),
                step=np.array([0, 10, 20, 30]), r0=0.2, alarms=np.array([0.55, 1.3]))
  on = on_axis(run, "step")
  assert on.compute.tolist() == [0.0, 10.0, 20.0, 30.0] and on.value is run.value
  np.testing.assert_allclose(on.alarms, [15.0, 25.0])
  assert on_axis(run, "compute") is run
  with pytest.raises(ForecastInputError, match="expected one of"):
    on_axis(run, "tokens")
