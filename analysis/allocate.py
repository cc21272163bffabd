"""Forecast an allocation never run, from a family that varies them (issue #48; docs/ANALYSIS.md
"Family pooling and allocation").

  python -m analysis.allocate RUN_DIR [RUN_DIR ...] --budget FLOPS [--candidate batch=B,rollouts=G,think=T ...]
         [--out DIR] [--loo]

An allocation is (batch size = rollouts per step, rollouts per prompt, thinking budget); the x-axis is
FLOPs (``train_flops + gen_flops`` of the evaluation lines). Each run of the family (same model, data,
evaluation and base policy; checked by name, ``analysis.family``) is fitted alone (Eq. 1, least
squares); theta = (A, log B, log C_mid) is averaged over each allocation's seeds, and each component
is a linear function of z = log2 of the three knobs (ridge ``RIDGE`` on the slopes). A candidate's
theta is drawn from the prediction's normal (the regression's residual scatter and leverage, plus the
seeds' scatter), its curve's 90 % band adds one evaluation's binomial noise. A candidate outside the
family's range on any knob is warned about and its sd widened (``widen``). Candidates are ranked by
the plug-in curve (Eq. 1 at theta's predicted mean) at ``--budget``; until 2026-12-07 (issue #48,
second round) by the draws' median, which the widening pulls down. ``--loo``: leave-one-allocation-out over the family (coverage of each
held-out run's final value, pairwise ranking accuracy). Exit status 2 with one ``error:`` line on bad
input.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
from typing import Sequence

import numpy as np

from analysis.errors import AnalysisError, ForecastInputError
from analysis.family import KNOBS, RIDGE, allocation_of, check_family, config_of, ridge, setup_of
from analysis.metrics import read_metrics_lines, validate_curve
from analysis.posterior import LEVEL
from analysis.scaling import fit_sigmoid, sigmoid_curve
from scalerl_jax.config import Forecast

__all__ = ["KNOBS", "RIDGE", "AllocRun", "read_alloc_run", "run_theta", "fit_model", "predict", "widen", "leave_one_out", "main"]



class AllocRun:
  """One run on the FLOPs axis: x (train + gen FLOPs of each evaluation after step 0), y, r0, its
    allocation (``KNOBS`` -> value), the generations behind one evaluation."""

  def __init__(self, name, x, y, r0, alloc, n_samples):
    self.name, self.x, self.y, self.r0, self.alloc, self.n_samples = name, x, y, r0, alloc, n_samples

  @property
  def z(self) -> np.ndarray:
    return np.log2([self.alloc[k] for k in KNOBS])


def read_alloc_run(run_dir: str) -> AllocRun:
  """A run on the FLOPs axis; its allocation from its config (``config.json`` or ``command.txt``)."""
  name = os.path.basename(os.path.normpath(run_dir))
  lines = [r for r in read_metrics_lines(os.path.join(run_dir, "metrics.jsonl")) if "val_pass_rate" in r]
  if not lines or any("train_flops" not in r or "gen_flops" not in r for r in lines):
    raise ForecastInputError(f"{name}: its evaluation lines lack train_flops/gen_flops (a FLOPs axis needs "
                             "them: runs stored before issue #48 do not keep them)")
  x = np.array([float(r["train_flops"]) + float(r["gen_flops"]) for r in lines])
  y = np.array([float(r["val_pass_rate"]) for r in lines])
  cfg = config_of(run_dir)
  if cfg is None:
    raise ForecastInputError(f"{name}: no config.json or command.txt; its allocation is unknown")
  ns = lines[-1].get("val_samples")
  m = x > 0
  xv, yv = validate_curve(x[m], y[m], min_points=1, what=f"{name} (FLOPs axis)")
  return AllocRun(name, xv, yv, float(y[0]), allocation_of(cfg), float(ns) if ns else None)


def run_theta(run: AllocRun) -> np.ndarray:
  """(A, log B, log C_mid) of one run's least-squares Eq. 1 fit on the FLOPs axis."""
  fit = fit_sigmoid(run.x, run.y, run.r0)
  assert fit.C_mid is not None          # an Eq. 1 fit always has one
  return np.array([fit.A, math.log(fit.B), math.log(fit.C_mid)])


def fit_model(runs: Sequence[AllocRun]) -> dict:
  """The allocation model: per allocation theta = mean over its seeds of (A, log B, log C_mid);
    per component a ridge regression on [1, z]; residual scatter, seeds' scatter, the family's range."""
  groups: dict = {}
  for r in runs:
    groups.setdefault(tuple(r.z), []).append(run_theta(r))
  if len(groups) < 2:
    raise ForecastInputError(f"an allocation model needs runs of at least 2 allocations, got {len(groups)}")
  Z = np.array(list(groups))
  T = np.array([np.mean(v, axis=0) for v in groups.values()])
  within = [t - np.mean(v, axis=0) for v in groups.values() if len(v) > 1 for t in v]
  dof_w = sum(len(v) - 1 for v in groups.values())
  seed_var = (np.sum(np.square(within), axis=0) / dof_w) if dof_w else np.zeros(3)
  reg = ridge(Z, T, RIDGE)
  return {"beta": reg["beta"], "G": reg["G"], "res_var": reg["res_var"], "seed_var": seed_var, "z_lo": Z.min(0), "z_hi": Z.max(0),
          "r0": float(np.mean([r.r0 for r in runs])), "n_alloc": len(Z), "dof": reg["dof"],
          "n_samples": next((r.n_samples for r in runs if r.n_samples), None)}


def widen(z, model) -> tuple[float, list[str]]:
  """The sd factor of a candidate and the knobs it lies outside the family's range on: 1 inside;
    outside, 2 x (1 + the distance outside in units of the knob's span; a knob the family never
    varied counts a span of one doubling)."""
  z = np.asarray(z, float)
  out, dist = [], 0.0
  for k, name in enumerate(KNOBS):
    lo, hi = model["z_lo"][k], model["z_hi"][k]
    d = max(0.0, z[k] - hi, lo - z[k])
    if d > 1e-9:
      out.append(name)
      dist += d / (hi - lo if hi - lo > 1e-9 else 1.0)
  return (2.0 * (1.0 + dist) if out else 1.0), out


def predict(model: dict, alloc: dict, budgets, *, level: float = LEVEL, n_draws: int = Forecast.n_draws, seed: int = 0) -> dict:
  """An allocation's curve at ``budgets`` (FLOPs): ``pred``, the plug-in curve (Eq. 1 at theta's
    predicted mean: what candidates are ranked by, not moved by the widening), the ``level`` band of
    one measured evaluation from draws of theta (``median``: the draws' median); ``outside``: knobs
    beyond the family's range (a warning, the band widened)."""
  z = np.log2([float(alloc[k]) for k in KNOBS])
  x = np.concatenate([[1.0], z])
  mean = x @ model["beta"]
  var = model["res_var"] * (1.0 + float(x @ model["G"] @ x)) + model["seed_var"]
  factor, outside = widen(z, model)
  sd = np.sqrt(var) * factor
  rng = np.random.default_rng(seed)
  th = mean + rng.standard_normal((n_draws, 3)) * sd
  C = np.asarray(budgets, float)
  r0 = model["r0"]
  A = np.clip(th[:, 0], r0 + 1e-6, 1.0)
  cur = sigmoid_curve(C[None, :], A[:, None], np.exp(th[:, 1])[:, None], np.exp(th[:, 2])[:, None], r0)
  if model["n_samples"]:
    p = np.clip(cur, 0.0, 1.0)
    cur = cur + rng.standard_normal(cur.shape) * np.sqrt(p * (1 - p) / model["n_samples"])
  q = (1 - level) / 2
  a0 = float(np.clip(mean[0], r0 + 1e-6, 1.0))
  plug = sigmoid_curve(C, a0, math.exp(mean[1]), math.exp(mean[2]), r0)
  return {"alloc": dict(alloc), "pred": np.asarray(plug, float).tolist(), "median": np.median(cur, 0).tolist(), "lo": np.quantile(cur, q, 0).clip(0, 1).tolist(),
          "hi": np.quantile(cur, 1 - q, 0).clip(0, 1).tolist(), "A": float(mean[0]), "B": float(np.exp(mean[1])),
          "C_mid": float(np.exp(mean[2])), "outside": outside, "sd_factor": factor}


def _value_at(run: AllocRun, c: float) -> float:
  """The measured curve at FLOPs ``c`` (linear interpolation; the last value past its end)."""
  return float(np.interp(c, run.x, run.y))


def leave_one_out(runs: Sequence[AllocRun], *, level: float = LEVEL) -> dict:
  """Each allocation predicted by the model of the others: per held-out run, its final value inside
    the band at its final FLOPs; per pair of allocations, the predicted order at the common budget
    (the smaller of their final FLOPs) against the measured (seeds' mean) order."""
  allocs: dict = {}
  for r in runs:
    allocs.setdefault(tuple(sorted(r.alloc.items())), []).append(r)
  keys = list(allocs)
  models = {k: fit_model([r for kk in keys if kk != k for r in allocs[kk]]) for k in keys}
  per_run = []
  for k in keys:
    for r in allocs[k]:
      p = predict(models[k], dict(k), [r.x[-1]], level=level)
      per_run.append({"run": r.name, "alloc": dict(k), "final": float(r.y[-1]), "pred": p["pred"][0],
                      "lo": p["lo"][0], "hi": p["hi"][0], "outside": p["outside"],
                      "covered": bool(p["lo"][0] <= r.y[-1] <= p["hi"][0])})
  pairs = []
  for a, b in itertools.combinations(keys, 2):
    c = min(min(r.x[-1] for r in allocs[a]), min(r.x[-1] for r in allocs[b]))
    ma = float(np.mean([_value_at(r, c) for r in allocs[a]]))
    mb = float(np.mean([_value_at(r, c) for r in allocs[b]]))
    pa = predict(models[a], dict(a), [c])["pred"][0]
    pb = predict(models[b], dict(b), [c])["pred"][0]
    pairs.append({"a": dict(a), "b": dict(b), "budget": c, "measured": [ma, mb], "predicted": [pa, pb],
                  "correct": bool(np.sign(pa - pb) == np.sign(ma - mb))})
  return {"per_run": per_run, "pairs": pairs, "coverage": float(np.mean([p["covered"] for p in per_run])),
          "ranking_accuracy": float(np.mean([p["correct"] for p in pairs])) if pairs else None,
          "median_abs_error": float(np.median([abs(p["pred"] - p["final"]) for p in per_run]))}


def _parse_candidate(text: str) -> dict:
  out = {}
  for part in text.split(","):
    k, sep, v = part.partition("=")
    if k.strip() not in KNOBS or not sep:
      raise ForecastInputError(f"--candidate {text!r}: expected {','.join(f'{k}=VALUE' for k in KNOBS)}")
    try:
      out[k.strip()] = float(v)
    except ValueError:
      raise ForecastInputError(f"--candidate {text!r}: {k}={v!r} is not a number") from None
    if not out[k.strip()] > 0:
      raise ForecastInputError(f"--candidate {text!r}: {k} must be > 0")
  missing = [k for k in KNOBS if k not in out]
  if missing:
    raise ForecastInputError(f"--candidate {text!r}: missing {', '.join(missing)}")
  return out


def read_family(run_dirs: Sequence[str]) -> list[AllocRun]:
  """The runs, checked to share model, data, evaluation and base policy (refused by name)."""
  if len(run_dirs) < 2:
    raise ForecastInputError("give the runs of at least two allocations")
  setups = [(os.path.basename(os.path.normpath(d)), setup_of(d)) for d in run_dirs]
  check_family(setups[0], setups[1:])
  return [read_alloc_run(d) for d in run_dirs]


def main(argv=None) -> int:
  """Command-line entry point (see the module docstring)."""
  ap = argparse.ArgumentParser(prog="python -m analysis.allocate", description=(__doc__ or "").split("\n")[0])
  ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
  ap.add_argument("--budget", type=float, required=True, help="FLOPs (train_flops + gen_flops) to rank at")
  ap.add_argument("--candidate", action="append", default=[], metavar="batch=B,rollouts=G,think=T",
                  help="an allocation to forecast (repeat); default: the family's own allocations")
  ap.add_argument("--out", default="", help="write allocate.json there")
  ap.add_argument("--loo", action="store_true", help="also leave-one-allocation-out over the family")
  a = ap.parse_args(argv)
  try:
    if not (math.isfinite(a.budget) and a.budget > 0):
      raise ForecastInputError(f"--budget {a.budget}: expected a positive number of FLOPs")
    given = [_parse_candidate(c) for c in a.candidate]
    runs = read_family(a.run_dirs)
    model = fit_model(runs)
    cands = given or [dict(t) for t in {tuple(sorted(r.alloc.items())) for r in runs}]
    preds = sorted((predict(model, c, [a.budget]) for c in cands), key=lambda p: -p["pred"][0])
    loo = leave_one_out(runs) if a.loo else None
  except AnalysisError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"{'rank':>4}  {'batch':>6} {'rollouts':>8} {'think':>6}  R@{a.budget:.3g} FLOPs [90% band]   note")
  for i, p in enumerate(preds, 1):
    c = p["alloc"]
    note = f"OUTSIDE the family's range on {', '.join(p['outside'])}: band widened x{p['sd_factor']:.1f}" if p["outside"] else ""
    print(f"{i:>4}  {c['batch']:>6g} {c['rollouts']:>8g} {c['think']:>6g}  {p['pred'][0]:.3f} "
          f"[{p['lo'][0]:.3f}, {p['hi'][0]:.3f}]   {note}")
  for p in preds:
    if p["outside"]:
      print(f"warning: {p['alloc']} lies outside the family's range on {', '.join(p['outside'])}; "
            "an extrapolation, its band is widened", file=sys.stderr)
  if loo:
    print(f"leave-one-allocation-out: coverage {loo['coverage']:.0%} of {len(loo['per_run'])} runs, pairwise "
          f"ranking {loo['ranking_accuracy']:.0%} of {len(loo['pairs'])} pairs, median |error| {loo['median_abs_error']:.4f}")
  if a.out:
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "allocate.json"), "w") as f:
      json.dump({"budget": a.budget, "candidates": preds, "loo": loo}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
