"""Code rewards: DeepCoder-style unit tests run on the program after the thinking trace.

Code answers (`answer` for "code") are JSON, either a list of tests or an object:
  [{"input": "1 2\\n", "output": "3\\n"}, ...]                          stdin/stdout tests
  {"tests": [...], "fn_name": "add"}                                     + call-based tests:
  {"input": "1\\n2", "output": "3", "testtype": "functional"}         input = one JSON arg per line
  (+ "apps_wrapped": true: the output may also be the return value wrapped in a one-element list,
  the APPS/TACO call-based convention)
The program is the last ```python (or bare ```) block after </think>. Reward 1 iff all tests pass;
how an output is compared with the expected one is `outputs_match` (stdin) and `json_equal`
(functional); the rules are in their docstrings and docs/SANDBOX.md ("How outputs are compared").
Each test runs in its own bubblewrap sandbox (scalerl_jax/rewards/sandbox.py, docs/SANDBOX.md);
`grade_code` also returns the recorded reason and whether the program ran sandboxed.
"""
from __future__ import annotations

import dataclasses
import decimal
import json
import re

from scalerl_jax.rewards import sandbox
from scalerl_jax.rewards.registry import Grade, register
from scalerl_jax.rewards.sandbox_setup import Limits
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


# How a program's output is compared with a test's expected output (issue #28). In RL the policy
# optimises against this function, so every leniency is a target; each rule has an exploit test in
# tests/faults/test_sandbox_hostile.py ("gaming the comparison") and is listed in docs/SANDBOX.md.
_WS = re.compile(r"[ \t\n\r\f\v]+")
# JSON's number grammar, ASCII digits only: no '+', no leading zeros, no '.5' / '5.', no '_', no
# hex, no inf/nan, no Unicode digits (float() accepts all of these).
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_INTEGER = re.compile(r"-?(?:0|[1-9][0-9]*)")
_REL_TOL = decimal.Decimal("1e-6")


def _tokens(text: str) -> list[str]:
  """Whitespace-separated tokens; only ASCII whitespace separates (str.split() also splits on
  U+00A0, U+2028, U+001C-U+001F, ..., so `x y` matched an expected token `x<NBSP>y`)."""
  text = _WS.sub(" ", text).strip(" ")
  return text.split(" ") if text else []


def _context() -> decimal.Context:
  """A Decimal context that never raises and never overflows a realistic answer."""
  return decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def _token_match(got: str, want: str) -> bool:
  """One stdin-test token: equal strings, or two JSON-grammar numbers (exact value when `want` is
  an integer; relative/absolute error <= 1e-6 otherwise). Everything else must be equal strings."""
  if got == want:
    return True
  if not (_NUMBER.fullmatch(got) and _NUMBER.fullmatch(want)):
    return False
  with decimal.localcontext(_context()):
    g, w = decimal.Decimal(got), decimal.Decimal(want)
    if not (g.is_finite() and w.is_finite()):      # exponents past what Decimal holds
      return False
    if _INTEGER.fullmatch(want):
      return g == w                                 # exact: no tolerance on integers
    return abs(g - w) <= _REL_TOL * max(decimal.Decimal(1), abs(w))


def outputs_match(got: str, want: str) -> bool:
  """True iff a stdin test's output `got` matches the expected `want`. The rules:

  - Both are split into tokens on ASCII whitespace only (runs of space, tab, newline, CR, FF, VT);
    leading/trailing whitespace and line structure do not matter. An empty or whitespace-only
    `want` matches only an empty or whitespace-only `got`.
  - Token counts must be equal: a missing or extra (trailing) token fails.
  - Tokens that are equal strings match (so `nan` matches `nan`, `True` matches `True`).
  - Otherwise a token pair matches only when BOTH are numbers in JSON's grammar
    (`-?(0|[1-9][0-9]*)(.[0-9]+)?([eE][+-]?[0-9]+)?`, ASCII digits): no `+`, no leading zeros
    (`0011` is text: a binary string), no `.5`/`5.`, no `1_000`, no hex, no `inf`/`nan`/
    `infinity`, no Unicode digits such as `٣`. All of these are text and must equal the expected
    token exactly; so a non-finite value never matches unless the expected token is that same
    string. Values are compared exactly in Decimal (never through float):
    - an integer expected token needs the exact value (`2.000` and `2e0` match `2`; `999999000`
      does not match `999999999`, `12345678901234567890` does not match `...891`);
    - an expected token with a fraction or exponent matches within max(1, |want|) * 1e-6.
  - Text tokens are compared case-sensitively (`yes` does not match `YES`).
  """
  a, b = _tokens(got), _tokens(want)
  return len(a) == len(b) and all(_token_match(x, y) for x, y in zip(a, b))


class _Constant(str):
  """A JSON NaN / Infinity / -Infinity literal, kept as its literal text."""


def _json(text: str):
  """`text` parsed as JSON with floats as Decimal (exact; no overflow to inf) and NaN/Infinity as
  _Constant; raises ValueError (also on nesting deeper than Python's recursion limit)."""
  try:
    with decimal.localcontext(_context()):
      return json.loads(text, parse_float=decimal.Decimal, parse_constant=_Constant)
  except (RecursionError, ArithmeticError) as e:
    raise ValueError(f"{type(e).__name__}: {e}") from None


def json_equal(got, want) -> bool:
  """Structural equality of two values parsed by _json: a bool equals only a bool, numbers
  compare by exact value (an int equals a Decimal of the same value), a non-finite constant
  equals only the same literal, strings exactly, lists elementwise, objects by key set and
  values. (Python's `==` has `true == 1`, `1.0 == 1`, `NaN != NaN`.)"""
  if isinstance(want, _Constant) or isinstance(got, _Constant):
    return isinstance(want, _Constant) and isinstance(got, _Constant) and str(got) == str(want)
  if isinstance(want, bool) or isinstance(got, bool):
    return isinstance(want, bool) and isinstance(got, bool) and got == want
  if isinstance(want, (int, decimal.Decimal)):
    return isinstance(got, (int, decimal.Decimal)) and got == want
  if isinstance(want, list):
    return isinstance(got, list) and len(got) == len(want) and all(
        json_equal(g, w) for g, w in zip(got, want))
  if isinstance(want, dict):
    return isinstance(got, dict) and got.keys() == want.keys() and all(
        json_equal(got[k], want[k]) for k in want)
  return type(got) is type(want) and got == want          # str, None


def _want_json(test: dict):
  """A functional test's expected value, parsed like the program's output."""
  want = test["output"]
  return _json(want if isinstance(want, str) else json.dumps(want))


def _check_output(stdout: bytes, test: dict, functional: bool) -> bool:
  """The program's stdout against the test's expected output. Output that is not valid UTF-8
  never matches (a lossy decode would map many byte strings onto one expected U+FFFD)."""
  try:
    text = stdout.decode("utf-8")
  except UnicodeDecodeError:
    return False
  if functional:
    try:
      want = _want_json(test)
      got = _json(text)
    except ValueError:
      return False
    # APPS/TACO call-based outputs wrap the return value in a one-element list (data/loaders.py)
    return json_equal(got, want) or (bool(test.get("apps_wrapped")) and isinstance(want, list)
                                     and len(want) == 1 and json_equal(got, want[0]))
  return outputs_match(text, str(test["output"]))


def trivial_tests(tests: list[dict]) -> bool:
  """True when a program that prints nothing (stdin tests: empty output) or returns None
  (functional: `null`) passes every test: such an answer carries no signal, only a free 1.0."""
  for t in tests:
    if t.get("testtype", "stdin") == "functional":
      try:
        if _want_json(t) is not None:
          return False
      except ValueError:
        return False
    elif _tokens(str(t["output"])):
      return False
  return True


# RunResult.status -> recorded reason of a failed test ("ok" is pass or wrong_answer).
_REASON = {"exit": "runtime_error", "timeout": "timeout", "memory": "memory",
           "output_limit": "output_limit", "file_limit": "file_limit",
           "sandbox_error": "sandbox_error"}


def run_tests_detailed(code: str, tests: list[dict], fn_name: str | None = None,
                       limits: Limits | None = None) -> tuple[str, int, bool, str]:
  """Runs `code` on each test in its own sandbox (sandbox.run_program), stopping at the first
  failure. Returns (reason, tests passed, sandboxed, detail); reason "pass" iff all passed.
  Tests that a program printing nothing passes (trivial_tests) are reason "trivial_tests" and
  run nothing."""
  if trivial_tests(tests):
    return ("trivial_tests", 0, False,
            "every test expects empty output (or null): a program doing nothing would pass")
  limits = limits or Limits()
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
  limits = Limits(memory_bytes=memory_bytes, wall_s=timeout_s)
  return run_tests_detailed(code, tests, fn_name, limits)[0] == "pass"


def grade_code(completion_text: str, answer: str, limits: Limits | None = None) -> Grade:
  """Grade(reward, reason, sandboxed, ...) of one completion; never raises. Reasons: pass,
  wrong_answer, runtime_error, timeout, memory, output_limit, file_limit, sandbox_error,
  bad_tests (the answer is not valid test JSON; detail says why), trivial_tests (every test
  expects empty output, so doing nothing would pass; nothing runs), no_code."""
  try:
    tests, fn_name = parse_tests(answer)
  except ValueError as e:
    return Grade(0.0, "bad_tests", False, detail=str(e))
  code = extract_code(completion_text)
  if code is None:
    return Grade(0.0, "no_code", False, tests_total=len(tests))
  reason, passed, sandboxed, detail = run_tests_detailed(code, tests, fn_name, limits)
  return Grade(1.0 if reason == "pass" else 0.0, reason, sandboxed, passed, len(tests), detail)


@register("code", grader=grade_code, sandboxed=True)
def code_reward(completion_text: str, answer: str) -> float:
  """1.0 iff the last code block after </think> passes all tests in `answer` (run sandboxed);
  raises ValueError when `answer` is not valid test JSON (grade_code records "bad_tests")."""
  g = grade_code(completion_text, answer)
  if g.reason == "bad_tests":
    raise ValueError(g.detail)
  return g.reward
