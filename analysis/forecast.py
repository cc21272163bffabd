"""Forecast runs from what they have measured so far (issue #17).

``python -m analysis.forecast RUN_DIR [RUN_DIR ...] --budget HOURS [--target R] [--out DIR] [--until HOURS]
[--axis compute|step] [--reference FINISHED_RUN_DIR ...] [--family RUN_DIR ...]``

For each run: the pass rate predicted at ``--budget`` with a 90 % band, the compute needed to reach
``--target`` (or "not reachable", with P(A < target)), A, B, C_mid with 90 % intervals, and an
identifiability verdict. For several runs: P(each ends highest at the budget), the compute at which
their predicted curves cross, and the paper's shared-A rule. Writes ``forecast.json`` and
``forecast.png`` to ``--out`` (default: the current directory). ``--until`` uses only evaluations up
to that compute (what the run had then). The uncertainty model is ``analysis.posterior`` (calibration
in docs/ANALYSIS.md). ``--axis step`` reads every compute (``--budget``, ``--until``) as training
steps. ``--reference`` (repeatable): finished runs of the same setup (task, evaluation set, base
policy); each run's forecast is then corrected by how those runs were forecast from the same
extrapolation distance, with a split-conformal band (``analysis.reference``). ``--family``: finished
runs of other recipes or allocations on the same model, data, evaluation and base policy; the run is
fitted with their pooled shape and calibrated by their residuals (``analysis.family``). Exit status 2
with a one-line ``error: ...`` on bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Sequence

import numpy as np

from analysis.compare import A_TOLERANCE, compare_runs
from analysis.errors import AnalysisError, ForecastInputError, TooFewPointsError
from analysis.family import NotIdentifiableError, check_family, family_prior, fit_members, knobs_of, setup_of
from analysis.metrics import AXES, AXIS_UNITS, METRICS_FILE, RunData, on_axis, read_metrics_lines, read_run
from analysis.plots import plot_forecast
from analysis.posterior import LEVEL, MIN_EVALS, WIDE_BAND, Posterior, fit_posterior, verdict
from analysis.reference import alarm_before, calibrate, recovered_from_alarm, reference_residuals
from scalerl_jax import storage
from scalerl_jax.config import Forecast

__all__ = ["forecast_run", "forecast_runs", "read_references", "format_table", "eval_samples", "main"]


def eval_samples(run_dir) -> float | None:
  """Generations behind one evaluation (``val_samples`` of the last evaluation line), or None."""
  try:
    lines = read_metrics_lines(storage.path(run_dir) / METRICS_FILE)
  except AnalysisError:
    return None
  for rec in reversed(lines):
    if "val_pass_rate" in rec and isinstance(rec.get("val_samples"), (int, float)) and rec["val_samples"] > 0:
      return float(rec["val_samples"])
  return None


def _finite_or_none(x):
  return float(x) if x is not None and math.isfinite(x) else None


def _check_request(run: RunData, C, budget: float, target: float | None, unit: str = "h"):
  if len(C) < MIN_EVALS:
    raise TooFewPointsError(f"{run.name}: {len(C)} evaluations after step 0, a forecast needs at least "
                            f"{MIN_EVALS}; wait for more evaluations (or evaluate more often)")
  if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
    raise ForecastInputError(f"--budget {budget} is not a positive number of "
                             f"{'accelerator-hours' if unit == 'h' else 'training steps'}")
  if budget < C[-1]:
    raise ForecastInputError(f"{run.name}: --budget {budget:g} {unit} is below the last measured compute "
                             f"{C[-1]:g} {unit}; a forecast looks ahead, pass a budget >= {C[-1]:g} {unit} "
                             "(use analysis.fit --fit-until to back-test instead)")
  if target is not None and not (math.isfinite(target) and run.r0 <= target <= 1.0):
    raise ForecastInputError(f"{run.name}: --target {target} is outside [R0, 1] = [{run.r0:.4g}, 1]; "
                             "give a pass rate (a fraction) above the run's step-0 value")


def forecast_run(run: RunData, budget: float, target: float | None = None, *, until: float | None = None,
                 n_samples: float | None = None, seed: int = 0, n_draws: int = 20000,
                 level: float = LEVEL, references: Sequence[RunData] = (), ref_cache: dict | None = None,
                 unit: str = "h", family: Sequence[RunData] = (), knobs: bool = False,
                 recovery: bool = False) -> tuple[dict, Posterior]:
  """Forecast one run (``analysis.metrics.RunData``) at ``budget`` hours; returns (record, posterior).

    The record holds ``run``, ``budget``, ``pred``, ``lo``, ``hi`` (the ``level`` band of the pass
    rate at the budget, i.e. of the run's curve), ``pred_lo``, ``pred_hi`` (the band of one
    evaluation there: the curve plus evaluation noise), ``identifiable``, ``verdict``, ``A``, ``B``, ``C_mid`` (posterior medians),
    ``ci`` ({A, B, C_mid} -> [lo, hi]), ``noise`` and, with ``target``, ``hours_to_target``
    ({pred, lo, hi}, hi None when the band reaches "never"; None when not reachable) and
    ``p_A_below_target``.

    ``references``: finished runs of the same setup on the same axis (``analysis.reference``):
    ``pred`` becomes the calibrated median and ``lo``/``hi`` = ``pred_lo``/``pred_hi`` the
    calibrated band (of a measured value at the budget); ``raw`` keeps Eq. 1's numbers and
    ``reference`` the correction (``own_median``: the measurement band's median it shifts,
    ``shift``, ``n``, the residuals). ``unit``: "h" or "steps". ``family``: finished runs of other
    recipes on the same setup (``analysis.family``; checked by the caller): the target is fitted
    with their pooled shape and A as its prior, and calibrated by their residuals (by the
    references' when ``references`` are given too, their forecasts pooled the same way); ``family``
    in the record says how. ``knobs``/``recovery``: issue #48's third-round rules, opt-in (they did
    worse on the held-out allocation runs): ``_family_model``, ``analysis.reference.recovered_from_alarm``.
    """
  C, y = run.window(None, until)
  if family and len(C) < MIN_EVALS:
    raise NotIdentifiableError(f"{run.name}: not identifiable, {len(C)} evaluations after step 0; even with a "
                               f"family a forecast needs {MIN_EVALS} (the family gives the shape, the run's own "
                               "evaluations its level) - wait for more evaluations")
  _check_request(run, C, budget, target, unit)
  references = [r for r in references if not (r.run_dir and r.run_dir == run.run_dir)]   # never itself
  family = [r for r in family if not (r.run_dir and r.run_dir == run.run_dir)]
  fam = _family_model(family, ref_cache, run, knobs) if family else None
  post = fit_posterior(C, y, run.r0, n_samples=n_samples, seed=seed, n_draws=n_draws,
                       unstable_at=run.alarms, prior=family_prior(fam["fits"], budget, z=fam["z"]) if fam else None)
  band = post.band([budget], level)
  mband = post.band([budget], level, measurement=True, seed=seed)
  ident = post.identifiability(level=level)
  width = float(band["hi"][0] - band["lo"][0])
  if width > WIDE_BAND:   # the parameters may be pinned down while the curve's future is not
    ident["reasons"] = ident["reasons"] + [
        f"the {level:.0%} band at the budget is {width:.3f} wide (> {WIDE_BAND:g}; misspecification "
        f"kappa {post.misspec['kappa']:.3g} per ln compute): evaluate further before trusting the value"]
  rec: dict[str, Any] = {"run": run.name, "run_dir": run.run_dir, "budget": float(budget), "until": until,
         "n_evals": int(len(C)), "last_compute": float(C[-1]), "last_value": float(y[-1]), "R0": run.r0,
         "pred": float(band["pred"][0]), "lo": float(band["lo"][0]), "hi": float(band["hi"][0]), "level": level,
         "pred_lo": float(mband["lo"][0]), "pred_hi": float(mband["hi"][0]),
         "identifiable": ident["identifiable"],
         "verdict": verdict(ident["identifiable"], width),
         "misspec": {**{k: _finite_or_none(post.misspec.get(k)) for k in ("kappa", "kappa_prior", "kappa_run")},
                     "unstable_at": list(post.misspec.get("unstable_at", []))},
         "reasons": ident["reasons"], "p_cmid_beyond_last": ident["p_cmid_beyond_last"],
         "A": float(np.median(post.A)), "B": float(np.median(post.B)), "C_mid": float(np.median(post.C_mid)),
         "ci": {p: post.interval(p, level) for p in ("A", "B", "C_mid")}, "ci_level": level,
         "map": post.map, "noise": {k: float(v) for k, v in post.noise.items()}, "n_samples": n_samples,
         "unit": unit}
  if references or family:
    res = reference_residuals(references or family, float(budget) / float(C[-1]), level=level, seed=seed,
                              n_draws=min(n_draws, 8000), cache=ref_cache,
                              n_samples_of=lambda r: eval_samples(r.run_dir) if r.run_dir else None,
                              prior_of=fam["prior_of"] if fam else None, prior_key=fam["key"] if fam else None)
    small, x_last = bool(fam) and not references, float(C[-1])
    cal = calibrate(float(mband["pred"][0]), float(mband["lo"][0]), float(mband["hi"][0]), res, level=level, small=small,
                    target_alarm=alarm_before(run, x_last), recovered=small and recovery and recovered_from_alarm(run, x_last))
    rec["raw"] = {k: rec[k] for k in ("pred", "lo", "hi", "pred_lo", "pred_hi")}
    rec.update(pred=cal["pred"], lo=cal["lo"], hi=cal["hi"], pred_lo=cal["lo"], pred_hi=cal["hi"],
               verdict=verdict(ident["identifiable"], cal["hi"] - cal["lo"]))
    rec["reference"] = {**{k: cal[k] for k in ("shift", "n", "n_all", "alarm", "conformal_lo", "conformal_hi",
                                               "parametric", "recovered")},
                        "own_median": float(mband["pred"][0]), "residuals": res}
  if fam:
    pr = family_prior(fam["fits"], budget, z=fam["z"])
    rec["family"] = {"n": pr["n"], "shape": pr["shape"], "members": [f.name for f in fam["fits"]], "not_identifiable": fam["skipped"],
                     "B": pr["B"], "m": pr["m"], "A": list(pr["A"]), "sd_log_b": pr["log_b"][1],
                     "sd_log_m": pr["log_cmid"][1], "residuals_from": "references" if references else "family"}
  if target is not None:
    rec.update(_target_record(post, float(target), level))
  return rec, post


def _target_record(post: Posterior, target: float, level: float) -> dict:
  """``target``, ``p_A_below_target`` and ``hours_to_target`` ({pred, lo, hi}; None when the
  target is more likely unreachable than not; hi None when the band reaches "never")."""
  h = post.hours_to(target, level)
  return {"target": target, "p_A_below_target": h["p_unreachable"],
          "hours_to_target": (None if h["p_unreachable"] >= 0.5 else
                              {"pred": h["pred"], "lo": h["lo"], "hi": _finite_or_none(h["hi"])})}


def _family_model(family: Sequence[RunData], cache: dict | None, target: RunData, knobs: bool = False) -> dict:
  """The family's member fits (cached in ``cache``), the members left out as not identifiable, the
    target's knobs (``analysis.family.knobs_of``) and the leave-one-out prior each member (or
    reference) is forecast with at its own end. Only with ``knobs`` and when the target's allocation is none of the
    members' (an allocation never run in the family) is the shape predicted from the knobs, and each
    member is then forecast with its own allocation left out too, as the target is (issue #48, third
    round); otherwise the pooled prior as before."""
  fits, skipped = fit_members(family, cache, knobs=knobs)
  memo = cache if cache is not None else {}

  def knobs_of_run(r: RunData):
    if ("knobs", r.run_dir) not in memo:
      memo[("knobs", r.run_dir)] = knobs_of(r.run_dir or "")
    return memo[("knobs", r.run_dir)]
  z = knobs_of_run(target) if knobs else None
  unseen = z is not None and all(f.z is not None and f.z != z for f in fits)
  key = ("family",) + tuple(sorted((f.name, f.n, f.T, f.z) for f in fits)) + (z, unseen)
  zs = {f.name: f.z for f in fits}

  def prior_of(r: RunData) -> dict:
    if not unseen:      # the target's allocation is in the family: pooled as before
      return family_prior(fits, float(r.compute[-1]), exclude=r.name)
    own = zs[r.name] if r.name in zs else knobs_of_run(r)
    return family_prior(fits, float(r.compute[-1]), exclude=r.name, z=own, exclude_z=own)
  return {"fits": fits, "skipped": skipped, "key": key, "z": z if unseen else None, "prior_of": prior_of}


def _crossings(names, posts, c_from, c_to):
  """Compute values where the median predicted curves of two runs cross, between c_from and c_to."""
  grid = np.geomspace(c_from, c_to, 400)
  med = [np.median(p.curves(grid), axis=0) for p in posts]
  out = []
  for i in range(len(posts)):
    for j in range(i + 1, len(posts)):
      d = med[i] - med[j]
      idx = np.flatnonzero(np.sign(d[:-1]) * np.sign(d[1:]) < 0)
      for k in idx:
        t = d[k] / (d[k] - d[k + 1])
        c = float(np.exp(np.log(grid[k]) + t * (np.log(grid[k + 1]) - np.log(grid[k]))))
        out.append({"runs": [names[i], names[j]], "compute": c,
                    "leader_after": names[i] if d[k + 1] > 0 else names[j]})
  return out


def read_references(ref_dirs, axis: str = Forecast.axis, what: str = "reference run") -> list[RunData]:
  """Finished reference runs (``analysis.reference``; ``what``: "family member" for a family) on
    ``axis``; a clear error for a directory that is missing or holds too few evaluations."""
  refs = []
  for d in ref_dirs:
    try:
      refs.append(on_axis(read_run(storage.path(d)), axis))
    except AnalysisError as e:
      raise ForecastInputError(f"{what} {d}: {e}") from None
  return refs


def checked_family(run: RunData, family: Sequence[RunData], config=None) -> dict:
  """``analysis.family.check_family`` of ``run`` against the members: refuses one that differs in
    model, data, evaluation or base policy, by name (``config``: the run's own, in training)."""
  target = (run.name, setup_of(run.run_dir or "", run.name, config=config))
  return check_family(target, [(m.name, setup_of(m.run_dir or "", m.name)) for m in family])


def forecast_runs(run_dirs, budget: float, target: float | None = None, out_dir=None, *,
                  until: float | None = None, n_samples: float | None = None, seed: int = 0,
                  n_draws: int = 20000, tol: float = A_TOLERANCE, names=None, plot: bool = True,
                  axis: str = Forecast.axis, references=(), family=()) -> list[dict]:
  """Forecast every run; with several, add ``p_best``, ``crossings`` and the shared-A ``comparison``.

    Writes ``out_dir/forecast.json`` and ``out_dir/forecast.png`` when ``out_dir`` is given.
    ``n_samples``: generations per evaluation; default: each run's ``val_samples``. ``axis``:
    "compute" (hours) or "step" (``budget`` and ``until`` in training steps). ``references``:
    directories of finished runs of the same setup (``forecast_run``). P(highest) and the crossings
    stay Eq. 1's: a bias of the setup is shared by its runs. ``family``: directories of finished
    runs of other recipes on the same model, data, evaluation and base policy (``forecast_run``;
    a member that differs is refused by name).
    """
  run_dirs = [storage.path(d) for d in run_dirs]   # local or gs://
  if not run_dirs:
    raise ForecastInputError("no run directories given; pass at least one RUN_DIR holding metrics.jsonl")
  if axis not in AXES:
    raise ForecastInputError(f"--axis {axis!r}: expected one of {AXES}")
  refs = read_references(references, axis)
  fam = read_references(family, axis, what="family member")
  unit = AXIS_UNITS[axis]
  runs = []
  for i, d in enumerate(run_dirs):
    try:
      runs.append(on_axis(read_run(d, name=(names[i] if names else None)), axis))
    except TooFewPointsError:
      raise TooFewPointsError(f"{d}: fewer than 2 evaluations; a forecast needs the step-0 evaluation and "
                              f"at least {MIN_EVALS} more") from None
  if len({r.name for r in runs}) != len(runs):
    for i, r in enumerate(runs):
      r.name = f"{i}:{r.name}"
  recs, posts = [], []
  cache: dict = {}
  for i, run in enumerate(runs):
    ns = n_samples if n_samples is not None else eval_samples(run.run_dir)
    members = [m for m in fam if not (m.run_dir and m.run_dir == run.run_dir)]
    chk = checked_family(run, members) if members else {}
    rec, post = forecast_run(run, budget, target, until=until, n_samples=ns, seed=seed + i, n_draws=n_draws,
                             references=refs, ref_cache=cache, unit=unit, family=members)
    if chk:
      rec["family"]["eval_budget_differs"] = chk["eval_budget_differs"]
    recs.append(rec)
    posts.append(post)
  if len(runs) > 1:
    at = np.stack([p.curves([budget])[:, 0] for p in posts])       # independent draws, one column a joint draw
    best = np.bincount(np.argmax(at, axis=0), minlength=len(runs)) / at.shape[1]
    cross = _crossings([r.name for r in runs], posts, max(rec["last_compute"] for rec in recs), 10 * budget)
    try:
      cmp: dict[str, Any] = compare_runs(runs, tol=tol, fit_until=until)
    except (AnalysisError, ValueError) as exc:
      cmp = {"error": str(exc)}
    for i, rec in enumerate(recs):
      rec["p_best"] = float(best[i])
      rec["crossings"] = [c for c in cross if rec["run"] in c["runs"]]
      if "error" in cmp:
        rec["comparison"] = {"error": cmp["error"]}
      else:
        row = next(r for r in cmp["rows"] if r["run"] == rec["run"])
        rec["comparison"] = {k: v for k, v in row.items() if k != "run"} | {
          "mode": cmp["mode"], "A_shared": cmp["A_shared"], "winner": cmp["winner"]}
  if out_dir is not None:
    out = storage.path(out_dir)
    storage.makedirs(str(out_dir))
    (out / "forecast.json").write_text(json.dumps(recs, indent=2) + "\n", encoding="utf-8")
    if plot:
      plot_forecast(runs, posts, recs, out / "forecast.png", budget=budget, target=target, until=until, axis=axis)
  return recs


def format_table(recs: list[dict]) -> str:
  """The forecast as a plain-text table plus one line per warning / comparison."""
  lvl = f"{recs[0]['level']:.0%}" if recs else "90%"
  u = recs[0].get("unit", "h") if recs else "h"
  head = (f"{'run':<18} {'evals':>5} {'last ' + u:>9} {'budget ' + u:>9}  {'R@budget [' + lvl + ' band]':<26} "
          f"{'A [' + lvl + ']':<22} {'B':>5} {'C_mid':>9}  verdict")
  lines = [head, "-" * len(head)]
  for r in recs:
    band = f"{r['pred']:.3f} [{r['lo']:.3f}, {r['hi']:.3f}]"
    if not r["identifiable"]:
      band = f"~{r['pred']:.2f} [{r['lo']:.3f}, {r['hi']:.3f}]"
    a = f"{r['A']:.3f} [{r['ci']['A'][0]:.3f}, {r['ci']['A'][1]:.3f}]"
    lines.append(f"{r['run'][:18]:<18} {r['n_evals']:>5} {r['last_compute']:>9.4g} {r['budget']:>9.4g}  "
                 f"{band:<26} {a:<22} {r['B']:>5.2f} {r['C_mid']:>9.4g}  {r['verdict']}")
  for r in recs:
    ref = r.get("reference")
    if ref:
      raw = r["raw"]
      need = math.ceil(2 / (1 - r["level"]) - 1e-9) - 1      # references a conformal edge needs: 19 at 90 %
      kind = ("split-conformal" if ref["conformal_lo"] and ref["conformal_hi"] else
              "partly split-conformal, partly Eq. 1's shifted" if ref["conformal_lo"] or ref["conformal_hi"] else
              f"Eq. 1's shifted: a split-conformal band needs {need} references")
      lines.append(f"  {r['run']}: calibrated by {ref['n']} of {ref['n_all']} reference runs (median residual "
                   f"{ref['shift']:+.3f}; band {kind}"
                   f"{'; KL alarm in the data: upper edge at the ceiling' if ref['alarm'] and not ref.get('recovered') else ''}"
                   f"{'; KL alarm, recovered from: alarm stratum band' if ref.get('recovered') else ''}); Eq. 1 alone: "
                   f"{raw['pred']:.3f} [{raw['pred_lo']:.3f}, {raw['pred_hi']:.3f}]")
    fam = r.get("family")
    if fam:
      lines.append(f"  {r['run']}: family of {fam['n']} runs (B ~ {fam['B']:.2f}, bend at {fam['m']:.2f} x the "
                   f"budget, A ~ {fam['A'][0]:.3f} +- {fam['A'][1]:.3f}); residuals from the {fam['residuals_from']}"
                   + "".join(f"; {s}" for s in fam["not_identifiable"]))
    if not r["identifiable"]:
      lines.append(f"! {r['run']}: NOT YET IDENTIFIABLE - " + "; ".join(r["reasons"]) +
                   ". The band is wide on purpose: do not read the median as a prediction.")
    if "target" in r:
      h = r["hours_to_target"]
      if h is None:
        lines.append(f"  {r['run']}: target {r['target']:.3f} not reachable "
                     f"(P(A < target) = {r['p_A_below_target']:.2f})")
      else:
        hi = "never" if h["hi"] is None else f"{h['hi']:.4g} {u}"
        lines.append(f"  {r['run']}: target {r['target']:.3f} reached at {h['pred']:.4g} {u} "
                     f"[{h['lo']:.4g} {u}, {hi}] (P(A < target) = {r['p_A_below_target']:.2f}; Eq. 1)")
  if len(recs) > 1:
    lines.append("  P(highest at the budget): " + ", ".join(f"{r['run']} {r['p_best']:.2f}" for r in recs))
    seen = set()
    for r in recs:
      for c in r.get("crossings", []):
        key = (tuple(c["runs"]), round(c["compute"], 6))
        if key not in seen:
          seen.add(key)
          lines.append(f"  curves of {c['runs'][0]} and {c['runs'][1]} cross at {c['compute']:.4g} {u} "
                       f"({c['leader_after']} ahead after)")
    if not seen:
      lines.append("  the predicted curves do not cross before 10 x the budget")
    cmp = recs[0].get("comparison", {})
    if "error" in cmp:
      lines.append(f"  shared-A rule: not applicable ({cmp['error']})")
    elif cmp.get("mode") == "shared_A":
      lines.append(f"  shared-A rule: all A within {A_TOLERANCE} -> refit at A = {cmp['A_shared']:.3f}, "
                   f"higher B wins: {cmp['winner']}")
    elif cmp:
      lines.append(f"  shared-A rule: A differ by more than {A_TOLERANCE} -> higher A wins: {cmp['winner']}")
  return "\n".join(lines)


def main(argv=None) -> int:
  """Command-line entry point (see the module docstring)."""
  ap = argparse.ArgumentParser(prog="python -m analysis.forecast", description=(__doc__ or "").split("\n")[0])
  ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories holding metrics.jsonl")
  ap.add_argument("--budget", type=float, required=True,
                  help="planned compute (accelerator-hours; with --axis step: training steps)")
  ap.add_argument("--target", type=float, default=None, help="pass rate to reach (a fraction in [R0, 1])")
  ap.add_argument("--out", default=".", help="directory for forecast.json and forecast.png (default: .)")
  ap.add_argument("--until", type=float, default=None, help="use only evaluations with compute <= HOURS")
  ap.add_argument("--eval-samples", type=float, default=None,
                  help="generations per evaluation (held-out prompts x samples); default: val_samples")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--axis", choices=AXES, default="compute",
                  help="x-axis: compute (accelerator-hours, as logged) or step (training steps: free of "
                       "compilation and evaluation stalls)")
  ap.add_argument("--reference", action="append", default=[], metavar="FINISHED_RUN_DIR",
                  help="a finished run of the same setup (repeat for several): calibrates the forecast "
                       "by how that run was forecast from the same extrapolation distance")
  ap.add_argument("--family", nargs="+", action="extend", default=[], metavar="RUN_DIR",
                  help="finished runs of OTHER recipes/allocations on the same model, data, evaluation "
                       "and base policy: pooled shape (B, bend, drift) and a shrunk A (analysis.family)")
  args = ap.parse_args(argv)
  try:
    recs = forecast_runs(args.run_dirs, args.budget, args.target, args.out, until=args.until,
                         n_samples=args.eval_samples, seed=args.seed, axis=args.axis,
                         references=args.reference, family=args.family)
  except AnalysisError as exc:
    print(f"error: {exc}", file=sys.stderr)
    return 2
  print(format_table(recs))
  print(f"wrote {storage.join(args.out, 'forecast.json')} and {storage.join(args.out, 'forecast.png')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
