"""Text helpers shared by the verifiers."""
from __future__ import annotations

END_THINK = "</think>"


def strip_thinking(text: str) -> str | None:
  """Text after the last `</think>`; None when the completion never closed its thinking."""
  i = text.rfind(END_THINK)
  return None if i < 0 else text[i + len(END_THINK):]


def answer_view(text: str, require_think_close: bool = True) -> str:
  """The text a verifier grades. With `require_think_close` (the paper's contract, the default)
  the completion itself: verifiers read what follows its last `</think>` and give 0 without one.
  Without it (a prompt template that asks for no thinking, data/templates.py), a completion that
  never wrote `</think>` is graded whole: `</think>` is put in front of it."""
  if require_think_close or END_THINK in text:
    return text
  return END_THINK + text
