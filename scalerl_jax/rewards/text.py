"""Text helpers shared by the verifiers."""
from __future__ import annotations

END_THINK = "</think>"


def strip_thinking(text: str) -> str | None:
  """Text after the last `</think>`; None when the completion never closed its thinking."""
  i = text.rfind(END_THINK)
  return None if i < 0 else text[i + len(END_THINK):]
