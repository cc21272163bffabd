"""How the trainer evaluates (`eval.mode`): one `Evaluation` interface, two implementations.

`LocalEvaluation` samples the held-out prompts on the learner (process 0; the params gathered
when multi-host) and logs at once; `FleetEvaluation` submits the version to the buffer's
evaluation lane (the generators sample it, pinned) and logs when the results come back
(`collect`), and keeps a pinned version in the fleet while it is evaluated (`before_publish`).
Step 0 is R0, the base policy at compute 0: the same call, after which the compute axis starts.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from scalerl_jax import config as common
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.rewards import sandbox_still_works
from scalerl_jax.training.fleet_eval import FleetEvaluator, peak_rss_mb, summarize
from scalerl_jax.training.ledger import ComputeLedger
from scalerl_jax.types import SamplingSpec


def evaluate(model_cfg, params, dataset, spec, samples: int, prompts=None,
             batch_prompts: int = 64) -> dict:
  """Learner-local evaluation (`eval.mode=local`): mean@`samples` pass rate on `prompts` (default
  the held-out split; the trainer passes `fleet_eval.eval_prompts`, i.e. `eval.num_prompts` of
  them) at `spec`'s temperature, in a one-device JAX sampler on this process. Each completion is
  graded with its task's reward; metrics from `fleet_eval.summarize` (the same as the fleet's)."""
  prompts = list(dataset.heldout if prompts is None else prompts)
  sampler = JaxSampler(model_cfg, params)
  rewards, lengths, interrupted, tasks = [], [], [], []
  for i in range(0, len(prompts), batch_prompts):
    chunk = prompts[i:i + batch_prompts]
    groups = sampler.generate(chunk, samples, dataclasses.replace(spec, seed=spec.seed + i))
    for p, group in zip(chunk, groups):
      rw = []
      for c in group:
        g = dataset.grade(c.tokens, p.answer, p.task)
        if g.reason == "sandbox_error":   # raises when the sandbox broke mid-run
          sandbox_still_works(g.detail)
        rw.append(g.reward)
      rewards.append(rw)
      lengths.append([len(c.tokens) for c in group])
      interrupted.append([c.finish_reason == "interrupted" for c in group])
      tasks.append(p.task)
  return summarize(tasks, rewards, lengths, interrupted,
                   dataset.tasks if dataset.is_mixture else ())


@dataclasses.dataclass(frozen=True)
class EvalContext:
  """What an evaluation sees of the run (the trainer builds it; an evaluation never holds the
  trainer): whether this is process 0, the compute ledger, the params to evaluate (a callable: a
  collective gather when multi-host), the model, data set, sampling spec and held-out prompts, the
  buffer client and the child-process watchdog (fleet), and where results go: `record(step,
  fields)` (R0 and a local evaluation: the ledger's evaluation span is closed there) and
  `log(record)` (a fleet evaluation's complete record)."""
  main: bool
  ledger: ComputeLedger
  params: Callable[[], Any]
  model_cfg: Any
  dataset: Any
  spec: SamplingSpec
  prompts: list
  client: Any
  watchdog: Callable[[], None] | None
  record: Callable[[int, dict], None]
  log: Callable[[dict], None]


class Evaluation:
  """What the trainer calls (`ctx`: the run as an evaluation sees it; `section`: the eval
  section; `hold_versions`: generator.eval_hold_versions, the versions a generator keeps for
  pinned evaluations)."""

  def __init__(self, ctx: EvalContext, section: common.Eval, hold_versions: int):
    self.t, self.section, self.hold_versions = ctx, section, hold_versions

  def run(self, step: int) -> None:
    """Evaluates version `step` (0: R0, the base policy; the compute axis starts after it)."""
    raise NotImplementedError

  def collect(self, block: bool = False) -> None:  # noqa: B027 (optional: nothing pending)
    """Logs the evaluations that completed (every pending one with `block`)."""

  def before_publish(self, version: int) -> None:  # noqa: B027 (optional: nothing pinned)
    """Runs before `version` is published (a pinned version must stay available)."""


class LocalEvaluation(Evaluation):
  """Sampled here, on process 0 (a collective gather of the params first when multi-host)."""

  def run(self, step: int) -> None:
    t = self.t
    params = t.params()               # every process: a collective when multi-host
    if not t.main:
      return
    t.ledger.begin_eval()
    out = evaluate(t.model_cfg, params, t.dataset, t.spec,
                   self.section.samples_per_prompt, prompts=t.prompts)
    t.record(step, {**out, "eval_mode": "local", "learner_peak_rss_mb": peak_rss_mb()})


class FleetEvaluation(Evaluation):
  """Through the buffer's evaluation lane: process 0 submits and collects (nothing collective)."""

  def __init__(self, ctx: EvalContext, section: common.Eval, hold_versions: int):
    super().__init__(ctx, section, hold_versions)
    t = ctx
    self.fleet = None
    if t.main:
      self.fleet = FleetEvaluator(
          t.client, t.prompts, num_prompts=0,
          samples_per_prompt=section.samples_per_prompt, seed=int(t.spec.seed),
          temperature=t.spec.temperature, top_p=t.spec.top_p,
          hold_versions=hold_versions, timeout_s=section.timeout_s,
          task_names=t.dataset.tasks if t.dataset.is_mixture else (), watchdog=t.watchdog)

  def run(self, step: int) -> None:
    t = self.t
    if self.fleet is None:
      return
    if step == 0:                      # R0: process 0 waits for it
      t.ledger.begin_eval()
      self.fleet.submit(0, version=0, snapshot={})
      (e, res), = self.fleet.poll(block=True)
      if res is None:
        raise RuntimeError(f"the base policy's fleet evaluation did not complete within "
                           f"eval.timeout_s={self.fleet.timeout_s} s")
      t.record(0, self.fleet.record(e, res))
      return
    self.fleet.submit(step, version=step, snapshot=t.ledger.snapshot())
    self.collect()

  def collect(self, block: bool = False) -> None:
    """Logs the evaluations that completed (all open ones with `block`; the learner's wait is
    booked to eval_hours), booking the generators' evaluation device-seconds."""
    t = self.t
    if self.fleet is None or not self.fleet.open:
      return
    if block:
      t.ledger.begin_eval()
    done = self.fleet.poll(block=block)
    if block:
      t.ledger.end_eval()
    for e, res in done:
      if res is not None:
        t.ledger.add_eval_gen(sum(g.device_seconds for g in res.results))
      t.log(self.fleet.record(e, res))

  def before_publish(self, version: int) -> None:
    t = self.t
    if self.fleet is not None and self.fleet.open:   # pinned versions must stay in the fleet
      t.ledger.begin_eval()
      self.fleet.wait_held(version)
      t.ledger.end_eval()


EVALUATIONS = {"local": LocalEvaluation, "fleet": FleetEvaluation}
