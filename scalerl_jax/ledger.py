"""Compute ledger: the x-axis of every scaling curve (docs/COMPUTE.md).

Accelerator-hours are counted as the paper counts GPU-hours: devices *held* by a role times the wall
time they were held, whether busy or idle (a generator waiting for admission still occupies its
chip). Roles: `train` (the learner's devices) and `gen` (every generator worker's devices). Time the
learner spends in validation is *not* counted as training compute (the paper evaluates out of band);
it is booked separately as `eval_hours`. With evaluation through the generator fleet
(`eval.mode=fleet`), the generators report the device-seconds their evaluation leases took
(`add_eval_gen`): those are held generator time like any other, but not training generation, so
they move out of the x-axis into `eval_hours` too. `compute_hours` (the x-axis) therefore
excludes evaluation either way; `compute_hours_with_eval` is everything held. Alongside, analytic FLOPs: 6·N·tokens for a train step
(forward + backward through the policy tokens actually trained) and 2·N·tokens for generation, with
N the parameters active per token.

The ledger is a small serializable object, so a resumed run continues the axis. The trainer resumes
with `count_gap=True`: the whole wall time from the checkpoint's save to the restore (work thrown
away, downtime, restart) is booked to every role, as a reserved allocation pays it; the parts are
logged in WORKDIR/resumes.jsonl (docs/RELIABILITY.md).
"""
from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class ComputeLedger:
  """Device-seconds per role plus analytic FLOPs. Call `tick()` to advance to now."""
  train_devices: int
  gen_devices: int
  params_active: float
  train_seconds: float = 0.0       # device-seconds
  gen_seconds: float = 0.0
  eval_seconds: float = 0.0        # learner device-seconds in evaluation (local eval, waits)
  eval_gen_seconds: float = 0.0    # generator device-seconds on evaluation leases (fleet eval)
  train_flops: float = 0.0
  gen_flops: float = 0.0
  _last: float = dataclasses.field(default_factory=time.time)
  _in_eval: bool = False

  def tick(self, now: float | None = None) -> None:
    """Books the wall time since the last tick to the roles holding devices."""
    now = time.time() if now is None else now
    dt = max(0.0, now - self._last)
    self._last = now
    self.gen_seconds += self.gen_devices * dt
    if self._in_eval:
      self.eval_seconds += self.train_devices * dt
    else:
      self.train_seconds += self.train_devices * dt

  def reset(self) -> None:
    """Zeroes the counters and restarts the clock now."""
    self.train_seconds = self.gen_seconds = self.eval_seconds = self.eval_gen_seconds = 0.0
    self.train_flops = self.gen_flops = 0.0
    self._last, self._in_eval = time.time(), False

  def begin_eval(self) -> None:
    self.tick()
    self._in_eval = True

  def end_eval(self) -> None:
    self.tick()
    self._in_eval = False

  def add_eval_gen(self, device_seconds: float) -> None:
    """Generator device-seconds spent on evaluation leases (reported with fleet results)."""
    self.eval_gen_seconds += max(0.0, float(device_seconds))

  def add_tokens(self, trained: int, generated: int) -> None:
    self.train_flops += 6.0 * self.params_active * trained
    self.gen_flops += 2.0 * self.params_active * generated

  @property
  def compute_hours(self) -> float:
    """Accelerator-hours of training generation + training (the curve's x-axis): evaluation, on
    the learner or on the fleet, is excluded."""
    return (self.train_seconds + max(0.0, self.gen_seconds - self.eval_gen_seconds)) / 3600.0

  def snapshot(self) -> dict:
    self.tick()
    return {"compute_hours": self.compute_hours, "train_hours": self.train_seconds / 3600.0,
            "gen_hours": self.gen_seconds / 3600.0,
            "eval_hours": (self.eval_seconds + self.eval_gen_seconds) / 3600.0,
            "eval_gen_hours": self.eval_gen_seconds / 3600.0,
            "compute_hours_with_eval": (self.train_seconds + self.gen_seconds
                                        + self.eval_seconds) / 3600.0,
            "train_flops": self.train_flops, "gen_flops": self.gen_flops}

  def state_dict(self) -> dict:
    self.tick()
    return {k: getattr(self, k) for k in ("train_devices", "gen_devices", "params_active",
                                          "train_seconds", "gen_seconds", "eval_seconds",
                                          "eval_gen_seconds",
                                          "train_flops", "gen_flops")}

  @classmethod
  def resume(cls, state: dict, saved_at: float | None = None, count_gap: bool = True
             ) -> "ComputeLedger":
    """Restores a ledger; with `count_gap`, the wall time since `saved_at` is booked too."""
    led = cls(**state)
    if count_gap and saved_at is not None:
      led._last = saved_at
      led.tick()
    return led
