"""The trainer's hooks (scalerl_jax/training/hooks.py): cadence, order, the health abort after the
record is written, the parity gate on its narrow view, and that an evaluation sees an EvalContext,
not the Trainer. The whole loop with every hook: tests/e2e/test_smoke.py, test_forecast_abort.py
(abort), test_resume.py, test_preemption.py."""
import dataclasses
import inspect

import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax.training import evaluation, hooks, trainer
from scalerl_jax.training.health import HealthMonitor, RunUnhealthy


def test_hooks_run_at_their_cadence_and_at_the_last_step_in_order():
  h, calls = hooks.Hooks(), []
  h.add("every_step", lambda v: calls.append(("a", v.step)))
  h.add("every_3", lambda v: calls.append(("b", v.step)), every=3)
  for s in range(1, 8):
    h.run(hooks.StepView(s, 7, {}))
  assert [s for n, s in calls if n == "b"] == [3, 6, 7]          # multiples of 3, and the last
  assert [s for n, s in calls if n == "a"] == list(range(1, 8))
  assert calls[:3] == [("a", 1), ("a", 2), ("a", 3)] and calls[3] == ("b", 3)
  assert h.names() == ("every_step", "every_3")
  with pytest.raises(ValueError, match="every=0"):
    h.add("never", lambda v: None, every=0)


def test_before_hooks_merge_metrics_and_rescored():
  h = hooks.Hooks()
  h.add_before("x", lambda v: hooks.HookOut({"a": 1}))
  h.add_before("y", lambda v: hooks.HookOut({"b": 2}, rescored=v.first))
  view = hooks.BeforeView(4, True, {}, None, None)
  assert h.run_before(view) == hooks.HookOut({"a": 1, "b": 2}, True)
  assert h.run_before(dataclasses.replace(view, first=False)).rescored is False


def test_health_abort_is_raised_after_tracking_wrote_the_record():
  cfg = dataclasses.replace(common.Health(), abort_on="truncated_frac", max_truncated_frac=0.05)
  health, written = hooks.HealthHook(HealthMonitor(cfg)), []
  h = hooks.Hooks()
  h.add("health", health.check)
  h.add("tracking", lambda v: written.append(dict(v.record)))
  h.add("health_abort", health.raise_pending)
  h.add("evaluation", lambda v: written.append("eval"), every=2)
  h.run(hooks.StepView(1, 10, {"step": 1, "truncated_frac": 0.01}))
  assert len(written) == 1 and health.pending is None
  with pytest.raises(RunUnhealthy):
    h.run(hooks.StepView(2, 10, {"step": 2, "truncated_frac": 0.5}))
  assert written[-1]["step"] == 2 and written[-1]["truncated_frac"] == 0.5
  assert any(k.startswith("health/") for k in written[-1])   # the alarm fields were written
  assert "eval" not in written                    # step 2 was due, but nothing after the abort ran


def test_parity_gate_runs_first_and_every_n_and_compares_the_current_versions_tokens():
  cfg = dataclasses.replace(common.Health(), parity_every=5)
  seen = []

  def logprobs(tokens, routes):
    seen.append(routes)
    return np.log(np.full(tokens.shape, 0.5, np.float32))

  gate = hooks.ParityGate(cfg, HealthMonitor(cfg), logprobs, replay_routes=False, main=True)
  arrays = {"tokens": np.zeros((2, 4), np.int32), "loss_mask": np.ones((2, 4), bool),
            "gen_logprobs": np.log(np.full((2, 4), 0.5, np.float32)),
            "routes": np.zeros((2, 4, 1, 1), np.int32)}
  versions = np.array([[3, 3, 3, 3], [2, 2, 2, 2]])
  out = gate(hooks.BeforeView(3, True, arrays, versions, None))
  assert out.rescored and out.metrics["health/parity_tokens"] == 4       # the first step
  assert gate(hooks.BeforeView(4, False, arrays, versions, None)) == hooks.HookOut()
  assert gate(hooks.BeforeView(5, False, arrays, versions, None)).rescored
  assert seen == [None, None]                                          # R3 off: no routes
  follower = hooks.ParityGate(cfg, HealthMonitor(cfg), logprobs, False, main=False)
  assert follower(hooks.BeforeView(3, True, arrays, None, None)) == hooks.HookOut(rescored=True)


def test_an_evaluation_sees_a_context_not_the_trainer():
  fields = {f.name for f in dataclasses.fields(evaluation.EvalContext)}
  assert "trainer" not in fields and {"ledger", "params", "record", "log"} <= fields
  src = inspect.getsource(evaluation)
  assert "Trainer" not in src.replace("the trainer", "")
  assert "EvalContext(" in inspect.getsource(trainer.Trainer._eval_context)


def test_end_of_run_hooks_get_the_abort_and_run_once_in_order():
  h, calls = hooks.Hooks(), []
  h.add_finish("summary", lambda abort: calls.append(("summary", abort)))
  h.add_finish("npr", lambda abort: calls.append(("npr", abort)))
  h.add("step", lambda v: calls.append(("step", v.step)))
  h.run(hooks.StepView(1, 1, {}))
  h.run_finish((1, "health.abort_on: kl"))
  assert calls == [("step", 1), ("summary", (1, "health.abort_on: kl")),
                   ("npr", (1, "health.abort_on: kl"))]
  assert h.names() == ("step", "summary", "npr")


def test_the_progress_bar_ticks_once_a_step_with_the_newest_pass_rate():
  last = {"val_pass_rate": 0.25}
  bar = hooks.Progress(3, 10, lambda: last)
  bar(hooks.StepView(4, 10, {"max_lag": 2, "mean_reward": 0.5}))
  last["val_pass_rate"] = 0.5
  bar(hooks.StepView(5, 10, {"max_lag": 1, "mean_reward": 0.75}))
  assert bar.bar is not None and bar.bar.n == 5
  assert bar.bar.postfix == "lag=1, pass_rate=0.500, reward=0.75"     # tqdm sorts the keys
  bar.close()
