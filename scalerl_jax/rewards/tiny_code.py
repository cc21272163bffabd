"""The tiny code task's verifier: the model's answer words ARE a Python program, run in the sandbox.

The completion's words after the last `</think>` (cut at `<eos>`, pads dropped) are joined without
spaces into one line of Python (`print ( 3 + 7 * 2 ) <eos>` -> `print(3+7*2)`; the word-level
tokenizer splits digit runs per digit, so joining restores numbers). That program runs in the
bubblewrap sandbox exactly as the `code` reward runs DeepCoder programs (code.run_tests_detailed:
one fresh sandbox per test) against the answer's test JSON (`{"tests": [{"input": "", "output":
"17"}], "fn_name": null}`). Reward 1 iff its stdout equals the target. Task: data/tiny_code.py.

Grades are memoized per (program, tests): the task's vocabulary (digits, `print ( ) + - *`) cannot
express a non-deterministic program, so a second run of the same program is guaranteed to give the
same result; the cached Grade keeps the first run's `sandboxed` and says `cached=True`.
"""
from __future__ import annotations

import collections
import dataclasses
import threading

from scalerl_jax.rewards import code
from scalerl_jax.rewards.registry import Grade, register
from scalerl_jax.rewards.synthetic import extract_answer

CACHE_SIZE = 1 << 16
_cache: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def program_text(completion_text: str) -> str | None:
  """The one-line program written after the last `</think>` (None: no `</think>` or no words)."""
  words = extract_answer(completion_text)
  if not words:
    return None
  return "".join(words.split())


def grade_tiny_code(completion_text: str, answer: str) -> Grade:
  """Grade(reward, reason, sandboxed, ...): reasons as the `code` reward's (pass, wrong_answer,
  runtime_error, timeout, ..., bad_tests, no_code); never raises."""
  try:
    tests, fn_name = code.parse_tests(answer)
  except ValueError as e:
    return Grade(0.0, "bad_tests", False, detail=str(e))
  src = program_text(completion_text)
  if src is None:
    return Grade(0.0, "no_code", False, tests_total=len(tests))
  key = (src, answer)
  with _lock:
    hit = _cache.get(key)
    if hit is not None:
      _cache.move_to_end(key)
  if hit is not None:
    return dataclasses.replace(hit, cached=True)
  reason, passed, sandboxed, detail = code.run_tests_detailed(src + "\n", tests, fn_name)
  g = Grade(1.0 if reason == "pass" else 0.0, reason, sandboxed, passed, len(tests), detail)
  if reason != "sandbox_error":          # a broken sandbox is not a property of the program
    with _lock:
      _cache[key] = g
      while len(_cache) > CACHE_SIZE:
        _cache.popitem(last=False)
  return g


def clear_cache() -> None:
  """Forgets memoized grades (tests)."""
  with _lock:
    _cache.clear()


@register("tiny_code", grader=grade_tiny_code, sandboxed=True)
def tiny_code_reward(completion_text: str, answer: str) -> float:
  """1.0 iff the program written after `</think>` prints the target (run in the sandbox); raises
  ValueError when `answer` is not valid test JSON (grade_tiny_code records "bad_tests")."""
  g = grade_tiny_code(completion_text, answer)
  if g.reason == "bad_tests":
    raise ValueError(g.detail)
  return g.reward
