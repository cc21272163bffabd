"""The reward table (scalerl_jax.registry.Registry) and name-based scoring in this process.

  compute_direct(name, text, answer) -> float               what the learner trains on
  grade_direct(name, text, answer) -> Grade(reward, reason, sandboxed, ...)   the same, with why

Callers use `rewards.grade` / `rewards.compute_reward` (rewards/isolation.py), which grade a
reward registered `isolated=True` in a worker process with a deadline and these otherwise.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from scalerl_jax.registry import Registry
from scalerl_jax.rewards.text import answer_view, strip_thinking

RewardFn = Callable[[str, str], float]
REWARDS: Registry[RewardFn] = Registry("reward")


@dataclasses.dataclass(frozen=True)
class Grade:
  """One graded completion: `reward` in [0, 1], the recorded `reason` (pass, wrong_answer,
  no_answer, ...; code adds runtime_error, timeout, memory, output_limit, file_limit,
  sandbox_error, bad_tests, trivial_tests, no_code) and whether model code ran inside the sandbox."""
  reward: float
  reason: str
  sandboxed: bool = False
  tests_passed: int = 0
  tests_total: int = 0
  detail: str = ""
  cached: bool = False        # a memoized grade of the same program (rewards/tiny_code.py)

  def as_record(self) -> dict:
    """The fields a reward log keeps (JSON-serialisable)."""
    return dataclasses.asdict(self)


GradeFn = Callable[[str, str], Grade]
GuardFn = Callable[[str, str], str]
_GRADERS: dict[str, GradeFn] = {}
_SANDBOXED: set[str] = set()
_ISOLATED: dict[str, GuardFn | None] = {}


def register(name: str, grader: GradeFn | None = None, sandboxed: bool = False,
             isolated: bool = False, guard: GuardFn | None = None) -> Callable[[RewardFn], RewardFn]:
  """Decorator: `@register("name")` on fn(completion_text, answer) -> float; `grader` (optional)
  returns the Grade with its reason for `grade(name, ...)`; `sandboxed`: the reward runs
  model-written programs (a job using it checks the sandbox at start-up and its answers must be
  test JSON); `isolated`: its parsing of model output may run unbounded (big numbers), so it is
  graded in a worker process with a deadline (rewards/isolation.py), after `guard(text, answer)`
  (optional, cheap: a non-empty string = the reason to give 0 without parsing)."""
  deco = REWARDS.register(name)

  def wrap(fn: RewardFn) -> RewardFn:
    deco(fn)
    if grader is not None:
      _GRADERS[name] = grader
    if sandboxed:
      _SANDBOXED.add(name)
    if isolated:
      _ISOLATED[name] = guard
    return fn
  return wrap


def isolation_of(name: str) -> tuple[bool, GuardFn | None]:
  """(graded in a worker process, its guard) of reward `name`."""
  get(name)
  return name in _ISOLATED, _ISOLATED.get(name)


def is_sandboxed(name: str) -> bool:
  """Whether reward `name` runs model-written programs (registered with sandboxed=True)."""
  get(name)                         # an unknown name is an error, not "not sandboxed"
  return name in _SANDBOXED


def get(name: str) -> RewardFn:
  """The verifier registered as `name` (ValueError listing the registered ones otherwise)."""
  return REWARDS.get(name)


def names() -> tuple[str, ...]:
  """Registered reward names, sorted."""
  return REWARDS.names()


def compute_direct(name: str, completion_text: str, answer: str,
                   require_think_close: bool = True) -> float:
  """Scores one completion text against `answer` with the verifier `name`. Without
  `require_think_close` a completion with no `</think>` is graded whole (text.answer_view)."""
  return float(get(name)(answer_view(completion_text, require_think_close), answer))


def grade_direct(name: str, completion_text: str, answer: str,
                 require_think_close: bool = True) -> Grade:
  """Like compute_direct, plus the recorded reason. Verifiers without their own grader get
  reason pass (reward 1), no_answer (no `</think>`), wrong_answer (0) or partial."""
  completion_text = answer_view(completion_text, require_think_close)
  if name in _GRADERS:
    return _GRADERS[name](completion_text, answer)
  r = compute_direct(name, completion_text, answer)
  if r >= 1.0:
    reason = "pass"
  elif r > 0.0:
    reason = "partial"
  else:
    reason = "no_answer" if strip_thinking(completion_text) is None else "wrong_answer"
  return Grade(r, reason)
