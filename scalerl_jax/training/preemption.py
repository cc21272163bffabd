"""SIGTERM on the learner (preemption, node drain): a final checkpoint only when the pod's grace
period allows it.

Kubernetes sends SIGTERM, waits `terminationGracePeriodSeconds` (launch/gke/render.py sets it from
`checkpoint.termination_grace_s`), then SIGKILLs. A checkpoint cut off by the SIGKILL is no
checkpoint (no manifest: resume skips it), so the learner writes one only when the time left covers
SAFETY x the last save's duration + MARGIN_S; otherwise it logs one line saying the last periodic
checkpoint stands and writes nothing. The handler only records the time: the training loop asks
at its next step boundary (docs/RELIABILITY.md "Preemption")."""
from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Callable

log = logging.getLogger("scalerl.preemption")

SAFETY = 1.5      # a final save must fit 1.5x the last save's duration ...
MARGIN_S = 10.0   # ... plus this (closing the checkpointer, the metrics, the process exit)


class Preemption:
  """Records when SIGTERM came; `final_checkpoint` decides and saves (or logs why not)."""

  def __init__(self, grace_s: float, clock: Callable[[], float] = time.monotonic):
    self.grace_s, self.clock = float(grace_s), clock
    self.at: float | None = None

  def install(self) -> "Preemption":
    """Handles SIGTERM in this process (the main thread only: elsewhere a no-op)."""
    if threading.current_thread() is threading.main_thread():
      signal.signal(signal.SIGTERM, self.on_sigterm)
    return self

  def on_sigterm(self, *_) -> None:
    """The signal handler: remembers the first SIGTERM's time."""
    if self.at is None:
      self.at = self.clock()
      log.warning("SIGTERM: stopping at the next step boundary (grace %.0f s)", self.grace_s)

  @property
  def requested(self) -> bool:
    """Whether SIGTERM came."""
    return self.at is not None

  def left_s(self) -> float:
    """Seconds of the grace period left (the whole period before any SIGTERM)."""
    return self.grace_s - (0.0 if self.at is None else self.clock() - self.at)

  def final_checkpoint(self, save: Callable[[], None], last_save_s: float | None,
                       last_step: int | None) -> bool:
    """Calls `save` when the grace left covers SAFETY * last_save_s + MARGIN_S (no save timed
    yet: never); else logs one line naming the checkpoint that stands. Returns whether it saved."""
    left = self.left_s()
    need = None if last_save_s is None else SAFETY * float(last_save_s) + MARGIN_S
    if need is not None and need <= left:
      save()
      log.warning("SIGTERM: final checkpoint written (%.0f s of grace were left, %.0f s needed)",
                  left, need)
      return True
    log.warning("SIGTERM: no final checkpoint (%.0f s of grace left, %s needed): the last periodic "
                "checkpoint (step %s) stands", left,
                "unknown" if need is None else f"{need:.0f} s", last_step)
    return False
