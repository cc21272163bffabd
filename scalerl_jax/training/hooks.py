"""The trainer's hooks: what runs around each learner step, registered with a cadence.

`Trainer.run` is the loop (pull, step, publish); everything else is a hook it registered:

  before the update  (`BeforeView`: the step, the broadcast batch arrays; returns `HookOut`)
    step0_check     the fresh run's first batch has a reward signal (health.step0_reward_check)
    parity          the log-prob parity gate / periodic re-score (`ParityGate`)
  after the update   (`StepView`: the version just trained, the run's length, the step's record)
    fleet_collect   logs the fleet evaluations that came back            (process 0)
    health          the step's health fields; an abort is raised after tracking (`HealthHook`)
    tracking        writes the step's record (metrics.jsonl, TensorBoard, W&B) (process 0)
    evaluation      every eval.every_steps and at the end (all processes: a local one gathers)
    progress        the progress bar (`Progress`)                        (process 0)
    checkpoint      every checkpoint.every_steps and at the end (`CheckpointHook`; collective)
  at the end         (`fn(abort)`: (step, reason) of a health abort, or None)
    grading_summary run_summary.json: the run's grading faults           (process 0)
    npr_history     npr_history.json of a finished run                   (process 0)
    progress_close  closes the bar                                       (process 0)

A hook sees a narrow view of the step, not the Trainer, and owns its state. Which hooks a process
registers is where process 0 and the others differ (`Trainer._register_hooks`). The forecast is
fed by the evaluation records (the trainer's `log_eval`), a consumer of evaluation, not of steps.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping

import numpy as np
from tqdm import tqdm

from scalerl_jax import config as common
from scalerl_jax.training.health import HealthMonitor, RunUnhealthy, parity_check


@dataclasses.dataclass(frozen=True)
class StepView:
  """What an after-step hook sees: `step` = versions trained so far (s + 1), `total` =
  config.total_steps, `record` = the step's metrics record (process 0; hooks may add fields to it
  before `tracking` writes it; {"step", "kind", metrics...} on the other processes)."""
  step: int
  total: int
  record: dict

  @property
  def final(self) -> bool:
    """The run's last step."""
    return self.step >= self.total


@dataclasses.dataclass(frozen=True)
class BeforeView:
  """What a before-step hook sees: `step` (the batch's step, before its update), `first` (this
  process's first step of the run, resumed or not), `arrays` (the broadcast batch), `versions`
  (process 0: each row's token versions, in `arrays`' order; None elsewhere), `batch` (process 0:
  the pulled rollout batch; None elsewhere)."""
  step: int
  first: bool
  arrays: Mapping[str, np.ndarray]
  versions: np.ndarray | None
  batch: Any


@dataclasses.dataclass(frozen=True)
class HookOut:
  """A before-step hook's result: metrics for the step's record and whether it ran a forward pass
  the compute ledger books (the parity gate's re-score)."""
  metrics: dict = dataclasses.field(default_factory=dict)
  rescored: bool = False


@dataclasses.dataclass(frozen=True)
class _Entry:
  name: str
  fn: Callable[[Any], Any]
  every: int


class Hooks:
  """Named hooks with a cadence, run in registration order: a hook with `every` = N runs at the
  steps that are multiples of N and at the run's last step (`every` = 1: each step)."""

  def __init__(self):
    self.after: list[_Entry] = []
    self.before: list[_Entry] = []
    self.finish: list[_Entry] = []

  def add(self, name: str, fn: Callable[[StepView], None], every: int = 1) -> None:
    """Registers an after-step hook `fn(view)` running every `every` steps and at the end."""
    if every < 1:
      raise ValueError(f"hook {name!r}: every={every} must be >= 1")
    self.after.append(_Entry(name, fn, int(every)))

  def add_before(self, name: str, fn: Callable[[BeforeView], HookOut]) -> None:
    """Registers a before-step hook `fn(view) -> HookOut` (it decides its own cadence: the
    parity gate's depends on the first step of a resumed run)."""
    self.before.append(_Entry(name, fn, 1))

  def add_finish(self, name: str, fn: Callable[[tuple[int, str] | None], None]) -> None:
    """Registers `fn(abort)`, run once as the run ends (`abort`: (step, reason) of a health
    abort, or None for a finished run)."""
    self.finish.append(_Entry(name, fn, 1))

  def names(self) -> tuple[str, ...]:
    """The registered hooks' names: before-step, after-step, then end-of-run ones."""
    return tuple(e.name for e in self.before + self.after + self.finish)

  def run_finish(self, abort: tuple[int, str] | None) -> None:
    """Runs the end-of-run hooks."""
    for e in self.finish:
      e.fn(abort)

  def run_before(self, view: BeforeView) -> HookOut:
    """Runs the before-step hooks; their metrics merged, `rescored` if any re-scored."""
    metrics, rescored = {}, False
    for e in self.before:
      out = e.fn(view)
      metrics.update(out.metrics)
      rescored = rescored or out.rescored
    return HookOut(metrics, rescored)

  def run(self, view: StepView) -> None:
    """Runs the after-step hooks that are due at `view.step`."""
    for e in self.after:
      if view.step % e.every == 0 or view.final:
        e.fn(view)


class ParityGate:
  """The log-prob parity gate (health.parity_gate): at this process's first step (before any
  update) the whole batch, later every `health.parity_every` steps the tokens the current version
  generated, re-scored by the learner (`logprobs(tokens, routes)`: a collective when multi-host,
  so every process runs it) and compared on process 0. Raises RunUnhealthy when the parity
  alarm is in health.abort_on."""

  def __init__(self, health: common.Health, monitor: HealthMonitor,
               logprobs: Callable[..., np.ndarray], replay_routes: bool, main: bool):
    self.health, self.monitor, self.logprobs = health, monitor, logprobs
    self.replay_routes, self.main = replay_routes, main

  def __call__(self, view: BeforeView) -> HookOut:
    every = int(self.health.parity_every)
    if not (view.first or (every and view.step % every == 0)):
      return HookOut()
    routes = view.arrays.get("routes") if self.replay_routes else None
    lp = self.logprobs(view.arrays["tokens"], routes)
    if not self.main:
      return HookOut(rescored=True)
    assert view.versions is not None          # process 0 has the rows' versions
    mask = view.arrays["loss_mask"].astype(bool) & (view.versions == view.step)
    out = parity_check(lp, view.arrays["gen_logprobs"], mask, self.health, version=view.step,
                       startup=view.first)
    if out.get("health/parity_alarm") and self.monitor.aborts("parity", view.step + 1):
      raise RunUnhealthy(f"health.abort_on: parity re-score failed at step {view.step}",
                         view.step, out)
    return HookOut(out, rescored=True)


class HealthHook:
  """The step's health fields (HealthMonitor.check) go into its record; an abort it decides is
  raised by `raise_pending`, registered after `tracking`, so the aborting record is written."""

  def __init__(self, monitor: HealthMonitor):
    self.monitor = monitor
    self.pending: RunUnhealthy | None = None

  def check(self, view: StepView) -> None:
    """Adds the health fields to the record; keeps an abort for `raise_pending`."""
    try:
      view.record.update(self.monitor.check(view.record))
    except RunUnhealthy as e:
      view.record.update(e.metrics)
      self.pending = e

  def raise_pending(self, view: StepView) -> None:
    """Raises the abort `check` decided at this step, if any."""
    del view
    abort, self.pending = self.pending, None
    if abort is not None:
      raise abort


class Progress:
  """The progress bar (process 0): one tick per step, with the newest evaluation's pass rate
  (`last_eval()`), the step's largest lag and mean reward; the bar starts at the first step."""

  def __init__(self, start: int, total: int, last_eval: Callable[[], dict | None]):
    self.start, self.total, self.last_eval = start, total, last_eval
    self.bar: tqdm | None = None

  def __call__(self, view: StepView) -> None:
    if self.bar is None:
      self.bar = tqdm(desc="RL", dynamic_ncols=True, initial=self.start, total=self.total)
    self.bar.update(1)
    last = self.last_eval()
    assert last is not None     # R0 (or the restored checkpoint's record) set it
    self.bar.set_postfix(pass_rate=f"{last['val_pass_rate']:.3f}", lag=view.record["max_lag"],
                         reward=f"{view.record['mean_reward']:.2f}")

  def close(self, abort: tuple[int, str] | None = None) -> None:
    """Closes the bar (an end-of-run hook)."""
    del abort
    if self.bar is not None:
      self.bar.close()


class CheckpointHook:
  """Saves the run state (`save(step)`, collective) every checkpoint.every_steps and at the end;
  remembers how long the last save took and which step it saved (they bound a SIGTERM'd final
  save: training/preemption.py)."""

  def __init__(self, save: Callable[[int], None], last_saved: int | None):
    self.save = save
    self.last_save_s: float | None = None
    self.last_saved = last_saved

  def __call__(self, view: StepView) -> None:
    t0 = time.monotonic()
    self.save(view.step)
    self.last_save_s, self.last_saved = time.monotonic() - t0, view.step
