"""Error types raised by the analysis package.

Every error is a ``ValueError`` subclass whose message is one line naming the problem and the fix.
"""

from __future__ import annotations

__all__ = [
  "AnalysisError",
  "MetricsFormatError",
  "TooFewPointsError",
  "NonFiniteError",
  "NonIncreasingComputeError",
  "PassRateRangeError",
  "NoImprovementError",
  "ForecastInputError",
]


class AnalysisError(ValueError):
  """Base class of all analysis errors (a ``ValueError``)."""

  def __init__(self, message: str):
    super().__init__(" ".join(str(message).split()))  # force a single line


class MetricsFormatError(AnalysisError):
  """metrics.jsonl / config.json is missing or malformed."""


class TooFewPointsError(AnalysisError):
  """Not enough evaluation points in the fit window."""


class NonFiniteError(AnalysisError):
  """NaN or infinite compute / metric values."""


class NonIncreasingComputeError(AnalysisError):
  """compute_hours does not strictly increase from one evaluation to the next."""


class PassRateRangeError(AnalysisError):
  """A metric value lies outside its declared range (``[0, 1]`` for pass rates)."""


class NoImprovementError(AnalysisError):
  """The metric never rises above R0, so Eq. 1 (A > R0) cannot be fitted."""


class ForecastInputError(AnalysisError):
  """A forecast request that cannot be answered (budget below the data, target out of range)."""
