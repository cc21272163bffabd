"""The metrics contract: ``RUN_DIR/metrics.jsonl`` (+ ``RUN_DIR/config.json``), reader and writer.

See ``docs/METRICS.md``. Evaluation lines carry at least ``step`` (int), ``compute_hours`` (float,
accelerator-hours spent so far, generation + training) and ``val_pass_rate`` (float in [0, 1]).
Lines without ``val_pass_rate`` (train metrics) are ignored by the reader.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
import warnings
from typing import Any, Mapping

import numpy as np

from scalerl_jax import storage
from scalerl_jax.types import FORECAST_AXES

from analysis.errors import (
  ForecastInputError,
  MetricsFormatError,
  NonFiniteError,
  NonIncreasingComputeError,
  PassRateRangeError,
  TooFewPointsError,
)

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.json"
EVAL_KEYS = ("step", "compute_hours", "val_pass_rate")

TASK_PREFIX = "val_pass_rate/"   # per-task pass rates of a task mixture: val_pass_rate/<task>

__all__ = ["RunData", "KL_ALARM", "is_kl_alarm", "read_run", "read_metrics_lines", "append_metrics", "write_config",
      "validate_curve", "task_metric_keys", "on_axis", "AXES", "AXIS_UNITS", "METRICS_FILE", "CONFIG_FILE", "TASK_PREFIX"]


def _to_builtin(value: Any) -> Any:
  """Convert numpy scalars/arrays (and nested containers) into JSON-serializable builtins."""
  if isinstance(value, Mapping):
    return {str(k): _to_builtin(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_to_builtin(v) for v in value]
  if isinstance(value, np.ndarray):
    return _to_builtin(value.tolist())
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    return float(value)
  return value


def append_metrics(run_dir: str | os.PathLike, record: Mapping[str, Any]) -> storage.AnyPath:
  """Append one JSON object as a line to ``run_dir/metrics.jsonl`` (creating the directory).

    numpy scalars/arrays are converted to plain numbers/lists. An evaluation record must hold
    ``step``, ``compute_hours`` and ``val_pass_rate`` (see docs/METRICS.md); this is checked when
    ``val_pass_rate`` is present. Returns the path of the metrics file.
    """
  if not isinstance(record, Mapping):
    raise MetricsFormatError(f"append_metrics needs a dict, got {type(record).__name__}; "
                 "pass e.g. {'step': 100, 'compute_hours': 1.5, 'val_pass_rate': 0.4}")
  rec = _to_builtin(record)
  if "val_pass_rate" in rec:
    _check_eval_record(rec, where="append_metrics")
  storage.makedirs(str(run_dir))
  path = storage.path(run_dir) / METRICS_FILE
  try:
    line = json.dumps(rec, allow_nan=False)
  except (TypeError, ValueError) as exc:
    raise MetricsFormatError(f"append_metrics: record is not JSON-serializable or holds NaN/inf "
                 f"({exc}); convert values to finite int/float/str") from None
  storage.append_text(str(path), line + "\n")   # gs://: the object is rewritten
  return path


def write_config(run_dir: str | os.PathLike, config: Mapping[str, Any]) -> storage.AnyPath:
  """Write ``run_dir/config.json`` (pretty-printed, numpy values converted)."""
  storage.makedirs(str(run_dir))
  path = storage.path(run_dir) / CONFIG_FILE
  path.write_text(json.dumps(_to_builtin(config), indent=2, sort_keys=True) + "\n", encoding="utf-8")
  return path


def _check_eval_record(rec: Mapping[str, Any], where: str) -> None:
  for key in EVAL_KEYS:
    if key not in rec:
      raise MetricsFormatError(f"{where}: evaluation line lacks '{key}'; every line with "
                   "val_pass_rate must also carry step and compute_hours")
  if isinstance(rec["step"], bool) or not isinstance(rec["step"], numbers.Integral):
    raise MetricsFormatError(f"{where}: 'step' must be an int, got {rec['step']!r}")
  for key in ("compute_hours", "val_pass_rate"):
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
      raise MetricsFormatError(f"{where}: '{key}' must be a number, got {v!r}")
    if not math.isfinite(v):
      raise NonFiniteError(f"{where}: '{key}' is {v} at step {rec['step']}; log only finite values")
  if not 0.0 <= rec["val_pass_rate"] <= 1.0:
    raise PassRateRangeError(f"{where}: val_pass_rate={rec['val_pass_rate']} at step {rec['step']} "
                 "is outside [0, 1]; log a fraction, not a percentage")
  if rec["compute_hours"] < 0:
    raise NonIncreasingComputeError(f"{where}: compute_hours={rec['compute_hours']} at step "
                    f"{rec['step']} is negative; log cumulative accelerator-hours")


def read_metrics_lines(path: str | os.PathLike) -> list[dict]:
  """Parse a metrics.jsonl file into a list of dicts (blank lines skipped)."""
  path = storage.path(path)
  if not path.is_file():
    raise MetricsFormatError(f"no metrics file at {path}; pass a run directory holding {METRICS_FILE}")
  out = []
  with storage.open(str(path), "r", encoding="utf-8") as fh:
    for lineno, line in enumerate(fh, 1):
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as exc:
        raise MetricsFormatError(f"{path}:{lineno}: not valid JSON ({exc.msg}); "
                     "each line must be one JSON object") from None
      if not isinstance(obj, dict):
        raise MetricsFormatError(f"{path}:{lineno}: a JSON {type(obj).__name__}, not an object; "
                     "each line must be one JSON object")
      out.append(obj)
  return out


#: The train-line flag of a KL(generator || learner) alarm (scalerl_jax/training/health.py).
KL_ALARM = "health/kl_alarm"


def is_kl_alarm(rec: Mapping[str, Any]) -> bool:
  """Whether a metrics line is a train line whose KL(generator || learner) alarm fired (with the
  compute it fired at): what ``RunData.alarms`` holds and what analysis.real_runs keeps."""
  return bool(rec.get(KL_ALARM)) and "compute_hours" in rec


@dataclasses.dataclass
class RunData:
  """Evaluation curve of one run: compute (hours) and validation pass rate, plus its R0."""

  name: str
  compute: np.ndarray       # compute_hours of evaluation lines, strictly increasing
  value: np.ndarray         # val_pass_rate
  step: np.ndarray
  r0: float                 # measured initial value (first evaluation)
  config: dict = dataclasses.field(default_factory=dict)
  run_dir: str | None = None
  #: compute_hours of the train lines whose KL(generator || learner) alarm fired
  #: (``health/kl_alarm``): an unstable phase (analysis.posterior ``unstable_at``)
  alarms: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0))

  def window(self, cutoff: float | None = None, fit_until: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Points usable for a fit: compute > 0, compute >= cutoff and compute <= fit_until."""
    m = self.compute > 0
    if cutoff is not None:
      m &= self.compute >= cutoff
    if fit_until is not None:
      m &= self.compute <= fit_until
    return self.compute[m], self.value[m]


def validate_curve(compute, value, *, value_range=(0.0, 1.0), min_points: int = 1,
          what: str = "curve") -> tuple[np.ndarray, np.ndarray]:
  """Check a (compute, value) curve and return float arrays; raises a one-line AnalysisError."""
  c = np.asarray(compute, dtype=float).ravel()
  v = np.asarray(value, dtype=float).ravel()
  if c.shape != v.shape:
    raise MetricsFormatError(f"{what}: compute has {c.size} points but values have {v.size}; "
                 "pass arrays of equal length")
  if c.size < min_points:
    raise TooFewPointsError(f"{what}: {c.size} evaluation points, need at least {min_points}; "
                "evaluate more often or lower the cutoff / raise fit_until")
  bad = ~np.isfinite(c) | ~np.isfinite(v)
  if bad.any():
    i = int(np.argmax(bad))
    raise NonFiniteError(f"{what}: NaN/inf at point {i} (compute={c[i]}, value={v[i]}); "
               "drop or fix non-finite evaluations")
  if c.size > 1 and np.any(np.diff(c) <= 0):
    i = int(np.argmax(np.diff(c) <= 0))
    raise NonIncreasingComputeError(f"{what}: compute does not increase at point {i + 1} "
                    f"({c[i]} -> {c[i + 1]}); compute_hours must be cumulative "
                    "and strictly increasing (remove duplicate evaluations)")
  if np.any(c < 0):
    raise NonIncreasingComputeError(f"{what}: negative compute {c.min()}; compute_hours must be >= 0")
  if value_range is not None:
    lo, hi = value_range
    out = (v < lo) | (v > hi)
    if out.any():
      i = int(np.argmax(out))
      raise PassRateRangeError(f"{what}: value {v[i]} at compute {c[i]} is outside "
                   f"[{lo}, {hi}]; pass rates must be fractions (divide percentages by 100)")
  return c, v


def read_run(run_dir: str | os.PathLike, *, name: str | None = None,
       value_key: str = "val_pass_rate", value_range=(0.0, 1.0)) -> RunData:
  """Read ``run_dir/metrics.jsonl`` (evaluation lines only) and ``run_dir/config.json``.

    R0 is the value of the first evaluation line, which should be the step-0 evaluation
    (``compute_hours == 0``); a warning is issued otherwise.
    """
  run_dir = storage.path(run_dir)      # a local directory or gs://BUCKET/PATH
  if not run_dir.is_dir():
    raise MetricsFormatError(f"run directory {run_dir} does not exist; pass a directory holding {METRICS_FILE}")
  lines = read_metrics_lines(run_dir / METRICS_FILE)
  evals = [r for r in lines if value_key in r]
  for r in evals:
    if value_key == "val_pass_rate":
      _check_eval_record(r, where=str(run_dir / METRICS_FILE))
    elif "compute_hours" not in r:
      raise MetricsFormatError(f"{run_dir}: a line with '{value_key}' lacks 'compute_hours'")
  if len(evals) < 2:
    raise TooFewPointsError(f"{run_dir / METRICS_FILE}: {len(evals)} evaluation lines (with "
                f"{value_key}), need at least 2; run longer or evaluate more often")
  c = np.array([float(r["compute_hours"]) for r in evals])
  v = np.array([float(r[value_key]) for r in evals])
  step = np.array([int(r.get("step", i)) for i, r in enumerate(evals)])
  c, v = validate_curve(c, v, value_range=value_range, what=str(run_dir / METRICS_FILE))
  if c[0] != 0:
    warnings.warn(f"{run_dir}: first evaluation is at compute_hours={c[0]}, not 0; using its "
           "value as R0 (log a step-0 evaluation to measure R0)", stacklevel=2)
  config = {}
  cfg_path = run_dir / CONFIG_FILE
  if cfg_path.is_file():
    try:
      config = json.loads(cfg_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
      raise MetricsFormatError(f"{cfg_path}: not valid JSON ({exc.msg}); rewrite it with write_config") from None
  alarms = np.array(sorted(float(r["compute_hours"]) for r in lines if is_kl_alarm(r)), float)
  return RunData(name=name or (run_dir.name if storage.is_remote(run_dir) else run_dir.resolve().name), compute=c, value=v, step=step, r0=float(v[0]),
          config=config, run_dir=str(run_dir), alarms=alarms)


def task_metric_keys(run_dir: str | os.PathLike) -> list[str]:
  """The per-task pass-rate keys (``val_pass_rate/<task>``) of a run's evaluation lines, in the
    order they first appear ([] for a one-task run)."""
  keys: list[str] = []
  for rec in read_metrics_lines(storage.path(run_dir) / METRICS_FILE):
    if "val_pass_rate" in rec:
      keys += [k for k in rec if k.startswith(TASK_PREFIX) and k not in keys]
  return keys


AXES = FORECAST_AXES   # declared below the config layer (scalerl_jax/types.py)
#: the unit of each axis in messages and tables
AXIS_UNITS = {"compute": "h", "step": "steps"}


def on_axis(run: RunData, axis: str) -> RunData:
  """``run`` with its x-axis replaced: ``compute`` (as logged: ``compute_hours``) or ``step`` (the
    evaluation's training step, its KL alarms moved to the steps they fell at). A tiny run's
    wall-clock compute holds compilation stalls that do not grow with RL (docs/ANALYSIS.md
    "the x-axis carries start-up and recompilation", 2026-12-05, 2-core Intel Xeon); its steps are also its FLOPs (a fixed, padded batch per step)."""
  if axis not in AXES:
    raise ForecastInputError(f"axis {axis!r}: expected one of {AXES}")
  if axis == "compute":
    return run
  alarms = np.interp(run.alarms, run.compute, run.step) if len(run.alarms) else run.alarms
  return dataclasses.replace(run, compute=run.step.astype(float), alarms=alarms)
