"""Run health (issue #17): thresholds on per-step instability signals, and the live forecast.

`HealthMonitor.check(rec)` compares one train record with `config.health` and returns the
`health/*` metrics: per signal its value and a 0/1 flag, a warning in the log at each crossing. A
crossing of a signal listed in `config.health.abort_on` raises `RunUnhealthy` (the trainer then
writes a checkpoint and the process exits non-zero with the reason). Thresholds and their sources:

| signal | record key | default | source |
|---|---|---|---|
| length_cut_frac | fraction of generations cut at the answer budget (finish LENGTH) | > 0.15 | paper: instability comes with the truncation rate climbing to ~10-15 % |
| truncated_frac | fraction of policy tokens whose CISPO IS weight hit eps_max | > 0.05 | PAPER_NOTES sec. 5 (watched in practice); 0.05 = a tail, not the bulk |
| kl | KL(generator ‖ learner), k3 estimator per token | > 0.1 | includes PipelineRL staleness (k=8): the tiny demo peaks at 0.056; engine mismatch alone is < 1e-3 with an fp32 head (docs/VLLM.md) |
| entropy | mean token entropy (nats) | < 0.05 | entropy collapse (PAPER_NOTES sec. 5) |
| skipped | consecutive skipped learner steps | >= 3 | a non-finite or empty step now and then is tolerated |

`LiveForecast` refits `analysis.posterior` after each evaluation on a background thread (off
the learner's critical path) and writes `forecast/*` to the metrics sink.
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("scalerl.health")

SIGNALS = ("length_cut_frac", "truncated_frac", "kl", "entropy", "skipped")


class RunUnhealthy(RuntimeError):
  """A signal in `config.health.abort_on` crossed its threshold; `.reason` says which and how."""

  def __init__(self, reason: str, step: int, metrics: dict | None = None):
    super().__init__(reason)
    self.reason, self.step, self.metrics = reason, step, dict(metrics or {})


class HealthMonitor:
  """Threshold checks on train records (see the module docstring)."""

  def __init__(self, cfg):
    self.cfg = cfg
    abort_on = cfg.get("abort_on", "") or ""
    if isinstance(abort_on, str):
      abort_on = [a.strip() for a in abort_on.split(",") if a.strip()]
    self.abort_on = tuple(abort_on)
    unknown = [s for s in self.abort_on if s not in SIGNALS]
    if unknown:
      raise ValueError(f"health.abort_on: unknown signal(s) {unknown}; choose from {list(SIGNALS)}")
    self.skipped_run = 0

  def values(self, rec: dict) -> dict:
    """The signals of one train record (missing ones are absent)."""
    out = {}
    if "length_cut_frac" in rec:
      out["length_cut_frac"] = float(rec["length_cut_frac"])
    if "truncated_frac" in rec:
      out["truncated_frac"] = float(rec["truncated_frac"])
    if "kl_k3" in rec:
      out["kl"] = float(rec["kl_k3"])
    if "entropy" in rec:
      out["entropy"] = float(rec["entropy"])
    if "skipped" in rec:
      self.skipped_run = self.skipped_run + 1 if rec["skipped"] else 0
      out["skipped"] = float(self.skipped_run)
    return out

  def crossed(self, name: str, v: float) -> bool:
    c = self.cfg
    return {"length_cut_frac": lambda: v > c.max_length_cut_frac,
            "truncated_frac": lambda: v > c.max_truncated_frac,
            "kl": lambda: v > c.max_kl,
            "entropy": lambda: v < c.min_entropy,
            "skipped": lambda: v >= c.max_consecutive_skipped}[name]()

  def check(self, rec: dict) -> dict:
    """`health/<signal>` values and `health/<signal>_alarm` flags for one train record; warns on
    each crossing and raises RunUnhealthy for a crossing listed in abort_on."""
    out, abort = {}, []
    for name, v in self.values(rec).items():
      bad = self.crossed(name, v)
      out[f"health/{name}"] = v
      out[f"health/{name}_alarm"] = int(bad)
      if bad:
        log.warning("health: %s = %.4g crossed its threshold at step %d", name, v, rec.get("step", -1))
        if name in self.abort_on:
          abort.append(f"{name} = {v:.4g}")
    if abort:
      raise RunUnhealthy(f"health.abort_on: {', '.join(abort)} crossed the threshold at step "
                         f"{rec.get('step', -1)}", int(rec.get("step", -1)), out)
    return out


class LiveForecast:
  """Refits the forecast after each evaluation, on one background thread.

  `submit(step, compute_hours, total_steps)` returns at once; the refit reads the run's evaluation
  lines, fits `analysis.posterior` and calls `write(record)` with `forecast/A`, `forecast/A_lo`,
  `forecast/A_hi`, `forecast/R_at_budget` (+ `_lo`, `_hi`), `forecast/identifiable`,
  `forecast/budget_hours` (the planned compute: hours so far x total_steps / step),
  `forecast/refit_s` (the refit's own wall time, on its thread) and `forecast/learner_s` (what
  submitting it cost the learner: waiting for the previous refit + starting the thread). A refit still running when the next one is
  submitted makes that one wait (never two at once).
  """

  def __init__(self, workdir: str, write, *, n_draws: int = 4000, lock: threading.Lock | None = None):
    self.workdir, self.write, self.n_draws = workdir, write, n_draws
    self.lock = lock or threading.Lock()
    self._thread = None
    self._cost = None
    self.last = None

  def submit(self, step: int, compute_hours: float, total_steps: int) -> float:
    """Starts a refit; returns the seconds the caller spent (the learner's cost)."""
    t0 = time.perf_counter()
    self.wait()
    self._cost = None
    self._thread = threading.Thread(target=self._refit, args=(step, compute_hours, total_steps),
                                    name="live-forecast", daemon=True)
    self._thread.start()
    self._cost = time.perf_counter() - t0
    return self._cost

  def wait(self) -> None:
    if self._thread is not None:
      self._thread.join()
      self._thread = None

  def compute(self, step: int, compute_hours: float, total_steps: int) -> dict | None:
    """The forecast record for the run as it stands (None before enough evaluations)."""
    from analysis.errors import AnalysisError
    from analysis.forecast import eval_samples
    from analysis.metrics import read_run
    from analysis.posterior import MIN_EVALS, fit_posterior
    t0 = time.perf_counter()
    with self.lock:
      run = read_run(self.workdir)
    C, y = run.window()
    if len(C) < MIN_EVALS or step <= 0:
      return None
    budget = max(float(compute_hours) * total_steps / step, float(C[-1]))
    try:
      post = fit_posterior(C, y, run.r0, n_samples=eval_samples(self.workdir), n_draws=self.n_draws)
    except AnalysisError as e:
      log.info("live forecast skipped at step %d: %s", step, e)
      return None
    band = post.band([budget])
    a_lo, a_hi = post.interval("A")
    ident = post.identifiability()
    import numpy as np
    return {"step": step, "kind": "forecast", "forecast/A": float(np.median(post.A)), "forecast/A_lo": a_lo,
            "forecast/A_hi": a_hi, "forecast/R_at_budget": float(band["pred"][0]),
            "forecast/R_at_budget_lo": float(band["lo"][0]), "forecast/R_at_budget_hi": float(band["hi"][0]),
            "forecast/identifiable": int(ident["identifiable"]), "forecast/budget_hours": budget,
            "forecast/verdict": "identifiable" if ident["identifiable"] else "not yet identifiable",
            "forecast/refit_s": time.perf_counter() - t0}

  def _refit(self, step, compute_hours, total_steps):
    try:
      rec = self.compute(step, compute_hours, total_steps)
    except Exception:    # a forecast must never take the run down
      log.exception("live forecast failed at step %d", step)
      return
    if rec is not None:
      if self._cost is not None:     # the learner's own cost of this refit (waiting + starting it)
        rec["forecast/learner_s"] = self._cost
      self.last = rec
      self.write(rec)
      log.info("forecast at step %d: A %.3f [%.3f, %.3f], R at budget %.3f h: %.3f (%s, refit %.2f s)",
               step, rec["forecast/A"], rec["forecast/A_lo"], rec["forecast/A_hi"],
               rec["forecast/budget_hours"], rec["forecast/R_at_budget"], rec["forecast/verdict"],
               rec["forecast/refit_s"])
