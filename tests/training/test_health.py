"""Run health thresholds and the live forecast (issue #17), without a training run."""

import json
import time

import ml_collections
import numpy as np
import pytest

from analysis.metrics import append_metrics
from analysis.posterior import fit_posterior
from scalerl_jax import config as common
from scalerl_jax.training.health import HealthMonitor, LiveForecast, RunUnhealthy
from tb_events import tb_scalars


def _cfg(**kw):
  c = common.base_config().health
  c.update(kw)
  return c


def test_defaults_declared_in_base_config():
  h = common.base_config().health
  assert h.max_length_cut_frac == 0.15 and h.max_truncated_frac == 0.05 and h.min_entropy == 0.05
  assert h.abort_on == "" and common.base_config().forecast.enabled is True


def test_thresholds_warn_and_flag(caplog):
  mon = HealthMonitor(_cfg())
  ok = mon.check({"step": 1, "length_cut_frac": 0.1, "truncated_frac": 0.01, "kl_k3": 0.01, "entropy": 0.5,
                  "skipped": 0.0})
  assert all(v == 0 for k, v in ok.items() if k.endswith("_alarm")) and len(ok) == 10
  with caplog.at_level("WARNING", logger="scalerl.health"):
    bad = mon.check({"step": 2, "length_cut_frac": 0.2, "truncated_frac": 0.06, "kl_k3": 0.2, "entropy": 0.01,
                     "skipped": 1.0})
  assert {k for k, v in bad.items() if k.endswith("_alarm") and v} == {
    "health/length_cut_frac_alarm", "health/truncated_frac_alarm", "health/kl_alarm", "health/entropy_alarm"}
  assert bad["health/kl"] == 0.2 and bad["health/skipped"] == 1.0
  assert sum("crossed its threshold" in r.message for r in caplog.records) == 4


def test_consecutive_skipped_steps_count_and_reset():
  mon = HealthMonitor(_cfg(abort_on="skipped"))
  for step in (1, 2):
    assert mon.check({"step": step, "skipped": 1.0})["health/skipped"] == step
  assert mon.check({"step": 3, "skipped": 0.0})["health/skipped"] == 0
  mon.check({"step": 4, "skipped": 1.0})
  mon.check({"step": 5, "skipped": 1.0})
  with pytest.raises(RunUnhealthy, match="skipped = 3"):
    mon.check({"step": 6, "skipped": 1.0})


def test_abort_on_names_only_known_signals_and_stops_with_reason():
  with pytest.raises(ValueError, match="unknown signal"):
    HealthMonitor(_cfg(abort_on="truncated_frac,loss"))
  mon = HealthMonitor(_cfg(abort_on="truncated_frac"))
  mon.check({"step": 1, "kl_k3": 5.0})                     # kl crosses, but is not in abort_on
  with pytest.raises(RunUnhealthy) as e:
    mon.check({"step": 7, "truncated_frac": 0.3})
  assert "truncated_frac = 0.3" in e.value.reason and "step 7" in e.value.reason and e.value.step == 7
  assert e.value.metrics["health/truncated_frac_alarm"] == 1


def test_abort_from_step_only_warns_before_it():
  """`health.abort_from_step`: crossings before it flag and warn, the first one at or after it stops
  the run (what tests/e2e/test_forecast_abort.py uses to force its abort at a known step)."""
  assert common.base_config().health.abort_from_step == 0
  mon = HealthMonitor(_cfg(abort_on="truncated_frac", max_truncated_frac=-1.0, abort_from_step=10))
  for step in range(1, 10):
    assert mon.check({"step": step, "truncated_frac": 0.0})["health/truncated_frac_alarm"] == 1
  with pytest.raises(RunUnhealthy) as e:
    mon.check({"step": 10, "truncated_frac": 0.0})
  assert e.value.step == 10 and "truncated_frac = 0 crossed the threshold at step 10" in e.value.reason
  assert mon.aborts("truncated_frac", 10) and not mon.aborts("truncated_frac", 9) and not mon.aborts("kl", 10)


def _demo_like_run(path, n_evals=31):
  """A run shaped like the tiny demo: 31 evaluations of mean@16 on 64 prompts (1,024 samples)."""
  rng = np.random.default_rng(0)
  C = np.linspace(0, 0.4, n_evals)
  y = np.clip(0.23 + 0.7 / (1 + (0.08 / np.maximum(C, 1e-9)) ** 1.5) + rng.normal(0, 0.012, n_evals), 0, 1)
  for k, (c, v) in enumerate(zip(C, y)):
    append_metrics(path, {"step": 10 * k, "kind": "eval", "compute_hours": float(c), "val_pass_rate": float(v),
                          "val_samples": 1024})
  return C, y


def test_live_forecast_matches_the_offline_fit_and_is_cheap(tmp_path):
  C, y = _demo_like_run(tmp_path)
  lf = LiveForecast(str(tmp_path), lambda rec: None, n_draws=4000)
  rec = lf.compute(300, float(C[-1]), 300)
  post = fit_posterior(C[1:], y[1:], y[0], n_samples=1024, n_draws=4000)
  assert rec["forecast/A"] == pytest.approx(np.median(post.A), abs=2e-3)
  assert rec["forecast/A_lo"] == pytest.approx(post.interval("A")[0], abs=2e-3)
  assert rec["forecast/budget_hours"] == pytest.approx(C[-1])
  assert rec["forecast/A_lo"] < rec["forecast/A"] < rec["forecast/A_hi"]
  cpu = []
  for _ in range(3):   # CPU seconds, not wall: the shared 2-core box runs others' jobs too
    t0 = time.process_time()
    lf.compute(300, float(C[-1]), 300)
    cpu.append(time.process_time() - t0)
  assert min(cpu) < 0.5, cpu                             # the refit itself (and it runs off the learner)


def test_live_forecast_thread_writes_metrics_and_tensorboard(tmp_path):
  from scalerl_jax.training.tracking import MetricsLog
  _demo_like_run(tmp_path, n_evals=4)                    # 3 evaluations after step 0: too few, no record
  log = MetricsLog(str(tmp_path))
  lf = LiveForecast(str(tmp_path), log.write, lock=log.lock)
  assert lf.submit(30, 0.4, 300) < 0.5
  lf.wait()
  assert lf.last is None
  log.write({"step": 40, "kind": "eval", "compute_hours": 0.5, "val_pass_rate": 0.8, "val_samples": 1024})
  cost = lf.submit(40, 0.5, 300)
  lf.wait()
  log.close()
  assert cost < 0.5
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  fc = [l for l in lines if l.get("kind") == "forecast"]
  assert len(fc) == 1 and fc[0]["step"] == 40
  assert fc[0]["forecast/budget_hours"] == pytest.approx(0.5 * 300 / 40)
  for key in ("forecast/A", "forecast/A_lo", "forecast/A_hi", "forecast/R_at_budget", "forecast/identifiable"):
    assert key in fc[0]
  C = [0.4 / 3 * k for k in range(1, 4)] + [0.5]
  y = [json.loads(l)["val_pass_rate"] for l in open(tmp_path / "metrics.jsonl") if "val_pass_rate" in l]
  offline = fit_posterior(C, y[1:], y[0], n_samples=1024, n_draws=4000)
  assert fc[0]["forecast/identifiable"] == int(offline.identifiability()["identifiable"])
  assert fc[0]["forecast/A"] == pytest.approx(np.median(offline.A), abs=5e-3)
  tb = tb_scalars(tmp_path / "tb")
  assert tb["forecast/A"] == [(40, pytest.approx(fc[0]["forecast/A"], rel=1e-6))]
  assert tb["forecast/R_at_budget"][0][1] == pytest.approx(fc[0]["forecast/R_at_budget"], rel=1e-6)


def test_wandb_offline_holds_the_same_scalars_as_metrics_jsonl(tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  from scalerl_jax.training.tracking import MetricsLog
  from scalerl_jax.training.wandb_sink import read_offline_history
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("WANDB_SILENT", "true")
  cfg = ml_collections.ConfigDict(dict(project="scalerl-test", entity="", name="", mode="auto"))
  log = MetricsLog(str(tmp_path), wandb_cfg=cfg, run_config={"lr": 3e-5})
  assert log.wandb.mode == "offline"
  recs = [{"step": 0, "kind": "eval", "compute_hours": 0.0, "val_pass_rate": 0.25},
          {"step": 1, "kind": "train", "compute_hours": 0.01, "loss": -0.5, "health/kl": 0.002, "lag_hist": [1, 2]},
          {"step": 1, "kind": "forecast", "forecast/A": 0.8, "forecast/verdict": "identifiable",
           "forecast/identifiable": 1}]
  for r in recs:
    log.write(r)
  png = tmp_path / "p.png"
  from matplotlib.figure import Figure
  Figure(figsize=(1, 1)).savefig(png)
  log.log_images({"fit/curves": str(png)}, step=2)
  log.close()
  log.finish()
  for _ in range(100):   # wandb-core may still be flushing the offline file after finish()
    rows = read_offline_history(str(tmp_path))
    if len(rows) >= 4:
      break
    time.sleep(0.2)
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  want = [{k: v for k, v in l.items() if isinstance(v, (int, float)) and k != "step"} for l in lines]
  got = [{k: v for k, v in r.items() if not k.startswith("_") and k != "trainer_step"} for r in rows[:3]]
  assert got == want
  assert [r["trainer_step"] for r in rows[:3]] == [0, 1, 1]
  assert rows[3]["trainer_step"] == 2 and rows[3]["fit/curves"]["_type"] == "image-file"
  assert (tmp_path / "wandb_id.txt").is_file()


def test_a_refit_that_ends_before_submit_returns_still_records_the_learner_cost(tmp_path, monkeypatch):
  """The race is forced: the refit (made instant) ends while `submit` is held up right after
  starting its thread. Before the fix that record lacked `forecast/learner_s` (a live run under
  load wrote one: test_forecast_e2e, 2026-12-05, commit cd5dca2, 2-core AMD EPYC); the refit now waits for the cost."""
  got = []
  lf = LiveForecast(str(tmp_path), got.append)
  monkeypatch.setattr(lf, "compute", lambda *a: {"step": 40, "kind": "forecast"})
  real, calls = time.perf_counter, []

  def held_up() -> float:
    calls.append(1)
    if len(calls) == 2:      # submit's second reading: the thread has started
      time.sleep(0.3)
    return real()

  monkeypatch.setattr(time, "perf_counter", held_up)
  cost = lf.submit(40, 0.5, 300)
  monkeypatch.setattr(time, "perf_counter", real)
  lf.wait()
  assert cost >= 0.3 and got == [{"step": 40, "kind": "forecast", "forecast/learner_s": cost}]
