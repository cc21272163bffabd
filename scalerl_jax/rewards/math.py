"""Math answers checked with Math-Verify (SymPy) on the text after the thinking trace.

Math-Verify may start an exact big-number computation (`2^{2^{40}}`, `(10^9)!`) that holds the GIL
and never ends, so this reward is registered `isolated=True`: `rewards.grade` runs it in a worker
process with a hard deadline and a memory ceiling (rewards/isolation.py). `hazard` is its cheap
guard (exponent towers, huge exponents, factorials of huge numbers, very long digit runs): such an
answer gets 0 (reason grade_guard) without a worker, unless the gold answer has the same hazard.
"""
from __future__ import annotations

import re
import threading

from scalerl_jax import lazy
from scalerl_jax.rewards.registry import register
from scalerl_jax.rewards.text import strip_thinking

math_verify = lazy.module("math_verify")   # SymPy: ~0.6 CPU-s, paid by the processes that grade math


def _in_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


def _parse_gold(answer: str):
  timeout = 5 if _in_main_thread() else None   # math-verify's timeout uses signal.alarm (main only)
  a = answer.strip()
  if "$" not in a and "\\boxed" not in a and "\\(" not in a:
    gold = math_verify.parse("$" + a + "$", parsing_timeout=timeout)
    if gold:
      return gold
  return math_verify.parse(a, parsing_timeout=timeout)


# An exponent that holds another power (a tower): `^{2^{40}}`, `^{10^{10}}`, `^(3^9)`, `**(2**40)`.
_TOWER = re.compile(r"(\^|\*\*)\s*[{(]\s*[^{}()]*?(\^|\*\*)")
# An exponent of >= 7 digits (>= 10^6): `9999999999^{9999999999}`, `7^{10000000}`.
_BIG_EXP = re.compile(r"(\^|\*\*)\s*[{(]?\s*\d[\d,]{6,}")
# A factorial of a >= 6-digit number, or of a bracket holding a power: `(10^9)!`, `{10^9}!`.
_BIG_FACT = re.compile(r"(\d{6,}\s*!)|([({][^(){}]*(\^|\*\*)[^(){}]*[)}]\s*!)")
_LONG_DIGITS = re.compile(r"\d{2000,}")     # a number of >= 2000 digits
_HAZARDS = (("exponent tower", _TOWER), ("exponent of >= 10^6", _BIG_EXP),
            ("factorial of a huge or composite argument", _BIG_FACT),
            ("number of >= 2000 digits", _LONG_DIGITS))


def _hazards(text: str) -> list[str]:
  return [what for what, rx in _HAZARDS if rx.search(text)]


def hazard(completion_text: str, answer: str) -> str:
  """Why the answer part of `completion_text` is not worth parsing ("" = parse it): an
  expression whose exact value is astronomically large, unless the gold `answer` has the same
  kind of expression (then the grade's deadline decides). Cheap: a few regular expressions."""
  tail = strip_thinking(completion_text)
  found = _hazards(completion_text if tail is None else tail)
  if not found:
    return ""
  gold = set(_hazards(answer))
  left = [w for w in found if w not in gold]
  return f"guarded: {', '.join(left)} in the answer" if left else ""


@register("math", isolated=True, guard=hazard)
def math_reward(completion_text: str, answer: str) -> float:
  """1.0 iff Math-Verify says the answer part (after </think>) equals the gold answer."""
  tail = strip_thinking(completion_text)
  if tail is None or not tail.strip():
    return 0.0
  main = _in_main_thread()
  gold = _parse_gold(answer)
  pred = math_verify.parse(tail, parsing_timeout=5 if main else None)
  if not gold or not pred:
    return 0.0
  return 1.0 if math_verify.verify(gold, pred, timeout_seconds=5 if main else None) else 0.0
