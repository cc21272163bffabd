"""Eq. 1 (ScaleRL) analysis: metrics I/O, sigmoid fits, bootstrap, extrapolation, run comparison.

No JAX. See docs/ANALYSIS.md and docs/METRICS.md. Main entry points::

    from analysis import read_run, fit_sigmoid, bootstrap, extrapolate, compare_runs, fit_runs
"""

from analysis.errors import AnalysisError
from analysis.metrics import RunData, append_metrics, read_run, write_config
from analysis.scaling import (FitResult, Grids, default_grids, fit_power_law, fit_sigmoid, fit_sigmoid_free,
               paper_grids, sigmoid_curve)
from analysis.uncertainty import bootstrap, extrapolate
from analysis.compare import compare_runs, comparison_markdown


def fit_runs(*args, **kwargs):
  """Fit, bootstrap, extrapolate and compare run directories; see ``analysis.fit.fit_runs``."""
  from analysis.fit import fit_runs as _fit_runs  # local: `python -m analysis.fit` (runpy warns if the package imported it)

  return _fit_runs(*args, **kwargs)


__all__ = ["AnalysisError", "RunData", "append_metrics", "read_run", "write_config", "FitResult", "Grids",
      "default_grids", "paper_grids", "fit_sigmoid", "fit_sigmoid_free", "fit_power_law", "sigmoid_curve",
      "bootstrap", "extrapolate", "compare_runs", "comparison_markdown", "fit_runs"]
