"""Code rewards: DeepCoder-style unit tests run on the program after the thinking trace.

Code answers (`answer` for "code") are JSON, either a list of tests or an object:
  [{"input": "1 2\\n", "output": "3\\n"}, ...]                          stdin/stdout tests
  {"tests": [...], "fn_name": "add"}                                     + call-based tests:
  {"input": "1\\n2", "output": "3", "testtype": "functional"}         input = one JSON arg per line
  (+ "apps_wrapped": true: the output may also be the return value wrapped in a one-element list,
  the APPS/TACO call-based convention)
The program is the last ```python (or bare ```) block after </think>. Reward 1 iff all tests pass.
Each test runs in its own bubblewrap sandbox (scalerl_jax/rewards/sandbox.py, docs/SANDBOX.md);
`grade_code` also returns the recorded reason and whether the program ran sandboxed.
"""
from __future__ import annotations

import dataclasses
import json
import re

from scalerl_jax.rewards import sandbox
from scalerl_jax.rewards.registry import Grade, register
from scalerl_jax.rewards.text import strip_thinking

_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.S)


def extract_code(completion_text: str) -> str | None:
  """The last fenced code block after </think>, or None."""
  tail = strip_thinking(completion_text)
  if tail is None:
    return None
  blocks = _CODE_BLOCK.findall(tail)
  return blocks[-1] if blocks else None


def parse_tests(answer: str) -> tuple[list[dict], str | None]:
  """(tests, fn_name) from a code answer (format in the module docstring); raises ValueError."""
  try:
    spec = json.loads(answer) if isinstance(answer, str) else answer
  except json.JSONDecodeError as e:
    raise ValueError(f"code answer is not JSON: {e}") from None
  fn_name = None
  if isinstance(spec, dict):
    fn_name = spec.get("fn_name") or None
    spec = spec.get("tests")
  if not isinstance(spec, list) or not spec:
    raise ValueError("code answer must hold a non-empty list of tests")
  for i, t in enumerate(spec):
    if not isinstance(t, dict) or "input" not in t or "output" not in t:
      raise ValueError(f"test {i} must be an object with 'input' and 'output', got {t!r}")
    if t.get("testtype", "stdin") == "functional" and not fn_name:
      raise ValueError(f"test {i} is functional but the answer has no 'fn_name'")
  return spec, fn_name


def _outputs_match(got: str, want: str) -> bool:
  a, b = got.split(), want.split()
  if a == b:
    return True
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    try:
      if abs(float(x) - float(y)) > 1e-6 * max(1.0, abs(float(y))):
        return False
    except ValueError:
      return False
  return True


def _check_output(stdout: bytes, test: dict, functional: bool) -> bool:
  text = stdout.decode("utf-8", "replace")
  if functional:
    try:
      want = test["output"]
      want = json.loads(want) if isinstance(want, str) else want
      got = json.loads(text)
    except (json.JSONDecodeError, ValueError):
      return False
    # APPS/TACO call-based outputs wrap the return value in a one-element list (data/loaders.py)
    return got == want or bool(test.get("apps_wrapped")) and isinstance(want, list) and \
        len(want) == 1 and got == want[0]
  return _outputs_match(text, str(test["output"]))


# RunResult.status -> recorded reason of a failed test ("ok" is pass or wrong_answer).
_REASON = {"exit": "runtime_error", "timeout": "timeout", "memory": "memory",
           "output_limit": "output_limit", "file_limit": "file_limit",
           "sandbox_error": "sandbox_error"}


def run_tests_detailed(code: str, tests: list[dict], fn_name: str | None = None,
                       limits: sandbox.Limits | None = None) -> tuple[str, int, bool, str]:
  """Runs `code` on each test in its own sandbox (sandbox.run_program), stopping at the first
  failure. Returns (reason, tests passed, sandboxed, detail); reason "pass" iff all passed."""
  limits = limits or sandbox.Limits()
  sandboxed = True
  for i, t in enumerate(tests):
    functional = t.get("testtype", "stdin") == "functional"
    want = len(str(t["output"]))
    lim = limits if want * 2 + 4096 <= limits.output_bytes else dataclasses.replace(
        limits, output_bytes=want * 2 + 4096)
    r = sandbox.run_program(code, str(t["input"]), fn_name if functional else None, lim)
    sandboxed = sandboxed and r.sandboxed
    if r.status != "ok":
      return _REASON[r.status], i, sandboxed, r.detail
    if not _check_output(r.stdout, t, functional):
      return "wrong_answer", i, sandboxed, f"test {i}"
  return "pass", len(tests), sandboxed, ""


def run_tests(code: str, tests: list[dict], fn_name: str | None = None, timeout_s: float = 6.0,
              memory_bytes: int = 1 << 30) -> bool:
  """True iff `code` passes every test, each run in a fresh sandbox (sandbox.run_program)."""
  limits = sandbox.Limits(memory_bytes=memory_bytes, wall_s=timeout_s)
  return run_tests_detailed(code, tests, fn_name, limits)[0] == "pass"


def grade_code(completion_text: str, answer: str, limits: sandbox.Limits | None = None) -> Grade:
  """Grade(reward, reason, sandboxed, ...) of one completion; never raises. Reasons: pass,
  wrong_answer, runtime_error, timeout, memory, output_limit, file_limit, sandbox_error,
  bad_tests (the answer is not valid test JSON; detail says why), no_code."""
  try:
    tests, fn_name = parse_tests(answer)
  except ValueError as e:
    return Grade(0.0, "bad_tests", False, detail=str(e))
  code = extract_code(completion_text)
  if code is None:
    return Grade(0.0, "no_code", False, tests_total=len(tests))
  reason, passed, sandboxed, detail = run_tests_detailed(code, tests, fn_name, limits)
  return Grade(1.0 if reason == "pass" else 0.0, reason, sandboxed, passed, len(tests), detail)


@register("code", grader=grade_code)
def code_reward(completion_text: str, answer: str) -> float:
  """1.0 iff the last code block after </think> passes all tests in `answer` (run sandboxed);
  raises ValueError when `answer` is not valid test JSON (grade_code records "bad_tests")."""
  g = grade_code(completion_text, answer)
  if g.reason == "bad_tests":
    raise ValueError(g.detail)
  return g.reward
