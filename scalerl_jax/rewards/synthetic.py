"""The digit-sum task's verifier (task and tokenizer: scalerl_jax.data.synthetic).

The answer is the text after the LAST `</think>` word up to `<eos>` (padding words ignored); it must
be exactly the answer digit (no `</think>` -> 0; trailing junk -> 0).
"""
from __future__ import annotations

from scalerl_jax.rewards.registry import register
from scalerl_jax.rewards.text import END_THINK

EOS, PAD = "<eos>", "<pad>"


def extract_answer(text: str) -> str | None:
  """The answer words after the last `</think>`, cut at `<eos>`; None when there is no `</think>`."""
  words = text.split()
  if END_THINK not in words:
    return None
  after = words[len(words) - 1 - words[::-1].index(END_THINK) + 1:]
  if EOS in after:
    after = after[:after.index(EOS)]
  return " ".join(w for w in after if w != PAD)


@register("synthetic")
def synthetic_reward(completion_text: str, answer: str) -> float:
  """1.0 iff the text after the last `</think>` (up to `<eos>`) is exactly the answer digit."""
  got = extract_answer(completion_text)
  return 1.0 if got is not None and got == str(answer).strip() else 0.0
