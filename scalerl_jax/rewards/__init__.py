"""Reward registry: verifiers by name, each `fn(completion_text, answer) -> float` in [0, 1].

  compute_reward("math", completion, "\\frac{1}{2}")   # Math-Verify on the text after </think>
  compute_reward("synthetic", completion, "7")          # the digit-sum task's exact-match verifier
  compute_reward("code", completion, tests_json)        # DeepCoder-style unit tests, bwrap sandbox
  compute_reward("tiny_code", completion, tests_json)   # the tiny code task: answer words = program
  grade("code", completion, tests_json)                 # Grade(reward, reason, sandboxed, ...)

Rewards registered `isolated=True` (math) are graded in worker processes with a hard deadline and
a memory ceiling (rewards/isolation.py): reward 0 with reason grade_timeout / grade_oom /
grade_error / grade_guard when a model answer would stall the grader.

Every verifier first removes the thinking part: everything up to and including the LAST `</think>`;
a completion without `</think>` gets 0 (the paper checks answers after removing the trace), unless
the caller passes `require_think_close=False` (a prompt template that asks for no thinking,
scalerl_jax/data/templates.py): then a completion without `</think>` is graded whole.
The length-penalty transform lives in scalerl_jax/generation/interruption.py, not here.

A new reward: a module in this package with `@register("name")` on `fn(completion_text, answer)`
(`sandboxed=True` if it runs model-written programs), imported below; select it with
`--config.data.reward=name` (default: the data kind's, `data.REWARD_FOR_KIND`).
`scalerl_jax.data` depends on this package, never the other way round.
"""
from scalerl_jax.rewards.registry import REWARDS, Grade, get, is_sandboxed, names, register
from scalerl_jax.rewards.isolation import compute_reward, grade
from scalerl_jax.rewards.text import END_THINK, answer_view, strip_thinking
from scalerl_jax.rewards import code, isolation, math, registry, sandbox, synthetic, tiny_code  # noqa: F401  (registers verifiers)
from scalerl_jax.rewards.code import extract_code, grade_code, parse_tests, run_tests
from scalerl_jax.rewards.sandbox import (SandboxUnavailable, check_sandbox, prepare_code_rewards,
                                         sandbox_still_works)


__all__ = ["REWARDS", "Grade", "register", "get", "grade", "names", "compute_reward", "END_THINK",
           "answer_view", "strip_thinking", "extract_code", "grade_code", "parse_tests", "run_tests", "sandbox",
           "SandboxUnavailable", "check_sandbox", "prepare_code_rewards", "sandbox_still_works", "is_sandboxed",
           "isolation", "registry"]
