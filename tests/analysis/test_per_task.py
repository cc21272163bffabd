"""Per-task Eq. 1 fits of a task mixture (issue 16): `analysis.fit --per-task` / `--metric
val_pass_rate/<task>` recover the paper's math+code curves (Table 1), one panel each."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.fit import fit_runs, resolve_metrics
from analysis.metrics import append_metrics, task_metric_keys
from analysis.synthetic import TABLE1, synthetic_curve

REPO = Path(__file__).resolve().parents[2]


def _mixture_run(run_dir, seed=0, dA=0.0):
  """A mixture run: math and code curves from Table 1 (math+code rows), overall = their mean."""
  curves = {}
  for task, name in (("math", "mathcode_math"), ("code", "mathcode_code")):
    C_mid, B, A = TABLE1[name]
    C, y, _ = synthetic_curve(A + dA, B, C_mid, 0.3, sigma=0.005, c_start=200, c_stop=16000,
                              c_step=200, seed=seed + len(task))
    curves[task] = (C, y)
  C = curves["math"][0]
  append_metrics(run_dir, {"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.3,
                           "val_pass_rate/math": 0.3, "val_pass_rate/code": 0.3,
                           "data/code/malformed": 0})
  for i, c in enumerate(C):
    m, k = float(curves["math"][1][i]), float(curves["code"][1][i])
    append_metrics(run_dir, {"step": i + 1, "compute_hours": float(c), "val_pass_rate": (m + k) / 2,
                             "val_pass_rate/math": m, "val_pass_rate/code": k})


def test_per_task_fits_recover_math_and_code(tmp_path):
  run = tmp_path / "mix"
  _mixture_run(run)
  assert task_metric_keys(run) == ["val_pass_rate/math", "val_pass_rate/code"]
  assert resolve_metrics([run], "per_task") == ["val_pass_rate", "val_pass_rate/math",
                                                "val_pass_rate/code"]
  res = fit_runs([run], tmp_path / "out", n_boot=30, progress=False, metrics="per_task")
  by = {r["metric"]: r for r in res}
  assert list(by) == ["val_pass_rate", "val_pass_rate/math", "val_pass_rate/code"]
  for key, name in (("val_pass_rate/math", "mathcode_math"), ("val_pass_rate/code", "mathcode_code")):
    C_mid, B, A = TABLE1[name]
    r = by[key]
    assert abs(r["A"] - A) < 0.015 and abs(r["B"] / B - 1) < 0.15, (key, r["A"], r["B"])
    assert r["r2"] > 0.98 and r["R0"] == pytest.approx(0.3)
  # The code curve is the slower one (B 1.09 vs 2.05), as in the paper's figure.
  assert by["val_pass_rate/code"]["B"] < by["val_pass_rate/math"]["B"]
  png = (tmp_path / "out" / "curves.png").read_bytes()
  assert png[:8] == b"\x89PNG\r\n\x1a\n"
  w = int.from_bytes(png[16:20], "big")
  assert w >= 3 * 500                                  # three panels side by side
  assert len(json.loads((tmp_path / "out" / "fit.json").read_text())) == 3


def test_cli_metric_and_per_task_compare(tmp_path):
  a, b = tmp_path / "fast", tmp_path / "slow"
  _mixture_run(a, seed=1)
  _mixture_run(b, seed=2, dA=-0.06)
  out = tmp_path / "one"
  p = subprocess.run([sys.executable, "-m", "analysis.fit", str(a), "--metric", "val_pass_rate/code",
                      "--out", str(out), "--n-boot", "20", "--no-progress"],
                     cwd=REPO, capture_output=True, text=True, timeout=300)
  assert p.returncode == 0, p.stderr
  res = json.loads((out / "fit.json").read_text())
  assert [r["metric"] for r in res] == ["val_pass_rate/code"] and "[code]" in p.stdout
  out2 = tmp_path / "cmp"
  res = fit_runs([a, b], out2, n_boot=20, progress=False, metrics="per_task")
  assert len(res) == 6
  for name in ("compare.md", "compare-math.md", "compare-code.md", "compare-code.png"):
    assert (out2 / name).exists(), name
  for task in ("math", "code"):       # per task, the run with the higher A (by 0.06 > 0.02) wins
    rows = [r for r in res if r["metric"] == f"val_pass_rate/{task}"]
    assert rows[0]["comparison"]["mode"] == "A" and rows[0]["comparison"]["winner"] == "fast"
    assert rows[0]["A"] - rows[1]["A"] == pytest.approx(0.06, abs=0.02)
  p = subprocess.run([sys.executable, "-m", "analysis.fit", str(a), "--metric", "val_pass_rate/bogus",
                      "--out", str(tmp_path / "bad")], cwd=REPO, capture_output=True, text=True,
                     timeout=120)
  assert p.returncode == 2 and "val_pass_rate/bogus" in p.stderr
