"""Fit Eq. 1 to runs: ``python -m analysis.fit RUN_DIR [RUN_DIR ...] [--fit-until H] [--cutoff H] --out DIR``.

``--metric val_pass_rate/code`` fits one task of a mixture; ``--per-task`` fits the overall pass rate
and every task's, one panel each in curves.png (the paper's math+code figure).

Writes ``DIR/fit.json`` (one object per run), ``DIR/curves.png`` and, for several runs,
``DIR/compare.md`` and ``DIR/compare.png``. ``fit_runs`` does the same from Python.
"""

from __future__ import annotations

import argparse
import json
import sys

from analysis.compare import A_TOLERANCE, compare_runs, comparison_markdown
from analysis.errors import AnalysisError
from analysis.metrics import TASK_PREFIX, read_run, task_metric_keys
from analysis.plots import plot_comparison, plot_curve_panels, plot_curves
from analysis.scaling import fit_power_law, fit_sigmoid, paper_grids
from analysis.uncertainty import bootstrap, extrapolate
from scalerl_jax import storage

__all__ = ["fit_runs", "resolve_metrics", "metric_slug", "PER_TASK", "main"]


PER_TASK = "per_task"   # fit_runs(metrics=PER_TASK): the overall pass rate and every task's


def resolve_metrics(run_dirs, metrics=None) -> list[str]:
  """The metric keys to fit: None -> ["val_pass_rate"]; "per_task" -> "val_pass_rate" plus every
    ``val_pass_rate/<task>`` all runs carry; a list -> itself (an unknown key fails in read_run)."""
  if metrics is None:
    return ["val_pass_rate"]
  if isinstance(metrics, str) and metrics != PER_TASK:
    return [metrics]
  if metrics == PER_TASK:
    keys = None
    for d in run_dirs:
      k = task_metric_keys(d)
      keys = k if keys is None else [x for x in keys if x in k]
    return ["val_pass_rate"] + (keys or [])
  return list(metrics)


def metric_slug(metric: str) -> str:
  """Short name of a metric for titles and file names: ``val_pass_rate/code`` -> ``code``."""
  if metric.startswith(TASK_PREFIX):
    return metric[len(TASK_PREFIX):]
  return metric.replace("/", "_")


def fit_runs(run_dirs, out_dir, fit_until: float | None = None, cutoff: float | None = None, *,
       n_boot: int = 1000, seed: int = 0, grid: str = "auto", tol: float = A_TOLERANCE,
       progress: bool = True, names=None, metrics=None) -> list[dict]:
  """Fit every run, bootstrap CIs, extrapolate past ``fit_until``, compare; write the outputs.

    ``metrics``: the evaluation key(s) to fit: None = ``val_pass_rate``; a key such as
    ``val_pass_rate/code``; a list; or ``"per_task"`` = the overall rate and every task's
    (task mixtures log ``val_pass_rate/<task>``). Several metrics are fitted independently and
    drawn side by side in curves.png (one panel each); comparisons of several runs are made per
    metric (``compare.md`` for the first, ``compare-<task>.md``/``.png`` for the others).

    Returns the list written to ``out_dir/fit.json``: per (metric, run) ``metric``, ``run``,
    ``run_dir``, ``A``, ``B``, ``C_mid``, ``R0``, ``r2``, ``sse``, ``n_points``, ``c_range``,
    ``grid_winner``, ``ci`` ({A, B, C_mid} -> [lo, hi]), ``power_law`` and, with ``fit_until``,
    ``prediction``.
    """
  if grid not in ("auto", "paper"):
    raise ValueError(f"grid={grid!r} is unknown; use 'auto' (from the data) or 'paper'")
  run_dirs = [storage.path(d) for d in run_dirs]   # local or gs:// (scalerl_jax.storage)
  if not run_dirs:
    raise ValueError("no run directories given; pass at least one RUN_DIR holding metrics.jsonl")
  out = storage.path(out_dir)
  storage.makedirs(str(out_dir))
  keys = resolve_metrics(run_dirs, metrics)
  results, panels = [], []
  for i, metric in enumerate(keys):
    res, entries = _fit_metric(run_dirs, out, metric, "" if i == 0 else "-" + metric_slug(metric),
                               fit_until, cutoff, n_boot=n_boot, seed=seed, grid=grid, tol=tol,
                               progress=progress, names=names)
    results += res
    panels.append((metric_slug(metric), entries))
  if len(panels) == 1:
    plot_curves(panels[0][1], out / "curves.png")
  else:
    plot_curve_panels(panels, out / "curves.png")
  (out / "fit.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
  return results


def _fit_metric(run_dirs, out: storage.AnyPath, metric: str, suffix: str, fit_until, cutoff, *, n_boot, seed,
                grid, tol, progress, names) -> tuple[list[dict], list[dict]]:
  """fit_runs for one metric: (fit.json records, plot entries); writes compare<suffix>.md/.png."""
  grids = paper_grids() if grid == "paper" else None
  runs = [read_run(d, name=(names[i] if names else None), value_key=metric)
          for i, d in enumerate(run_dirs)]
  if len({r.name for r in runs}) != len(runs):  # disambiguate equal basenames
    for i, r in enumerate(runs):
      r.name = f"{i}:{r.name}"
  results, entries, fits = [], [], []
  for run in runs:
    if fit_until is not None:
      ex = extrapolate(*run.window(cutoff), run.r0, fit_until, n_boot=n_boot, seed=seed, grids=grids,
               progress=progress)
      fit, boot, pred = ex["fit"], ex["bootstrap"], ex["prediction"]
    else:
      Cw, yw = run.window(cutoff)
      fit = fit_sigmoid(Cw, yw, run.r0, grids=grids)
      boot = bootstrap(Cw, yw, run.r0, n_boot=n_boot, seed=seed, grids=grids, fit=fit, progress=progress)
      pred = None
    pl = fit_power_law(*run.window(cutoff, fit_until))
    rec = {"metric": metric, "run": run.name, "run_dir": run.run_dir, "A": fit.A, "B": fit.B,
        "C_mid": fit.C_mid, "R0": fit.R0,
        "r2": fit.r2, "sse": fit.sse, "n_points": fit.n_points, "c_range": list(fit.c_range),
        "cutoff": cutoff, "fit_until": fit_until, "grid": grid, "grid_winner": fit.grid_winner,
        "ci": boot["ci"], "ci_level": boot["level"], "n_boot": n_boot,
        "power_law": {"A": pl.A, "B": pl.B, "D": pl.D, "r2": pl.r2}}
    if pred is not None:
      rec["prediction"] = pred
    results.append(rec)
    fits.append(fit)
    entries.append({"run": run, "fit": fit, "prediction": pred, "cutoff": cutoff, "fit_until": fit_until})
  if len(runs) > 1:
    cmp = compare_runs(runs, fits, tol=tol, cutoff=cutoff, fit_until=fit_until, grids=grids)
    (out / f"compare{suffix}.md").write_text(comparison_markdown(cmp), encoding="utf-8")
    ci = {r["run"]: r["ci"] for r in results}
    if cmp["mode"] == "shared_A":  # B intervals at the shared A
      for run in runs:
        b = bootstrap(*run.window(cutoff, fit_until), run.r0, n_boot=max(100, n_boot // 5), seed=seed,
               grids=grids, A=cmp["A_shared"], progress=progress)
        ci[run.name] = b["ci"]
        cmp["rows"][[r["run"] for r in cmp["rows"]].index(run.name)]["ci_B_shared"] = b["ci"]["B"]
    plot_comparison(runs, fits, cmp, out / f"compare{suffix}.png", ci=ci)
    for rec in results:
      row = next(r for r in cmp["rows"] if r["run"] == rec["run"])
      rec["comparison"] = {k: v for k, v in row.items() if k != "run"} | {
        "mode": cmp["mode"], "A_shared": cmp["A_shared"], "winner": cmp["winner"]}
  return results, entries


def main(argv=None) -> int:
  """Command-line entry point (see the module docstring)."""
  ap = argparse.ArgumentParser(prog="python -m analysis.fit", description=(__doc__ or "").split("\n")[0])
  ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="directories holding metrics.jsonl")
  ap.add_argument("--fit-until", type=float, default=None, help="fit on compute <= HOURS, predict beyond")
  ap.add_argument("--cutoff", type=float, default=None, help="drop points with compute < HOURS (paper: 1500)")
  ap.add_argument("--out", required=True, help="output directory")
  ap.add_argument("--n-boot", type=int, default=1000, help="bootstrap resamples (default 1000)")
  ap.add_argument("--grid", choices=("auto", "paper"), default="auto", help="search grids (default: from data)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--tol", type=float, default=A_TOLERANCE, help="A tolerance for the shared-A comparison")
  ap.add_argument("--no-progress", action="store_true", help="hide the bootstrap progress bar")
  ap.add_argument("--metric", action="append", default=None, metavar="KEY",
                  help="evaluation key to fit (repeatable), e.g. val_pass_rate/code; default "
                       "val_pass_rate")
  ap.add_argument("--per-task", action="store_true",
                  help="fit val_pass_rate and every val_pass_rate/<task> (task mixtures), side by side")
  args = ap.parse_args(argv)
  if args.per_task and args.metric:
    ap.error("--per-task and --metric are exclusive")
  metrics = PER_TASK if args.per_task else args.metric
  try:
    res = fit_runs(args.run_dirs, args.out, fit_until=args.fit_until, cutoff=args.cutoff, n_boot=args.n_boot,
            seed=args.seed, grid=args.grid, tol=args.tol, progress=not args.no_progress,
            metrics=metrics)
  except AnalysisError as exc:
    print(f"error: {exc}", file=sys.stderr)
    return 2
  for r in res:
    tag = "" if r["metric"] == "val_pass_rate" else f" [{metric_slug(r['metric'])}]"
    line = f"{r['run']}{tag}: A={r['A']:.4f} B={r['B']:.3f} C_mid={r['C_mid']:.5g} R2={r['r2']:.4f}"
    if "prediction" in r:
      p = r["prediction"]
      line += f" | final true {p['final_true']:.4f} pred {p['final_pred']:.4f} (|err| {p['abs_error']:.4f})"
    print(line)
  print(f"wrote {storage.join(args.out, 'fit.json')}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
