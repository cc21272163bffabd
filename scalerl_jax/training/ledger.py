"""Compute ledger: the x-axis of every scaling curve (docs/COMPUTE.md).

Accelerator-hours are counted as the paper counts GPU-hours: devices *held* by a role times the wall
time they were held, whether busy or idle (a generator waiting for admission still occupies its
chip). Roles: `train` (the learner's devices) and `gen` (every generator worker's devices). Time the
learner spends in validation is *not* counted as training compute (the paper evaluates out of band);
it is booked separately as `eval_hours`. With evaluation through the generator fleet
(`eval.mode=fleet`), the generators report the device-seconds their evaluation leases took
(`add_eval_gen`): those are held generator time like any other, but not training generation, so
they move out of the x-axis into `eval_hours` too. `compute_hours` (the x-axis) therefore
excludes evaluation either way; `compute_hours_with_eval` is everything held.

Alongside, analytic FLOPs of what was *processed* (issue #28; docs/COMPUTE.md "What the FLOPs
count"), N = parameters active per token, every real token of a sequence counted once:
  train_flops = 6·N·(prompt + sampled + injected tokens of every row the learner ran forward and
                backward, zero-variance-filtered groups and skipped steps included)
                + 2·N·(tokens re-scored forward-only by the log-prob parity gate)
  gen_flops   = 2·N·(prompt + sampled + injected tokens of every rollout the learner received)
Padding is not in either (the count of the recipe's work must not depend on how the batch is
bucketed); what it would add is `train_pad_flops`. `train_loss_flops` = 6·N·(loss tokens of kept
groups), the useful part (what this ledger counted before issue #28).

The ledger is a small serializable object, so a resumed run continues the axis. The trainer resumes
with `count_gap=True`: the whole wall time from the checkpoint's save to the restore (work thrown
away, downtime, restart) is booked to every role, as a reserved allocation pays it; the parts are
logged in WORKDIR/resumes.jsonl (docs/RELIABILITY.md).
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np


@dataclasses.dataclass(frozen=True)
class StepTokens:
  """Token counts of one learner step, over the rows of the global batch."""
  prompt: int = 0       # prompt tokens, each rollout's own copy of its group's prompt
  sampled: int = 0      # completion tokens the policy sampled (policy_mask True)
  injected: int = 0     # completion tokens injected by the generator (forced interruption)
  padding: int = 0      # positions of the padded [B, T] arrays that hold no token
  loss: int = 0         # loss tokens of kept groups (weight > 0): what the update trains on
  rescored: int = 0     # tokens the parity gate re-scored forward-only this step

  @property
  def processed(self) -> int:
    """Real tokens the learner ran forward and backward (prompt + sampled + injected)."""
    return self.prompt + self.sampled + self.injected

  @classmethod
  def from_arrays(cls, arrays: dict, loss: int, rescored: bool = False) -> "StepTokens":
    """Counts from the learner's batch arrays (protocol.client.batch_to_arrays, padded):
    `prompt_lengths` [B], `completion_lengths` [B], `loss_mask` [B, T] (= policy_mask);
    `loss` is the learner's `tokens` metric; `rescored`: the parity gate ran this step."""
    prompt = int(np.sum(arrays["prompt_lengths"]))
    completion = int(np.sum(arrays["completion_lengths"]))
    sampled = int(np.sum(arrays["loss_mask"]))
    b, t = np.shape(arrays["loss_mask"])
    return cls(prompt=prompt, sampled=sampled, injected=completion - sampled,
               padding=b * t - prompt - completion, loss=int(loss),
               rescored=prompt + completion if rescored else 0)


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
  train_flops: float = 0.0         # 6N x processed + 2N x rescored (module docstring)
  gen_flops: float = 0.0           # 2N x (prompt + sampled + injected) of received rollouts
  train_loss_flops: float = 0.0    # 6N x loss tokens of kept groups
  train_pad_flops: float = 0.0     # 6N x padding positions (not in train_flops)
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
    self.train_flops = self.gen_flops = self.train_loss_flops = self.train_pad_flops = 0.0
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

  def add_step(self, t: StepTokens) -> None:
    """Books one learner step's tokens as FLOPs (module docstring)."""
    n = self.params_active
    self.train_flops += 6.0 * n * t.processed + 2.0 * n * t.rescored
    self.gen_flops += 2.0 * n * t.processed
    self.train_loss_flops += 6.0 * n * t.loss
    self.train_pad_flops += 6.0 * n * t.padding

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
            "train_flops": self.train_flops, "gen_flops": self.gen_flops,
            "train_loss_flops": self.train_loss_flops, "train_pad_flops": self.train_pad_flops}

  def state_dict(self) -> dict:
    self.tick()
    return {k: getattr(self, k) for k in ("train_devices", "gen_devices", "params_active",
                                          "train_seconds", "gen_seconds", "eval_seconds",
                                          "eval_gen_seconds",
                                          "train_flops", "gen_flops", "train_loss_flops",
                                          "train_pad_flops")}

  @classmethod
  def resume(cls, state: dict, saved_at: float | None = None, count_gap: bool = True
             ) -> "ComputeLedger":
    """Restores a ledger; with `count_gap`, the wall time since `saved_at` is booked too."""
    led = cls(**state)
    if count_gap and saved_at is not None:
      led._last = saved_at
      led.tick()
    return led
