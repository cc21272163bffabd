"""The live forecast's refit time per evaluation with a family of 20 runs (issue #48: < 2 s).

``python -m bench.family_refit`` - a stored real run (``xeon_qwen_dapo_s30``) replayed evaluation by
evaluation into a scratch workdir; after each one ``LiveForecast.compute`` (the live refit, step
axis, 4000 draws) with ``forecast.family`` = 20 stored Xeon runs of other recipes (ours) and with the
same 20 as ``forecast.references`` (the peer: the same-setup path, analysis/reference.py). Prints every
refit's wall and CPU seconds; the last stdout line is one JSON object (``ratio`` > 1: ours faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import numpy as np

from analysis import real_runs
from bench.common import last_line
from scalerl_jax.training.health import LiveForecast

TARGET = "xeon_qwen_dapo_s30"


def members(n: int) -> list[str]:
  """``n`` stored Xeon runs of recipes other than the target's (its siblings first, then seeds)."""
  names = [r for r in real_runs.RUNS if r.startswith("xeon_") and not r.startswith(("xeon_qwen_dapo", "xeon_scalerl"))]
  names += [r for r in real_runs.RUNS if r.startswith("xeon_scalerl")]
  return [os.path.join(real_runs.OUT, r) for r in names[:n]]


def replay(kind: str, dirs: list[str], first: int) -> list[tuple[float, float]]:
  """(wall s, CPU s) of each refit while the target's evaluations arrive one by one."""
  lines = open(os.path.join(real_runs.OUT, TARGET, "metrics.jsonl")).read().splitlines()
  evals = [json.loads(l) for l in lines]
  with tempfile.TemporaryDirectory() as tmp:
    wd = os.path.join(tmp, TARGET)
    os.makedirs(wd)
    shutil.copy(os.path.join(real_runs.OUT, TARGET, "command.txt"), wd)
    joined = ",".join(dirs)
    fc = LiveForecast(wd, lambda rec: None, axis="step", n_draws=4000,
                      family=joined if kind == "family" else "", references=joined if kind == "references" else "")
    out = []
    for k in range(first, len(lines) + 1):
      with open(os.path.join(wd, "metrics.jsonl"), "w") as f:
        f.write("\n".join(lines[:k]) + "\n")
      last = evals[k - 1]
      if "val_pass_rate" not in last:
        continue
      t, c = time.perf_counter(), time.process_time()
      rec = fc.compute(int(last["step"]), float(last["compute_hours"]), 300)
      if rec is not None and "forecast/A" in rec:
        out.append((time.perf_counter() - t, time.process_time() - c))
  return out


def main(argv=None) -> dict:
  """Run the benchmark; returns the result dict (also printed as the last stdout line)."""
  ap = argparse.ArgumentParser(prog="python -m bench.family_refit", description=(__doc__ or "").splitlines()[0])
  ap.add_argument("--members", type=int, default=20)
  ap.add_argument("--first", type=int, default=6, help="metrics lines present at the first refit")
  a = ap.parse_args(argv)
  dirs = members(a.members)
  res = {}
  for kind in ("family", "references"):
    got = replay(kind, dirs, a.first)
    wall = np.array([w for w, _ in got])
    cpu = np.array([c for _, c in got])
    res[kind] = {"n": len(got), "median_s": float(np.median(wall)), "max_s": float(wall.max()),
                 "median_cpu_s": float(np.median(cpu)), "max_cpu_s": float(cpu.max())}
    print(f"{kind:>10} x {len(dirs)}: {len(got)} refits, wall median {res[kind]['median_s']:.2f} s, max "
          f"{res[kind]['max_s']:.2f} s; CPU median {res[kind]['median_cpu_s']:.2f} s, max {res[kind]['max_cpu_s']:.2f} s")
  return last_line(res["family"]["median_s"], res["references"]["median_s"], "s", higher_is_better=False,
                   family=res["family"], references=res["references"], members=len(dirs), budget_s=2.0)


if __name__ == "__main__":
  main()
