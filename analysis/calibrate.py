"""Calibration and identifiability of the forecast on simulated runs (issue #17).

``python -m analysis.calibrate [--runs 200] [--pairs 200] [--seed 0] [--out DIR] [--only STUDY] [--axis compute|step]`` prints the tables
pasted into docs/ANALYSIS.md ("Forecast: calibration"). Runs are simulated by
``analysis.simulation`` (Table-1 rows in turn, mean@16 on 1,000 held-out prompts of unequal
difficulty, AR(1) policy wander, A spread +-0.015 run to run); each is forecast from the first half
of its budget with ``analysis.posterior.fit_posterior`` exactly as ``analysis.forecast`` does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from analysis import real_runs
from analysis.errors import AnalysisError, NoImprovementError
from analysis.forecast import eval_samples
from analysis.metrics import AXES, on_axis, read_run
from analysis.posterior import LEVEL, MISSPEC_GAIN, MISSPEC_PRIOR, MISSPEC_UP, fit_posterior, lfo_excess
from scalerl_jax.config import Forecast
from analysis.reference import alarm_before, calibrate, reference_residuals
from analysis.simulation import NoiseSpec, heldout_offsets, simulate_run
from analysis.synthetic import TABLE1

__all__ = ["coverage_study", "pairs_study", "identifiability_study", "real_study", "main"]

ROWS = tuple(TABLE1)
PREFIX_RATIOS = (0.25, 1.0, 2.0)


def _half_fit(run, spec, seed, n_draws=20000):
  budget = float(run.C[-1])
  m = (run.C > 0) & (run.C <= budget / 2)
  post = fit_posterior(run.C[m], run.y[m], float(run.y[0]), n_samples=spec.n_prompts * spec.samples,
                       seed=seed, n_draws=n_draws)
  return post, budget


def coverage_study(n_runs: int = 200, seed: int = 0, spec: NoiseSpec = NoiseSpec(),
                   level: float = LEVEL) -> dict:
  """Forecast each simulated run from the first half of its budget; coverage of the ``level`` band
    at the full budget for the noise-free value and for the measured final evaluation."""
  rng = np.random.default_rng(seed)
  rows = []
  for i in range(n_runs):
    name = ROWS[i % len(ROWS)]
    run = simulate_run(rng, name, spec)
    post, budget = _half_fit(run, spec, seed + i)
    b = post.band([budget], level)
    bm = post.band([budget], level, measurement=True, seed=i)
    b0 = post.band([budget], level, kappa=0.0, up=0.0, ceiling=False)
    lo, hi, pred = float(b["lo"][0]), float(b["hi"][0]), float(b["pred"][0])
    rows.append({"row": name, "truth": float(run.truth[-1]), "measured": float(run.y[-1]), "pred": pred,
                 "lo": lo, "hi": hi, "m_lo": float(bm["lo"][0]), "m_hi": float(bm["hi"][0]),
                 "lo0": float(b0["lo"][0]), "hi0": float(b0["hi"][0]), "kappa": post.misspec["kappa"],
                 "identifiable": post.identifiability()["identifiable"]})
  cov_t = np.mean([r["lo"] <= r["truth"] <= r["hi"] for r in rows])
  cov_m = np.mean([r["lo"] <= r["measured"] <= r["hi"] for r in rows])
  cov_mm = np.mean([r["m_lo"] <= r["measured"] <= r["m_hi"] for r in rows])
  cov_mt = np.mean([r["m_lo"] <= r["truth"] <= r["m_hi"] for r in rows])
  per_row = {}
  for name in ROWS:
    rr = [r for r in rows if r["row"] == name]
    if rr:
      per_row[name] = {"n": len(rr), "cov_truth": float(np.mean([r["lo"] <= r["truth"] <= r["hi"] for r in rr])),
                       "cov_measured": float(np.mean([r["lo"] <= r["measured"] <= r["hi"] for r in rr])),
                       "mband_cov_measured": float(np.mean([r["m_lo"] <= r["measured"] <= r["m_hi"] for r in rr])),
                       "median_width": float(np.median([r["hi"] - r["lo"] for r in rr])),
                       "median_abs_err": float(np.median([abs(r["pred"] - r["truth"]) for r in rr]))}
  return {"n_runs": n_runs, "level": level, "coverage_truth": float(cov_t), "coverage_measured": float(cov_m),
          "measurement_band_covers_measured": float(cov_mm), "measurement_band_covers_truth": float(cov_mt),
          "median_width": float(np.median([r["hi"] - r["lo"] for r in rows])), "per_row": per_row,
          "coverage_truth_without_term": float(np.mean([r["lo0"] <= r["truth"] <= r["hi0"] for r in rows])),
          "median_width_without_term": float(np.median([r["hi0"] - r["lo0"] for r in rows])),
          "runs": rows}


def pairs_study(n_pairs: int = 200, seed: int = 1, spec: NoiseSpec = NoiseSpec(), max_gap: float = 0.04,
                edges=(0.0, 0.2, 0.4, 0.6, 0.8, 1.0)) -> dict:
  """Pairs of recipes of one Table-1 row whose A differ by U(0, max_gap) (each run with its own
    +-0.015 spread, one shared held-out set): P(first ends higher at the budget) from the two
    half-budget forecasts, against which one does (noise-free values), in buckets of probability."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n_pairs):
    name = ROWS[i % len(ROWS)]
    gap = rng.uniform(0.0, max_gap) * rng.choice([-1.0, 1.0])
    z = heldout_offsets(rng, spec)
    r1 = simulate_run(rng, name, spec, z=z)
    r2 = simulate_run(rng, name, spec, z=z, A_shift=gap)
    p1, budget = _half_fit(r1, spec, seed + 2 * i, n_draws=8000)
    p2, _ = _half_fit(r2, spec, seed + 2 * i + 1, n_draws=8000)
    c1 = p1.curves([budget])[:, 0]
    c2 = p2.curves([budget])[:, 0]
    prob = float(np.mean(c1[:, None] > c2[None, ::7]))   # independent posteriors: all pairs of draws (thinned)
    out.append({"row": name, "gap_A": float(gap), "p_first": prob,
                "first_wins": bool(r1.truth[-1] > r2.truth[-1])})
  p = np.array([o["p_first"] for o in out])
  w = np.array([o["first_wins"] for o in out], float)
  # each pair read both ways (first vs second and second vs first): buckets symmetric about 0.5
  p2, w2 = np.concatenate([p, 1 - p]), np.concatenate([w, 1 - w])
  buckets = []
  for lo, hi in zip(edges[:-1], edges[1:]):
    m = (p2 >= lo) & ((p2 < hi) if hi < 1 else (p2 <= hi))
    if m.any():
      buckets.append({"lo": lo, "hi": hi, "n": int(m.sum()), "mean_p": float(p2[m].mean()),
                      "observed": float(w2[m].mean())})
  brier = float(np.mean((p - w) ** 2))
  return {"n_pairs": n_pairs, "max_gap": max_gap, "buckets": buckets, "brier": brier, "pairs": out}


def identifiability_study(n_runs: int = 200, seed: int = 2, spec: NoiseSpec = NoiseSpec(),
                          ratios=PREFIX_RATIOS) -> dict:
  """Share of simulated runs whose verdict is 'identifiable' on prefixes ending at ``ratio x C_mid``
    (ratio < 1: the last evaluation before it; ratio >= 1: the first evaluation at or past it)."""
  rng = np.random.default_rng(seed)
  hits = {r: [] for r in ratios}
  no_rise = {r: 0 for r in ratios}
  for i in range(n_runs):
    name = ROWS[i % len(ROWS)]
    run = simulate_run(rng, name, spec)
    for ratio in ratios:
      end = ratio * run.C_mid
      if ratio < 1:
        m = (run.C > 0) & (run.C < end)
      else:
        k = int(np.searchsorted(run.C, end))
        m = (run.C > 0) & (np.arange(len(run.C)) <= k)
      try:
        post = fit_posterior(run.C[m], run.y[m], float(run.y[0]), n_samples=spec.n_prompts * spec.samples,
                             seed=seed + i, n_draws=8000)
      except NoImprovementError:   # no rise above R0 yet: the forecast says so (exit 2), no verdict
        hits[ratio].append(False)
        no_rise[ratio] += 1
        continue
      hits[ratio].append(post.identifiability()["identifiable"])
  return {"n_runs": n_runs, "share_identifiable": {str(r): float(np.mean(v)) for r, v in hits.items()},
          "no_rise_yet": {str(r): v for r, v in no_rise.items()}}


CUTS = (0.25, 0.5, 0.75)


def _real_cut(run, share: float, seed: int, n_samples: float | None) -> dict | None:
  """One forecast of a real run from its evaluations up to ``share`` of its final compute: the
    posterior (with the run's leave-future-out misfit) and the final measured value; None when
    the prefix cannot be forecast (too few evaluations, no rise yet)."""
  budget = float(run.compute[-1])
  m = (run.compute > 0) & (run.compute <= share * budget)
  try:
    post = fit_posterior(run.compute[m], run.value[m], run.r0, n_samples=n_samples, seed=seed,
                         n_draws=8000, unstable_at=run.alarms)
  except AnalysisError:
    return None
  # the run's own misfit, whatever gain is in use (the grid scales it)
  post.misspec.update(lfo_excess(run.compute[m], run.value[m], run.r0, n_samples=n_samples, seed=seed))
  return {"run": run.name, "share": share, "post": post, "budget": budget, "final": float(run.value[-1]),
          "x_last": float(run.compute[m][-1])}


def _score(cut: dict, prior: float, gain: float, level: float = LEVEL, up: float | None = None,
           ceiling: bool = True) -> dict:
  """The ``level`` bands of one cut at its run's final compute with the misspecification term set
    to ``(prior, gain)`` (0, 0: Eq. 1's band alone): the curve band and the band of one evaluation
    (what a final measurement falls in), and whether each covers the final measured value."""
  post = cut["post"]
  kappa = float(np.hypot(prior, gain * post.misspec["kappa_run"]))
  b = post.band([cut["budget"]], level, kappa=kappa, up=up, ceiling=ceiling)
  bm = post.band([cut["budget"]], level, measurement=True, kappa=kappa, up=up, ceiling=ceiling)
  f = cut["final"]
  return {"pred": float(bm["pred"][0]), "lo": float(b["lo"][0]), "hi": float(b["hi"][0]),
          "m_lo": float(bm["lo"][0]), "m_hi": float(bm["hi"][0]),
          "covers": bool(bm["lo"][0] <= f <= bm["hi"][0]), "curve_covers": bool(b["lo"][0] <= f <= b["hi"][0]),
          "err": float(bm["pred"][0] - f), "width": float(bm["hi"][0] - bm["lo"][0])}


def _table(cuts: list[dict], prior: float, gain: float, up: float | None = None,
           ceiling: bool = True) -> dict:
  """Per cut share: coverage of the final value (measurement band; curve band), median |error|,
    median band width."""
  out = {}
  for share in CUTS:
    rows = [_score(c, prior, gain, up=up, ceiling=ceiling) for c in cuts if c["share"] == share]
    if rows:
      out[str(share)] = {"n": len(rows), "coverage": float(np.mean([r["covers"] for r in rows])),
                         "curve_coverage": float(np.mean([r["curve_covers"] for r in rows])),
                         "median_abs_err": float(np.median([abs(r["err"]) for r in rows])),
                         "median_width": float(np.median([r["width"] for r in rows]))}
  return out


SPLITS = ("held_out_2026_12_05b", "held_out_2026_12_05", "held_out", "calibration")
SPLIT_LABELS = {"held_out_2026_12_05b": "held-out, second batch of 2026-12-05 (commit e1d7548, 2-core Intel Xeon)",
                "held_out_2026_12_05": "held-out, batch of 2026-12-05 (commit 3495db7, 2-core Intel Xeon)",
                "held_out": "held-out", "calibration": "calibration"}


def _split(name: str) -> str:
  if name in real_runs.HELDOUT_2026_12_05B:
    return "held_out_2026_12_05b"
  if name in real_runs.HELDOUT_2026_12_05:
    return "held_out_2026_12_05"
  return "calibration" if name in real_runs.CALIBRATION else "held_out"


def _reference_table(cuts: list[dict], runs: dict, cache: dict, seed: int, level: float = LEVEL) -> dict:
  """Per cut share, the reference-calibrated forecast (``analysis.reference``, each run against
    ``real_runs.references_for``): coverage of the final value, median |error|, median width,
    median shift."""
  out = {}
  for share in CUTS:
    rows = []
    for c in (c for c in cuts if c["share"] == share):
      refs = [runs[r] for r in real_runs.references_for(c["run"]) if r in runs]
      if not refs:
        continue
      bm = c["post"].band([c["budget"]], level, measurement=True)
      res = reference_residuals(refs, c["budget"] / c["x_last"], level=level, seed=seed, cache=cache,
                                n_samples_of=lambda r: eval_samples(r.run_dir))
      if not res:
        continue
      cal = calibrate(float(bm["pred"][0]), float(bm["lo"][0]), float(bm["hi"][0]), res,
                      target_alarm=alarm_before(runs[c["run"]], c["x_last"]), level=level)
      f = c["final"]
      rows.append({"run": c["run"], "err": cal["pred"] - f, "covers": cal["lo"] <= f <= cal["hi"],
                   "width": cal["hi"] - cal["lo"], "shift": cal["shift"], "n": cal["n"]})
    if rows:
      out[str(share)] = {"n": len(rows), "coverage": float(np.mean([r["covers"] for r in rows])),
                         "median_abs_err": float(np.median([abs(r["err"]) for r in rows])),
                         "median_width": float(np.median([r["width"] for r in rows])),
                         "median_shift": float(np.median([r["shift"] for r in rows])),
                         "median_references": float(np.median([r["n"] for r in rows])),
                         "errors": {r["run"]: round(r["err"], 4) for r in rows}}
  return out


def real_study(runs_dir=None, seed: int = 0, priors=(0.0, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04),
               gains=(0.0, 0.5, 1.0, 1.5, 2.0), axis: str = Forecast.axis, references: bool = True) -> dict:
  """The misspecification term on real runs (analysis/real_runs/): every run forecast from 25, 50
    and 75 % of its final compute (``axis`` "step": of its steps, ``analysis.metrics.on_axis``).
    ``(MISSPEC_PRIOR, MISSPEC_GAIN)`` is the grid point whose measurement band covers the final
    value of the calibration runs (``real_runs.CALIBRATION``) closest to ``LEVEL`` over the three
    cuts (ties: the narrower band); the held-out runs (the batches declared in commits 3495db7 and e1d7548 apart) are reported with
    it, with the band without the term beside it. ``references``: also the reference-calibrated
    forecast of every run (``analysis.reference`` against ``real_runs.references_for``)."""
  root = Path(runs_dir or real_runs.OUT)
  names = sorted(p.name for p in root.iterdir() if (p / "metrics.jsonl").is_file()) if root.is_dir() else []
  names = [n for n in names if n not in real_runs.ALLOC]   # issue #48's runs: their own study (family_eval)
  if not names:
    raise AnalysisError(f"no real runs in {root}: make them with `python -m analysis.real_runs` "
                        "(~2-3 min per run on 2 cores)")
  cuts: dict[str, list] = {s: [] for s in SPLITS}
  runs = {}
  skipped = []
  for i, name in enumerate(names):
    run = on_axis(read_run(root / name), axis)
    runs[name] = run
    n_samples = eval_samples(root / name)
    for share in CUTS:
      c = _real_cut(run, share, seed + 100 * i, n_samples)
      if c is None:
        skipped.append(f"{name}@{share}")
      else:
        cuts[_split(name)].append(c)
  grid = []
  for prior in priors:
    for gain in gains:
      t = _table(cuts["calibration"], prior, gain)
      cov = np.mean([v["coverage"] for v in t.values()])
      width = np.mean([v["median_width"] for v in t.values()])
      grid.append({"prior": prior, "gain": gain, "coverage": float(cov), "width": float(width)})
  best = min(grid, key=lambda g: (round(abs(g["coverage"] - LEVEL), 3), g["width"]))
  current = (MISSPEC_PRIOR, MISSPEC_GAIN)
  res = {"axis": axis, "runs": names, "calibration_runs": [n for n in names if n in real_runs.CALIBRATION],
         "skipped_cuts": skipped, "level": LEVEL, "grid": grid, "fitted": {"prior": best["prior"], "gain": best["gain"]},
         "in_use": {"prior": current[0], "gain": current[1]}}
  cache: dict = {}
  for split, cc in cuts.items():
    if not cc:
      continue
    res[split] = {"with_term": _table(cc, *current),
                  "without_term": _table(cc, 0.0, 0.0, up=0.0, ceiling=False),
                  "kappa_run_median": float(np.median([c["post"].misspec["kappa_run"] for c in cc]))}
    if references:
      res[split]["reference"] = _reference_table(cc, runs, cache, seed)
  return res


def markdown_real(res: dict) -> str:
  """The real-run study as markdown."""
  f, u = res["fitted"], res["in_use"]
  ax = res.get("axis", "compute")
  L = [f"{len(res['runs'])} real runs (analysis/real_runs/), {len(res['calibration_runs'])} for calibration; "
       f"each forecast from 25/50/75 % of its final {ax}, {res['level']:.0%} bands at the "
       f"final {ax}. "
       f"Fitted on the calibration runs: MISSPEC_PRIOR={f['prior']:g}, MISSPEC_GAIN={f['gain']:g}; in use: "
       f"{u['prior']:g}, {u['gain']:g}, with the upward drift allowance MISSPEC_UP={MISSPEC_UP:g} and the "
       f"ceiling as the upper edge of not-yet-identifiable forecasts. 'Without': Eq. 1's band as before "
       f"issue #29 (no term, no allowance, no ceiling). 'With references': the reference-calibrated "
       f"forecast (analysis.reference; references: real_runs.references_for - for the held-out batch of 2026-12-05 (commit 3495db7) the "
       f"twenty Xeon runs s10-s29, declared before it ran).", "",
       "| runs | cut | n | band covers final value (measurement band) | curve band covers | median abs. error "
       "| median width | Eq. 1 band as before: covers | as before: width | with references: covers | "
       "median abs. error | median width | median shift |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for split in SPLITS:
    if split not in res:
      continue
    w, wo, rf = res[split]["with_term"], res[split]["without_term"], res[split].get("reference", {})
    for share, v in w.items():
      o, r = wo.get(share, {}), rf.get(share)
      ref = (f"**{r['coverage']:.0%}** | {r['median_abs_err']:.4f} | {r['median_width']:.4f} | {r['median_shift']:+.4f}"
             if r else "- | - | - | -")
      L.append(f"| {SPLIT_LABELS[split]} | {float(share):.0%} | {v['n']} | **{v['coverage']:.0%}** | "
               f"{v['curve_coverage']:.0%} | {v['median_abs_err']:.4f} | {v['median_width']:.4f} | "
               f"{o.get('coverage', float('nan')):.0%} | {o.get('median_width', float('nan')):.4f} | {ref} |")
  if res["skipped_cuts"]:
    L += ["", f"Cuts with no forecast (too few evaluations or no rise yet): {', '.join(res['skipped_cuts'])}."]
  return "\n".join(L) + "\n"


def markdown_coverage(cov: dict) -> str:
  """The coverage study as markdown."""
  L = [f"{cov['n_runs']} runs fitted on the first half of the budget, {cov['level']:.0%} bands at the full budget. "
       f"Curve band (`lo`/`hi`): covers the noise-free value in **{cov['coverage_truth']:.1%}**, the measured final "
       f"evaluation in {cov['coverage_measured']:.1%} (median width {cov['median_width']:.4f}). "
       f"Measurement band (`pred_lo`/`pred_hi`): covers the measured final evaluation in "
       f"**{cov['measurement_band_covers_measured']:.1%}**, the noise-free value in "
       f"{cov['measurement_band_covers_truth']:.1%}. Without the misspecification term the curve band "
       f"covers the noise-free value in {cov.get('coverage_truth_without_term', float('nan')):.1%} (median "
       f"width {cov.get('median_width_without_term', float('nan')):.4f}).", "",
       "| Table-1 row | runs | curve band covers noise-free | curve band covers measured | measurement band "
       "covers measured | median curve-band width | median abs. error |",
       "|---|---|---|---|---|---|---|"]
  for name, r in cov["per_row"].items():
    L.append(f"| {name} | {r['n']} | {r['cov_truth']:.0%} | {r['cov_measured']:.0%} | {r['mband_cov_measured']:.0%} "
             f"| {r['median_width']:.4f} | {r['median_abs_err']:.4f} |")
  return "\n".join(L) + "\n"


def markdown_pairs(pairs: dict) -> str:
  """The pairs study as markdown."""
  L = [f"Which recipe wins, {pairs['n_pairs']} pairs with true A {pairs['max_gap']:.2f} apart at most "
       f"(each pair read both ways; Brier score {pairs['brier']:.3f}):", "",
       "| predicted P(wins) | n | mean predicted | observed win rate | difference |", "|---|---|---|---|---|"]
  for b in pairs["buckets"]:
    L.append(f"| {b['lo']:.1f}-{b['hi']:.1f} | {b['n']} | {b['mean_p']:.3f} | {b['observed']:.3f} | "
             f"{b['observed'] - b['mean_p']:+.3f} |")
  return "\n".join(L) + "\n"


def markdown_ident(ident: dict) -> str:
  """The identifiability study as markdown."""
  L = [f"Identifiability verdict on prefixes, {ident['n_runs']} runs:", "",
       "| prefix ends at | share 'identifiable' | no rise above R0 yet (counted not identifiable) |", "|---|---|---|"]
  for r, v in ident["share_identifiable"].items():
    L.append(f"| {'before' if float(r) < 1 else 'first eval past'} {r} x C_mid | {v:.1%} | "
             f"{ident['no_rise_yet'][r]} |")
  return "\n".join(L) + "\n"


def main(argv=None) -> int:
  """Command-line entry point (see the module docstring)."""
  ap = argparse.ArgumentParser(prog="python -m analysis.calibrate", description=(__doc__ or "").split("\n")[0])
  ap.add_argument("--runs", type=int, default=200, help="simulated runs for coverage and identifiability")
  ap.add_argument("--pairs", type=int, default=200, help="simulated pairs of recipes")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--out", default=None, help="directory for calibration.json and calibration.md")
  ap.add_argument("--only", choices=("real", "coverage", "pairs", "ident"), default=None,
                  help="run one study (they are independent; run them as separate processes)")
  ap.add_argument("--real-runs", default=None, help="directory of real runs (default analysis/real_runs)")
  ap.add_argument("--axis", choices=AXES + ("both",), default="both",
                  help="x-axis of the real runs: compute (as logged), step (free of compilation and "
                       "evaluation stalls), or both (two tables)")
  args = ap.parse_args(argv)
  out = Path(args.out) if args.out else None
  if out:
    out.mkdir(parents=True, exist_ok=True)
  axes = AXES if args.axis == "both" else (args.axis,)
  studies = {"real": (lambda: {"axes": {a: real_study(args.real_runs, seed=args.seed, axis=a) for a in axes}},
                      lambda res: "\n".join(markdown_real(r) for r in res["axes"].values())),
             "coverage": (lambda: coverage_study(args.runs, seed=args.seed), markdown_coverage),
             "pairs": (lambda: pairs_study(args.pairs, seed=args.seed + 1), markdown_pairs),
             "ident": (lambda: identifiability_study(args.runs, seed=args.seed + 2), markdown_ident)}
  for name, (run, md) in studies.items():
    if args.only and name != args.only:
      continue
    t0 = time.time()
    try:
      res = run()
    except AnalysisError as e:
      print(f"error: {e}", file=sys.stderr)
      return 2
    text = md(res)
    print(text + f"({name}: {time.time() - t0:.0f} s)\n", flush=True)
    if out:
      (out / f"{name}.md").write_text(text, encoding="utf-8")
      (out / f"{name}.json").write_text(json.dumps(res, indent=1) + "\n", encoding="utf-8")
  return 0


if __name__ == "__main__":
  sys.exit(main())
