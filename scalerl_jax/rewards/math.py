"""Math answers checked with Math-Verify (SymPy) on the text after the thinking trace."""
from __future__ import annotations

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


@register("math")
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
