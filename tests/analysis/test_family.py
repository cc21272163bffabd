"""analysis.family / the family prior in analysis.posterior / analysis.allocate (issue #48)."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from analysis import allocate
from analysis.errors import ForecastInputError
from analysis.family import (FLOORS, MemberFit, NotIdentifiableError, check_family, family_prior, member_fit,
                             robust_normal, setup_of)
from analysis.forecast import forecast_run, main as forecast_main
from analysis.metrics import RunData
from analysis.posterior import fit_posterior
from analysis.scaling import sigmoid_curve

REPO = Path(__file__).resolve().parents[2]
REAL = REPO / "analysis" / "real_runs"


def _brute_force(C, y, r0, sigma, prior):
  """Independent reference: a plain 3-D grid posterior (A, C_mid, B) with the family's Gaussians on
    A, log C_mid and log B (grids uniform in A and in the logs), iid noise of known sigma, R0 fixed:
    quantiles of A and the median of B."""
  A = np.linspace(0.45, 0.85, 321)
  lc = np.linspace(prior["log_cmid"][0] - 0.8, prior["log_cmid"][0] + 0.8, 97)
  lb = np.linspace(prior["log_b"][0] - 0.6, prior["log_b"][0] + 0.6, 73)
  logp = (-0.5 * ((lc[:, None] - prior["log_cmid"][0]) / prior["log_cmid"][1]) ** 2
          - 0.5 * ((lb[None, :] - prior["log_b"][0]) / prior["log_b"][1]) ** 2)
  w = np.empty((len(A), len(lc), len(lb)))
  for i, a in enumerate(A):
    pred = sigmoid_curve(C[None, None], a, np.exp(lb)[None, :, None], np.exp(lc)[:, None, None], r0)
    chi = (((pred - y) / sigma) ** 2).sum(-1)
    w[i] = -0.5 * chi + logp - 0.5 * ((a - prior["A"][0]) / prior["A"][1]) ** 2
  w = np.exp(w - w.max())
  cdf = np.cumsum(w.sum((1, 2)))
  cdf /= cdf[-1]
  cdf_b = np.cumsum(w.sum((0, 1)))
  cdf_b /= cdf_b[-1]
  return np.interp([0.05, 0.5, 0.95], cdf, A), float(np.exp(np.interp(0.5, cdf_b, lb)))


def test_family_prior_posterior_matches_a_brute_force_grid():
  """A prefix before the bend: the family's Gaussians carry the shape; fit_posterior with them
    against the 3-D grid with the same priors."""
  rng = np.random.default_rng(3)
  C = np.arange(100.0, 1601.0, 100.0)
  sigma = 0.004
  y = sigmoid_curve(C, 0.61, 1.92, 2542, 0.3) + rng.normal(0, sigma, len(C))
  prior = {"log_cmid": (np.log(2400.0), 0.2), "log_b": (np.log(2.0), 0.15), "A": (0.63, 0.04)}
  post = fit_posterior(C, y, 0.3, noise={"d": sigma ** 2, "s2": 0.0, "rho": 0.0, "inflate": 1.0},
                       r0_noise=False, model_error=1.0, n_draws=60000, prior=prior)
  ref_a, ref_b = _brute_force(C, y, 0.3, sigma, prior)
  np.testing.assert_allclose(np.percentile(post.A, [5, 50, 95]), ref_a, atol=0.003)
  assert np.median(post.B) == pytest.approx(ref_b, rel=0.03)
  alone = fit_posterior(C, y, 0.3, noise={"d": sigma ** 2, "s2": 0.0, "rho": 0.0, "inflate": 1.0},
                        r0_noise=False, model_error=1.0, n_draws=20000)
  # the prior is what pins A down here: alone, a prefix before the bend leaves A far wider
  assert np.subtract(*np.percentile(alone.A, [95, 5])) > 2 * (ref_a[2] - ref_a[0])


def test_robust_normal_and_family_prior_are_median_and_scaled_mad():
  x = np.array([0.1, 0.3, 0.35, 0.4, 2.0])
  med, sd = robust_normal(x, 0.0)
  assert med == np.median(x) and sd == pytest.approx(1.4826 * np.median(np.abs(x - np.median(x))))
  assert robust_normal([0.5, 0.5, 0.5], 0.02) == (0.5, 0.02)          # floored
  fits = [MemberFit(f"r{i}", A=0.8 + 0.01 * i, B=2.0 * 1.1 ** i, m=0.3 * 1.2 ** i, T=300.0, n=30) for i in range(5)]
  p = family_prior(fits, 600.0)
  assert p["log_cmid"][0] == pytest.approx(np.log(0.3 * 1.2 ** 2) + np.log(600.0))
  assert p["log_b"][0] == pytest.approx(np.log(2.0 * 1.1 ** 2))
  assert p["A"] == (pytest.approx(0.82), pytest.approx(max(1.4826 * 0.01, FLOORS["A"])))
  assert family_prior(fits, 600.0, exclude="r4")["n"] == 4
  with pytest.raises(ForecastInputError, match="at least 3 members"):
    family_prior(fits[:3], 600.0, exclude="r0")


def _run(name, A, B=2.0, m=0.4, T=300.0, every=10, until=None, noise=0.0, seed=0, r0=0.2):
  x = np.arange(0.0, T + 1, every)
  y = sigmoid_curve(np.maximum(x, 1e-9), A, B, m * T, r0)
  y = np.clip(y + np.random.default_rng(seed).normal(0, noise, len(x)) * (x > 0), 0, 1)
  if until is not None:
    x, y = x[x <= until], y[x <= until]
  return RunData(name=name, compute=x, value=y, step=x.astype(int), r0=r0, run_dir=f"/nonexistent/{name}")


def test_member_too_short_is_not_identifiable_with_the_reason():
  with pytest.raises(NotIdentifiableError, match="not identifiable, 3 evaluations"):
    member_fit(_run("short", 0.8, T=30))
  fam = [_run(f"m{i}", A) for i, A in enumerate([0.75, 0.8, 0.85])]
  with pytest.raises(NotIdentifiableError, match="t: not identifiable, 3 evaluations after step 0"):
    forecast_run(_run("t", 0.8, until=30), 300.0, unit="steps", family=fam)
  flat = RunData(name="flat", compute=np.arange(0.0, 100, 10), value=np.full(10, 0.2), step=np.arange(10),
                 r0=0.2)
  with pytest.raises(NotIdentifiableError, match="never rises"):
    member_fit(flat)


def test_family_forecast_before_the_bend_is_pinned_by_the_family_shape():
  """Eq. 1 members with one shape (B 2, bend at 0.4 x their budget) and their own A; a target cut at
    25 % (before its bend): alone its forecast is wide, with the family it is close and covers."""
  fam = [_run(f"m{i}", A, noise=0.004, seed=i) for i, A in enumerate([0.75, 0.8, 0.85, 0.9, 0.78, 0.88])]
  target = _run("t", 0.83, until=75, noise=0.004, seed=99)
  truth = float(sigmoid_curve(300.0, 0.83, 2.0, 120.0, 0.2))
  alone, _ = forecast_run(target, 300.0, n_samples=1024, n_draws=4000, unit="steps")
  pooled, _ = forecast_run(target, 300.0, n_samples=1024, n_draws=4000, unit="steps", family=fam)
  assert pooled["family"]["n"] == 6 and pooled["family"]["residuals_from"] == "family"
  assert abs(pooled["pred"] - truth) < 0.02
  assert pooled["lo"] <= truth <= pooled["hi"]
  assert pooled["hi"] - pooled["lo"] < 0.5 * (alone["pred_hi"] - alone["pred_lo"])
  # references given too: the family shapes the fits, the references' residuals calibrate
  both, _ = forecast_run(target, 300.0, n_samples=1024, n_draws=4000, unit="steps", family=fam,
                         references=fam[:4])
  assert both["family"]["residuals_from"] == "references" and both["reference"]["n_all"] == 4


def _stored(tmp_path, name, extra=""):
  d = tmp_path / name
  d.mkdir()
  shutil.copy(REAL / "xeon_qwen_dapo_s30" / "metrics.jsonl", d / "metrics.jsonl")
  (d / "command.txt").write_text(f"python -m scalerl_jax.main --config=configs/tiny.py --workdir=W {extra}\n")
  return str(d)


def test_family_members_that_differ_are_refused_by_name(tmp_path):
  target = ("xeon_qwen_dapo_s30", setup_of(str(REAL / "xeon_qwen_dapo_s30")))
  same = ("xeon_magistral_s30", setup_of(str(REAL / "xeon_magistral_s30")))
  bf16 = ("xeon_loo_bf16_head_s31", setup_of(str(REAL / "xeon_loo_bf16_head_s31")))   # numerics: pools
  assert check_family(target, [same, bf16]) == {"eval_budget_differs": []}
  with pytest.raises(ForecastInputError, match="scalerl_s1 differs .* base policy"):
    check_family(target, [same, ("scalerl_s1", setup_of(str(REAL / "scalerl_s1")))])
  # a stored run with no known base gets its SFT recipe: it differs from a named base too
  for name, extra, part in (("wide", "--config.model.d_model=64", "model"),
                            ("evalx", "--config.eval.samples_per_prompt=8", "evaluation"),
                            ("datax", "--config.data.heldout=32", "data")):
    s = setup_of(_stored(tmp_path, name, extra))
    base = dict(target[1], **{part: s[part]})
    with pytest.raises(ForecastInputError, match=f"family member {name} differs from .* in its {part}"):
      check_family(target, [(name, dict(s, **{"base policy": target[1]["base policy"]}))])
    assert base != target[1]
  think = setup_of(_stored(tmp_path, "think", "--config.rollout.think_budget_max=64"))
  think["base policy"] = target[1]["base policy"]
  assert check_family(target, [("think", think)]) == {"eval_budget_differs": ["think"]}
  with pytest.raises(ForecastInputError, match="cannot tell"):
    check_family(target, [("nothing", None)])


def test_forecast_cli_refuses_a_member_of_another_base(capsys):
  rc = forecast_main([str(REAL / "xeon_qwen_dapo_s30"), "--axis", "step", "--budget", "300", "--until", "150",
                      "--out", "/tmp/unused_fc48", "--family", str(REAL / "xeon_magistral_s30"),
                      str(REAL / "scalerl_s1")])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "family member scalerl_s1 differs" in err[0]


# --- allocation model -----------------------------------------------------------------------------

Z0 = np.log2([64, 8, 28])


def _theta_true(z):
  """A, log B, log C_mid, exactly linear in z (centred on the default allocation)."""
  z = np.asarray(z) - Z0
  return np.array([0.8 + 0.03 * z[0] - 0.02 * z[1] + 0.01 * z[2], np.log(2.0) + 0.1 * z[0],
                   np.log(1.0) + 0.3 * z[0] - 0.1 * z[2]])


def _alloc_run(name, alloc, seed):
  z = np.log2([alloc[k] for k in allocate.KNOBS])
  A, lb, lc = _theta_true(z)
  x = np.linspace(0.1, 3.0, 30)
  y = sigmoid_curve(x, A, np.exp(lb), np.exp(lc), 0.2) + np.random.default_rng(seed).normal(0, 0.002, 30)
  return allocate.AllocRun(name, x, y, 0.2, dict(alloc), 1024.0)


def _one_at_a_time():
  base = {"batch": 64, "rollouts": 8, "think": 28}
  allocs = [base] + [dict(base, **{k: v}) for k, vs in (("batch", (32, 128)), ("rollouts", (16, 32)),
                                                        ("think", (14, 56))) for v in vs]
  return [_alloc_run(f"a{i}_s{s}", a, 10 * i + s) for i, a in enumerate(allocs) for s in (0, 1)]


def test_allocation_regression_is_the_ridge_solution():
  runs = _one_at_a_time()
  m = allocate.fit_model(runs)
  groups = {}
  for r in runs:
    groups.setdefault(tuple(r.z), []).append(allocate.run_theta(r))
  Z = np.array(list(groups))
  T = np.array([np.mean(v, 0) for v in groups.values()])
  X = np.hstack([np.ones((len(Z), 1)), Z])
  # ridge as an augmented least-squares problem (numpy lstsq), the intercept unpenalized
  Xa = np.vstack([X, np.sqrt(allocate.RIDGE) * np.eye(4)[1:]])
  Ta = np.vstack([T, np.zeros((3, 3))])
  np.testing.assert_allclose(m["beta"], np.linalg.lstsq(Xa, Ta, rcond=None)[0], atol=1e-10)
  # the fitted slopes are close to the truth (ridge shrinks them a little)
  assert m["beta"][1, 0] == pytest.approx(0.03, abs=0.006) and m["beta"][3, 2] == pytest.approx(-0.1, abs=0.03)


def test_allocation_outside_the_range_warns_and_widens():
  m = allocate.fit_model(_one_at_a_time())
  inside = allocate.predict(m, {"batch": 64, "rollouts": 16, "think": 28}, [3.0])
  out = allocate.predict(m, {"batch": 512, "rollouts": 16, "think": 28}, [3.0])
  assert inside["outside"] == [] and inside["sd_factor"] == 1.0
  # batch 512 = 2 doublings beyond 128, the range spans 2 doublings: 2 x (1 + 1)
  assert out["outside"] == ["batch"] and out["sd_factor"] == pytest.approx(4.0)
  assert out["hi"][0] - out["lo"][0] > 2 * (inside["hi"][0] - inside["lo"][0])
  truth = sigmoid_curve(3.0, *[f(v) for f, v in zip((float, np.exp, np.exp), _theta_true(np.log2([64, 16, 28])))], 0.2)
  assert abs(inside["pred"][0] - truth) < 0.01 and inside["lo"][0] <= truth <= inside["hi"][0]


def test_leave_one_allocation_out_on_an_exactly_linear_family():
  loo = allocate.leave_one_out(_one_at_a_time())
  assert len(loo["per_run"]) == 14 and len(loo["pairs"]) == 21
  assert loo["coverage"] >= 0.85 and loo["ranking_accuracy"] >= 0.85


def test_allocate_cli_bad_candidate_is_one_line(capsys):
  d = [str(REAL / "xeon_qwen_dapo_s30"), str(REAL / "xeon_magistral_s30")]
  rc = allocate.main(d + ["--budget", "1e12"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "lack train_flops" in err[0]
  rc = allocate.main(d + ["--budget", "1e12", "--candidate", "batch=64,rollouts=8"])
  err = capsys.readouterr().err.strip().splitlines()
  assert rc == 2 and len(err) == 1 and "missing think" in err[0]


def test_live_forecast_pools_a_family_and_refuses_another_base_at_start(tmp_path):
  from scalerl_jax.training.health import LiveForecast   # local: the trainer's module, only here
  wd = tmp_path / "xeon_qwen_dapo_s30"
  wd.mkdir()
  shutil.copy(REAL / "xeon_qwen_dapo_s30" / "command.txt", wd)
  lines = (REAL / "xeon_qwen_dapo_s30" / "metrics.jsonl").read_text().splitlines()
  (wd / "metrics.jsonl").write_text("\n".join(lines[:17]) + "\n")        # steps 0-160
  fam = ",".join(str(REAL / n) for n in ("xeon_magistral_s30", "xeon_minimax_s30", "xeon_deepseek_grpo_s30",
                                         "xeon_lr_2e-5_s32", "xeon_loo_bf16_head_s31"))
  with pytest.raises(ForecastInputError, match="family member scalerl_s1 differs .* base policy"):
    LiveForecast(str(wd), lambda r: None, axis="step", family=fam + "," + str(REAL / "scalerl_s1"))
  got = []
  fc = LiveForecast(str(wd), got.append, axis="step", n_draws=2000, family=fam)
  rec = fc.compute(160, 0.04, 300)
  assert rec is not None and rec["forecast/family_n"] == 5 and rec["forecast/budget_steps"] == 300
  assert rec["forecast/R_at_budget_lo"] <= rec["forecast/R_at_budget"] <= rec["forecast/R_at_budget_hi"]


def _fres(values, alarm=False):
  return [{"run": f"m{i}", "residual": float(v), "alarm": alarm} for i, v in enumerate(values)]


def test_small_family_band_is_the_t_prediction_interval():
  """A family's residuals too few for a conformal edge (n < 19 at 90 %): the band is the normal-theory
  prediction interval pred + shift +- t_{0.95, n-1} s sqrt(1 + 1/n); t_{0.95, 9} = 1.833113 (tables)."""
  from analysis.reference import calibrate
  r = np.array([-0.03, -0.02, -0.01, 0.0, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06])
  s = float(np.sqrt(np.sum((r - r.mean()) ** 2) / 9))
  half = 1.833113 * s * np.sqrt(1.1)
  cal = calibrate(0.80, 0.70, 0.90, _fres(r), target_alarm=False, small=True)
  shift = float(np.median(r))
  assert cal["parametric"] and not cal["conformal_lo"] and not cal["conformal_hi"]
  assert (cal["pred"], cal["lo"], cal["hi"]) == pytest.approx((0.8 + shift, 0.8 + shift - half, 0.8 + shift + half),
                                                             abs=1e-6)
  # the same residuals for a same-setup reference (small=False): the old fallback (own band + shift)
  old = calibrate(0.80, 0.70, 0.90, _fres(r), target_alarm=False)
  assert not old["parametric"] and (old["lo"], old["hi"]) == pytest.approx((0.70 + shift, 0.90 + shift))


def test_small_family_alarm_stratum_and_ceiling():
  """With a family: the alarm stratum needs 3 residuals (else all are used); the lower edge is the t
  edge of the stratum; an alarmed target's upper edge stays the ceiling."""
  from analysis.reference import calibrate
  mixed = _fres([0.0, 0.01, -0.01, 0.02, -0.02]) + _fres([0.05, 0.08, 0.11], alarm=True)
  cal = calibrate(0.6, 0.5, 0.7, mixed, target_alarm=True, small=True)
  r = np.array([0.05, 0.08, 0.11])
  half = 2.919986 * float(np.std(r, ddof=1)) * np.sqrt(4 / 3)          # t_{0.95, 2} = 2.919986
  assert cal["n"] == 3 and cal["shift"] == pytest.approx(0.08)
  assert cal["lo"] == pytest.approx(0.68 - half, abs=1e-6) and cal["hi"] == 1.0 and cal["parametric"]
  two = _fres([0.0, 0.01, -0.01, 0.02, -0.02]) + _fres([0.05, 0.08], alarm=True)
  cal = calibrate(0.6, 0.5, 0.7, two, target_alarm=True, small=True)   # stratum of 2 < 3: all, ceiling
  assert cal["n"] == 7 and cal["hi"] == 1.0
  assert calibrate(0.6, 0.5, 0.7, mixed, target_alarm=True)["hi"] == 1.0   # references: ceiling as before


def test_allocation_point_forecast_is_the_plug_in_curve():
  """pred = Eq. 1 at theta's predicted mean (numpy), unmoved by the widening; the band from the draws."""
  m = allocate.fit_model(_one_at_a_time())
  for alloc in ({"batch": 64, "rollouts": 16, "think": 28}, {"batch": 512, "rollouts": 16, "think": 28}):
    p = allocate.predict(m, alloc, [0.5, 3.0])
    th = np.concatenate([[1.0], np.log2([alloc[k] for k in allocate.KNOBS])]) @ m["beta"]
    want = m["r0"] + (th[0] - m["r0"]) / (1 + np.exp(np.exp(th[1]) * (th[2] - np.log([0.5, 3.0]))))
    np.testing.assert_allclose(p["pred"], want, rtol=1e-12)
    assert len(p["median"]) == 2


def test_knob_prior_moves_the_members_along_the_ridge_slopes():
  """family_prior(z=...) (issue #48, third round): slopes of (log m, log B, A) on z from the ridge
  solution (numpy lstsq on the augmented system), each member moved to the target's knobs, then
  median / 1.4826 MAD (floored) plus the slopes' variance res_var (x G x - 1/n); all knobs alike: the
  pooled prior exactly."""
  rng = np.random.default_rng(3)
  Z = np.array([[5, 3, 4.8], [5, 3, 4.8], [6, 3, 4.8], [6, 3, 4.8], [6, 4, 4.8], [6, 5, 4.8], [6, 3, 3.8], [6, 3, 5.8]])
  theta = np.column_stack([-1.0 + 0.4 * (Z[:, 0] - 6), 0.6 - 0.1 * (Z[:, 1] - 3), 0.9 + 0.02 * (Z[:, 2] - 4.8)])
  theta += rng.normal(0, [0.15, 0.12, 0.03], theta.shape)
  fits = [MemberFit(f"r{i}", A=t[2], B=float(np.exp(t[1])), m=float(np.exp(t[0])), T=300.0, n=30, z=tuple(z))
          for i, (t, z) in enumerate(zip(theta, Z))]
  zt = np.array([7.0, 3.0, 4.8])
  p = family_prior(fits, 150.0, z=tuple(zt))
  X = np.hstack([np.ones((8, 1)), Z])
  aug = np.vstack([X, np.sqrt(0.1) * np.hstack([np.zeros((3, 1)), np.eye(3)])])
  beta = np.linalg.lstsq(aug, np.vstack([theta, np.zeros((3, 3))]), rcond=None)[0]
  res_var = np.sum((theta - X @ beta) ** 2, axis=0) / (8 - 4)
  x = np.concatenate([[1.0], zt])
  lev = x @ np.linalg.solve(X.T @ X + np.diag([0, 0.1, 0.1, 0.1]), x)
  moved = theta + (zt - Z) @ beta[1:]
  for k, (key, floor) in enumerate((("log_cmid", 0.1), ("log_b", 0.1), ("A", 0.02))):
    med = np.median(moved[:, k])
    sd = np.hypot(max(1.4826 * np.median(np.abs(moved[:, k] - med)), floor), np.sqrt(res_var[k] * (lev - 1 / 8)))
    want_mean = med + (np.log(150.0) if key == "log_cmid" else 0.0)
    assert p[key] == pytest.approx((want_mean, sd), rel=1e-10), key
  assert p["shape"] == "knobs"
  alike = [MemberFit(f.name, f.A, f.B, f.m, f.T, f.n, z=(6.0, 3.0, 4.8)) for f in fits]
  pooled = family_prior(alike, 150.0)
  assert family_prior(alike, 150.0, z=(6.0, 3.0, 4.8)) == pooled and pooled["shape"] == "pooled"
  # leaving the member's allocation out too (its residual's prior, as the target's allocation is unseen)
  assert family_prior(fits, 150.0, exclude="r0", z=tuple(Z[0]), exclude_z=tuple(Z[0]))["n"] == 6


def test_recovered_alarm_rule_and_its_band():
  """recovered_from_alarm: the mean of the last 3 evaluations >= the mean of the 3 up to the first
  alarm (numpy); with a family (small) a recovered target gets its alarm stratum's t band, not the
  ceiling; references keep the ceiling."""
  from analysis.reference import calibrate, recovered_from_alarm
  C = np.arange(0.0, 160.0, 10.0)
  y = np.array([0.2, 0.4, 0.5, 0.6, 0.65, 0.7, 0.72, 0.6, 0.55, 0.62, 0.7, 0.74, 0.75, 0.76, 0.77, 0.78])
  run = RunData("t", C, y, np.arange(16), 0.2, alarms=np.array([60.0, 71.0]))
  before, last = y[[4, 5, 6]].mean(), y[-3:].mean()           # evaluations at 40, 50, 60 (the alarm's)
  assert last >= before and recovered_from_alarm(run, 150.0)
  assert recovered_from_alarm(run, 100.0) == (y[8:11].mean() >= before)   # 80, 90, 100: still in the dip
  assert not recovered_from_alarm(run, 100.0)
  assert y[9:12].mean() < before and not recovered_from_alarm(run, 110.0)   # 0.687 < 0.69: not yet
  assert not recovered_from_alarm(RunData("q", C, y, np.arange(16), 0.2), 150.0)    # no alarm
  mixed = _fres([0.0, 0.01, -0.01, 0.02, -0.02]) + _fres([0.05, 0.08, 0.11], alarm=True)
  r = np.array([0.05, 0.08, 0.11])
  half = 2.919986 * float(np.std(r, ddof=1)) * np.sqrt(4 / 3)          # t_{0.95, 2} = 2.919986
  cal = calibrate(0.6, 0.5, 0.7, mixed, target_alarm=True, small=True, recovered=True)
  assert (cal["lo"], cal["hi"]) == pytest.approx((0.68 - half, 0.68 + half), abs=1e-6) and cal["recovered"]
  assert calibrate(0.6, 0.5, 0.7, mixed, target_alarm=True, recovered=True)["hi"] == 1.0


def test_knob_prior_is_opt_in_and_only_for_an_allocation_the_family_never_ran():
  """forecast_run(knobs=True) on stored allocation runs: a batch x2 target with a family of batch 32
  and 64 runs (three allocations) gets the knob prior (bend later than the family's, as its knobs say); with a batch x2
  member in the family, or without ``knobs``, the pooled prior."""
  from analysis.metrics import on_axis, read_run
  runs = {n: on_axis(read_run(REAL / n), "step") for n in ("alloc_batch_x2_s50", "alloc_batch_x2_s51",
          "alloc_default_s50", "alloc_default_s51", "alloc_batch_x0.5_s50", "alloc_batch_x0.5_s51",
          "alloc_rollouts_16_s50", "alloc_rollouts_16_s51")}
  t = runs.pop("alloc_batch_x2_s50")
  sib = runs.pop("alloc_batch_x2_s51")
  kw = dict(until=75.0, n_draws=2000, unit="steps")
  unseen, _ = forecast_run(t, 150.0, family=list(runs.values()), knobs=True, **kw)
  pooled, _ = forecast_run(t, 150.0, family=list(runs.values()), **kw)
  seen, _ = forecast_run(t, 150.0, family=list(runs.values()) + [sib], knobs=True, **kw)
  assert unseen["family"]["shape"] == "knobs" and pooled["family"]["shape"] == "pooled"
  assert seen["family"]["shape"] == "pooled"
  assert unseen["family"]["m"] > 1.3 * pooled["family"]["m"]
