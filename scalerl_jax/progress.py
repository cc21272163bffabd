"""Liveness from progress: a process marks each unit of progress by touching a file, and its pod's
liveness probe fails when the file is older than a bound (docs/RELIABILITY.md "Liveness from
progress"). No project imports: the learner, the buffer and the generators use it.

  Beacon(path).tick()                 # after a learner step, a WAL commit, a served lease
  probe_command(path, max_age_s)      # the exec probe the rendered manifests run
  age_s(path)                         # seconds since the last tick (inf without one)

A port that accepts connections says only that a thread answers: a learner stuck in a collective
or a buffer whose WAL disk is full passes a TCP probe forever. A tick is written at most once per
`min_interval_s` (one utime, off the hot path otherwise).
"""
from __future__ import annotations

import math
import os
import threading
import time


class Beacon:
  """Touches `path` at progress ("" = a no-op beacon)."""

  def __init__(self, path: str = "", min_interval_s: float = 1.0):
    self.path, self.min_interval_s = path, float(min_interval_s)
    self._last = -math.inf
    self._lock = threading.Lock()

  def tick(self) -> None:
    """One unit of progress: sets the file's mtime to now (throttled; never raises)."""
    if not self.path:
      return
    now = time.monotonic()
    with self._lock:
      if now - self._last < self.min_interval_s:
        return
      self._last = now
    try:
      os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
      with open(self.path, "a"):
        os.utime(self.path)
    except OSError:   # a full or read-only disk: the probe then fails, which is the point
      pass


def age_s(path: str) -> float:
  """Seconds since `path` was last touched (inf when it does not exist)."""
  try:
    return time.time() - os.path.getmtime(path)
  except OSError:
    return math.inf


def probe_command(path: str, max_age_s: float) -> list[str]:
  """An exec liveness probe: exit 0 iff `path` was touched within `max_age_s` seconds."""
  check = (f"import os, sys, time; p = {path!r}; "
           f"sys.exit(0 if os.path.exists(p) and time.time() - os.path.getmtime(p) < "
           f"{max_age_s:g} else 1)")
  return ["python", "-c", check]
