"""Other-recipe forecasts on the stored real runs (issue #48; docs/ANALYSIS.md "Family pooling and
allocation"): each target cut at a fraction of its steps and forecast to its end, step axis, 90 %
bands, three ways: alone, ``--reference`` (same-setup runs: the baseline recipe's) and ``--family``
(the runs of the *other* recipes on the same base).

  python -m analysis.family_eval [--set alloc|xeon|xeon-seeds] [--cuts 0.25,0.5] [--ways alone,reference,family]
         [--knobs] [--recovery] [--json OUT.json]

``alloc``: the fourteen held-out allocation runs (``real_runs.ALLOC``; family = the alloc runs of the
other allocations, references = the default allocation's runs). ``xeon``: the 18 other-recipe Xeon
runs (not held out; family = the Xeon runs of the other recipes, references = the twenty Xeon seeds
of 2026-12-05, `real_runs.references_for`). ``xeon-seeds``: the 38 Xeon seeds of the baseline recipe
(not held out; family = the Xeon runs of the other recipes, 16 runs: a small family with many KL
alarms, where the third round's alarm rule was chosen). Prints one table row per (way, cut) and a JSON line of per-run numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from tqdm import tqdm

from analysis import real_runs
from analysis.errors import AnalysisError
from analysis.forecast import eval_samples, forecast_run
from analysis.metrics import on_axis, read_run

WAYS = ("alone", "reference", "family")


def _recipe(name: str) -> str:
  """What a run varies besides its seed and length (its recipe, switch, rate or allocation)."""
  if name in real_runs.ALLOC:
    return name.rsplit("_s", 1)[0]
  s = {k: v for k, v in real_runs.RUNS[name].items() if k not in ("seed", "total_steps")}
  return json.dumps(s, sort_keys=True)


def design(which: str) -> list[dict]:
  """The (target, references, family) of every target of set ``which``."""
  if which == "alloc":
    pool = [n for n in real_runs.ALLOC if os.path.exists(os.path.join(real_runs.OUT, n, "metrics.jsonl"))]
    refs_of = lambda t: [n for n in pool if n.startswith("alloc_default_") and n != t]
    targets = pool
  elif which == "xeon":
    pool = [n for n in real_runs.RUNS if n.startswith("xeon_")]
    targets = [n for n in pool if not n.startswith("xeon_scalerl_")]
    refs_of = lambda t: list(real_runs.XEON_REFERENCES)
  elif which == "xeon-seeds":
    pool = [n for n in real_runs.RUNS if n.startswith("xeon_")]
    targets = [n for n in pool if n.startswith("xeon_scalerl_")]
    refs_of = lambda t: list(real_runs.references_for(t))
  else:
    raise ValueError(f"--set {which!r}: expected alloc, xeon or xeon-seeds")
  return [{"target": t, "references": refs_of(t),
           "family": [n for n in pool if _recipe(n) != _recipe(t)]} for t in targets]


def _load(name: str, cache: dict):
  if name not in cache:
    cache[name] = on_axis(read_run(os.path.join(real_runs.OUT, name)), "step")
  return cache[name]


def evaluate(which: str, cuts=(0.25, 0.5), seed: int = 0, ways=WAYS, knobs: bool = False,
             recovery: bool = False) -> list[dict]:
  """Per (target, cut, way of ``ways``): forecast median, band, the measured final, error, covered;
    ``knobs``/``recovery``: the third round's opt-in rules (``analysis.forecast.forecast_run``)."""
  runs: dict = {}
  fit_cache: dict = {}
  out = []
  rows = design(which)
  for i, d in enumerate(tqdm(rows, desc=f"family eval ({which})", unit="run")):
    t = _load(d["target"], runs)
    ns = eval_samples(t.run_dir)
    x_end, y_end = float(t.compute[-1]), float(t.value[-1])
    for cut in cuts:
      for way in ways:
        refs = [_load(n, runs) for n in d["references"]] if way == "reference" else []
        fam = [_load(n, runs) for n in d["family"]] if way == "family" else []
        rec = {"run": d["target"], "cut": cut, "way": way, "final": y_end}
        if way != "alone" and not (refs or fam):
          rec["error"] = f"no {way} runs"
          out.append(rec)
          continue
        try:
          r, _ = forecast_run(t, x_end, until=cut * x_end, n_samples=ns, seed=seed + i, n_draws=8000,
                              ref_cache=fit_cache, unit="steps", references=refs, family=fam,
                              knobs=knobs, recovery=recovery)
          lo, hi = (r["lo"], r["hi"]) if way != "alone" else (r["pred_lo"], r["pred_hi"])
          rec.update(pred=r["pred"], lo=lo, hi=hi, err=r["pred"] - y_end, covered=bool(lo <= y_end <= hi),
                     identifiable=r["identifiable"], alarm=r.get("reference", {}).get("alarm"),
                     parametric=r.get("reference", {}).get("parametric"),
                     recovered=r.get("reference", {}).get("recovered"))
        except AnalysisError as e:
          rec["error"] = str(e)
        out.append(rec)
  return out


def summarize(recs: list[dict]) -> list[dict]:
  """One row per (way, cut): n, coverage, median |error|, median width, worst |error| (and whose)."""
  rows = []
  for cut in sorted({r["cut"] for r in recs}):
    for way in WAYS:
      got = [r for r in recs if r["cut"] == cut and r["way"] == way and "pred" in r]
      if not got:
        continue
      err = np.abs([r["err"] for r in got])
      k = int(np.argmax(err))
      rows.append({"way": way, "cut": cut, "n": len(got),
                   "failed": sum(1 for r in recs if r["cut"] == cut and r["way"] == way and "pred" not in r),
                   "coverage": float(np.mean([r["covered"] for r in got])),
                   "median_abs_error": float(np.median(err)),
                   "median_width": float(np.median([r["hi"] - r["lo"] for r in got])),
                   "worst_abs_error": float(err[k]), "worst_run": got[k]["run"]})
  return rows


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
  ap.add_argument("--set", default="alloc", choices=("alloc", "xeon", "xeon-seeds"))
  ap.add_argument("--cuts", default="0.25,0.5")
  ap.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset of " + ",".join(WAYS))
  ap.add_argument("--knobs", action="store_true", help="family shape from the allocation knobs (third round, opt-in)")
  ap.add_argument("--recovery", action="store_true", help="no ceiling after a recovered KL alarm (third round, opt-in)")
  ap.add_argument("--json", default="", help="also write every per-run record to this file")
  a = ap.parse_args(argv)
  ways = tuple(w for w in a.ways.split(",") if w)
  if not ways or any(w not in WAYS for w in ways):
    print(f"error: --ways {a.ways!r}: expected a comma-separated subset of {','.join(WAYS)}", file=sys.stderr)
    return 2
  recs = evaluate(a.set, tuple(float(c) for c in a.cuts.split(",")), ways=ways, knobs=a.knobs, recovery=a.recovery)
  print("| way | cut | n | covers final | median abs. error | median width | worst abs. error |")
  print("|---|---|---|---|---|---|---|")
  for r in summarize(recs):
    print(f"| {r['way']} | {r['cut']:.0%} | {r['n']} | {r['coverage']:.0%} | {r['median_abs_error']:.4f} | "
          f"{r['median_width']:.3f} | {r['worst_abs_error']:.3f} ({r['worst_run']}) |")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(recs, f, indent=1)
  print(json.dumps(summarize(recs)))
  return 0


if __name__ == "__main__":
  sys.exit(main())
