"""The CLI (python -m analysis.fit) and fit_runs: outputs, fields, figures."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analysis.fit import fit_runs
from analysis.synthetic import write_synthetic_run

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "analysis" / "examples"


def _png_ok(path):
  import matplotlib.image as mpimg

  assert path.is_file() and path.stat().st_size > 20_000
  img = mpimg.imread(path)
  assert img.shape[0] > 300 and img.shape[1] > 500
  assert img[..., :3].std() > 0.05                      # not a blank canvas
  assert len(np.unique(img[..., :3].reshape(-1, 3), axis=0)) > 50   # many colors drawn


def test_cli_two_runs_with_extrapolation(tmp_path):
  out = tmp_path / "out"
  cmd = [sys.executable, "-m", "analysis.fit", str(EXAMPLES / "scalerl"), str(EXAMPLES / "batch_512"),
      "--cutoff", "1500", "--fit-until", "8000", "--n-boot", "60", "--out", str(out)]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr
  assert "bootstrap" in proc.stderr                         # tqdm progress bar
  res = json.loads((out / "fit.json").read_text())
  assert [r["run"] for r in res] == ["scalerl", "batch_512"]
  for r in res:
    for key in ("run", "A", "B", "C_mid", "R0", "r2", "ci", "prediction", "power_law", "comparison"):
      assert key in r
    assert set(r["ci"]) == {"A", "B", "C_mid"}
    for p in ("A", "B", "C_mid"):
      lo, hi = r["ci"][p]
      assert lo <= hi
    assert r["c_range"][0] >= 1500 and r["c_range"][1] <= 8000 and r["r2"] > 0.9
    pred = r["prediction"]
    assert pred["abs_error"] == pytest.approx(abs(pred["final_pred"] - pred["final_true"]))
    assert pred["abs_error"] < 0.03
  truth = {"scalerl": (0.610, 1.92), "batch_512": (0.605, 1.77)}
  for r in res:
    assert abs(r["A"] - truth[r["run"]][0]) < 0.015
  assert res[0]["comparison"]["mode"] == "shared_A" and res[0]["comparison"]["winner"] == "scalerl"
  md = (out / "compare.md").read_text()
  assert "| 1 | scalerl |" in md and "shared A" in md
  _png_ok(out / "curves.png")
  _png_ok(out / "compare.png")


def test_cli_bad_input_exits_2_with_one_line(tmp_path):
  run = tmp_path / "bad"
  run.mkdir()
  (run / "metrics.jsonl").write_text('{"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.3}\n'
                    '{"step": 1, "compute_hours": 1.0, "val_pass_rate": 55}\n')
  proc = subprocess.run([sys.executable, "-m", "analysis.fit", str(run), "--out", str(tmp_path / "o")],
             cwd=REPO, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 2
  err = proc.stderr.strip()
  assert err.startswith("error:") and "\n" not in err and "outside [0, 1]" in err


def test_fit_runs_single_run_no_extrapolation(tmp_path):
  write_synthetic_run(tmp_path / "code", "mathcode_code", seed=4, c_step=200)
  res = fit_runs([tmp_path / "code"], tmp_path / "out", cutoff=1500, n_boot=50, progress=False)
  assert len(res) == 1 and "prediction" not in res[0] and "comparison" not in res[0]
  r = res[0]
  assert abs(r["A"] - 0.615) < 0.015 and abs(r["B"] / 1.09 - 1) < 0.15 and abs(r["C_mid"] / 1675 - 1) < 0.2
  assert r["power_law"]["A"] > r["A"]
  assert not (tmp_path / "out" / "compare.md").exists()
  _png_ok(tmp_path / "out" / "curves.png")
  assert json.loads((tmp_path / "out" / "fit.json").read_text())[0]["run"] == "code"
