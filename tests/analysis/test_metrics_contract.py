"""The metrics contract: writer, reader, validation errors."""

import json
import warnings

import numpy as np
import pytest

from analysis.errors import (AnalysisError, MetricsFormatError, NonFiniteError, NonIncreasingComputeError,
               PassRateRangeError, TooFewPointsError)
from analysis.metrics import append_metrics, read_run, validate_curve, write_config


def _write(run_dir, rows):
  for r in rows:
    append_metrics(run_dir, r)


def test_roundtrip_ignores_train_lines_and_converts_numpy(tmp_path):
  run = tmp_path / "run"
  write_config(run, {"lr": np.float32(5e-7), "batch": np.int64(768)})
  append_metrics(run, {"step": 0, "compute_hours": 0.0, "val_pass_rate": 0.3})
  append_metrics(run, {"step": 5, "compute_hours": 0.5, "loss": np.float32(1.25)})        # train line
  append_metrics(run, {"step": np.int64(10), "compute_hours": np.float64(1.0), "val_pass_rate": np.float32(0.5)})
  append_metrics(run, {"step": 20, "compute_hours": 2.0, "val_pass_rate": 0.625, "extra": [1, 2]})
  lines = (run / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 4 and all(isinstance(json.loads(x), dict) for x in lines)
  rd = read_run(run)
  assert rd.name == "run"
  np.testing.assert_array_equal(rd.compute, [0.0, 1.0, 2.0])
  np.testing.assert_allclose(rd.value, [0.3, 0.5, 0.625])
  np.testing.assert_array_equal(rd.step, [0, 10, 20])
  assert rd.r0 == 0.3 and rd.config == {"batch": 768, "lr": pytest.approx(5e-7)}
  C, y = rd.window(cutoff=1.5)
  np.testing.assert_array_equal(C, [2.0])


def test_missing_step0_warns(tmp_path):
  _write(tmp_path, [{"step": 1, "compute_hours": 1.0, "val_pass_rate": 0.3},
           {"step": 2, "compute_hours": 2.0, "val_pass_rate": 0.4}])
  with pytest.warns(UserWarning, match="not 0"):
    assert read_run(tmp_path).r0 == 0.3


def _one_line(exc):
  msg = str(exc.value)
  assert "\n" not in msg and len(msg) > 20
  assert isinstance(exc.value, (AnalysisError, ValueError))
  return msg


@pytest.mark.parametrize("record, err, words", [
  ({"step": 1, "compute_hours": 1.0, "val_pass_rate": 1.5}, PassRateRangeError, "outside [0, 1]"),
  ({"step": 1, "compute_hours": 1.0, "val_pass_rate": 40.0}, PassRateRangeError, "percentage"),
  ({"step": 1, "compute_hours": float("nan"), "val_pass_rate": 0.4}, NonFiniteError, "finite"),
  ({"step": 1, "val_pass_rate": 0.4}, MetricsFormatError, "lacks 'compute_hours'"),
  ({"step": 1.5, "compute_hours": 1.0, "val_pass_rate": 0.4}, MetricsFormatError, "'step' must be an int"),
])
def test_append_rejects_bad_eval_records(tmp_path, record, err, words):
  with pytest.raises(err) as exc:
    append_metrics(tmp_path, record)
  assert words in _one_line(exc)
  assert not (tmp_path / "metrics.jsonl").exists()


def test_reader_errors(tmp_path):
  with pytest.raises(MetricsFormatError) as exc:
    read_run(tmp_path / "nope")
  assert "does not exist" in _one_line(exc)
  (tmp_path / "metrics.jsonl").write_text('{"step": 0, "compute_hours": 0, "val_pass_rate": 0.3}\nnot json\n')
  with pytest.raises(MetricsFormatError) as exc:
    read_run(tmp_path)
  assert "metrics.jsonl:2: not valid JSON" in _one_line(exc)
  (tmp_path / "metrics.jsonl").write_text('{"step": 0, "compute_hours": 0, "val_pass_rate": 0.3}\n')
  with pytest.raises(TooFewPointsError) as exc:
    read_run(tmp_path)
  assert "need at least 2" in _one_line(exc)
  rows = [{"step": i, "compute_hours": c, "val_pass_rate": 0.3 + 0.01 * i} for i, c in enumerate([0, 1, 2, 2, 3])]
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  with pytest.raises(NonIncreasingComputeError) as exc:
    read_run(tmp_path)
  assert "strictly increasing" in _one_line(exc)


def test_validate_curve_errors():
  with pytest.raises(NonFiniteError) as exc:
    validate_curve([1, 2, 3], [0.1, np.nan, 0.2])
  assert "NaN/inf at point 1" in _one_line(exc)
  with pytest.raises(NonIncreasingComputeError) as exc:
    validate_curve([1, 3, 2], [0.1, 0.2, 0.3])
  assert "does not increase at point 2" in _one_line(exc)
  with pytest.raises(PassRateRangeError) as exc:
    validate_curve([1, 2], [0.1, -0.2])
  assert "outside [0.0, 1.0]" in _one_line(exc)
  with pytest.raises(MetricsFormatError) as exc:
    validate_curve([1, 2], [0.1])
  assert "equal length" in _one_line(exc)
  with pytest.raises(TooFewPointsError) as exc:
    validate_curve([1, 2], [0.1, 0.2], min_points=5)
  assert "need at least 5" in _one_line(exc)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    c, v = validate_curve([1, 2], [0.1, 0.2])
  assert c.dtype == float and v.dtype == float


def test_package_does_not_import_jax():
  import subprocess
  import sys

  code = "import sys, analysis, analysis.fit, analysis.synthetic; print('jax' in sys.modules)"
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
  assert out.returncode == 0, out.stderr
  assert out.stdout.strip() == "False"
