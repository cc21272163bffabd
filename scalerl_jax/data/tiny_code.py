"""A tiny code task the CPU demo model can learn: write a one-line program that prints a value.

A problem is `num_terms` digits joined by operators from `+ - *` (default 6 digits). The model must
write a Python program whose output equals the expression's value; the verifier (rewards/tiny_code.py)
runs the program in the bubblewrap sandbox (one fresh sandbox per run) and compares its stdout with
the target. Token format (word-level, the digit-sum vocabulary plus 7 words)::

  prompt:      <bos> code 3 + 7 * 2 - 5 * 1 + 8 = <think>
  completion:  </think> print ( 3 + 7 * 2 - 5 * 1 + 8 ) <eos>        -> print(3+7*2-5*1+8) -> "20"

The gold thinking is empty (the program is the answer); the verifier never sees the expression, only
the target output, so any program printing the right value passes. SFT traces are noisy like the
digit-sum task's: each digit of the written program is replaced, with probability `step_noise`, by a
uniformly random other digit, so an imitator passes ~(1 - step_noise)^num_terms of the time (0.26 at
q = 0.2, n = 6, plus the rare collisions such as a wrong digit times 0), and RL has to sharpen the
copy. The vocabulary extends synthetic.VOCAB (same ids for the shared 32 words), so this task mixes
with the digit-sum task under one tokenizer (configs/tiny_multitask.py).
"""
from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import numpy as np

from scalerl_jax.data import synthetic
from scalerl_jax.types import PromptSpec

CODE_WORDS = ("code", "print", "(", ")", "+", "-", "*")
OPERATORS = ("+", "-", "*")
VOCAB = synthetic.VOCAB + CODE_WORDS
VOCAB_SIZE = len(VOCAB)          # 39
TOKENIZER = synthetic.SyntheticTokenizer(VOCAB)
HELDOUT_ID_OFFSET = synthetic.HELDOUT_ID_OFFSET
DEFAULT_NUM_TERMS = 6
DEFAULT_STEP_NOISE = 0.2


@dataclasses.dataclass(frozen=True)
class Problem:
  """One expression: digits d_1..d_n and the n-1 operators between them."""
  prompt_id: int
  digits: tuple[int, ...]
  ops: tuple[str, ...]

  @property
  def expression_words(self) -> list[str]:
    out = [str(self.digits[0])]
    for op, d in zip(self.ops, self.digits[1:]):
      out += [op, str(d)]
    return out

  @property
  def target(self) -> str:
    """What the program must print: the expression's value (Python precedence)."""
    return str(eval("".join(self.expression_words), {"__builtins__": {}}))  # digits and + - * only

  @property
  def answer(self) -> str:
    """The verifier's test JSON (the `code` reward's format)."""
    return json.dumps({"tests": [{"input": "", "output": self.target}], "fn_name": None})

  @property
  def prompt_tokens(self) -> np.ndarray:
    words = [synthetic.BOS, "code", *self.expression_words, "=", synthetic.THINK]
    return np.asarray(TOKENIZER.encode(" ".join(words)), np.int32)

  def program_words(self, digits: Sequence[int] | None = None) -> list[str]:
    p = dataclasses.replace(self, digits=tuple(digits)) if digits is not None else self
    return ["print", "(", *p.expression_words, ")"]

  def to_prompt_spec(self):
    return PromptSpec(prompt_id=self.prompt_id, tokens=self.prompt_tokens, answer=self.answer)


def _draw(rng, count: int, num_terms: int, exclude, first_id: int) -> list[Problem]:
  space = 10 ** num_terms * 3 ** (num_terms - 1)
  if count + len(exclude) > space // 2:
    raise ValueError(f"asked for {count} tiny_code problems but only {space} distinct ones exist")
  out, seen = [], set(exclude)
  while len(out) < count:
    digits = tuple(int(x) for x in rng.integers(0, 10, num_terms))
    ops = tuple(OPERATORS[int(i)] for i in rng.integers(0, 3, num_terms - 1))
    if (digits, ops) in seen:
      continue
    seen.add((digits, ops))
    out.append(Problem(first_id + len(out), digits, ops))
  return out


def make_split(seed: int = 0, n_train: int = 4096, n_heldout: int = 32,
               num_terms: int = DEFAULT_NUM_TERMS) -> tuple[list[Problem], list[Problem]]:
  """Deterministic (train, heldout); held-out drawn first from its own stream (depends only on
  seed, n_heldout, num_terms) and never equal to a train problem. Ids as synthetic.make_split."""
  if n_train < 0 or n_heldout < 0 or int(num_terms) < 1:
    raise ValueError(f"n_train={n_train}, n_heldout={n_heldout} >= 0 and num_terms={num_terms} "
                     ">= 1 needed")
  n = int(num_terms)
  held = _draw(np.random.default_rng([seed, 0xC0DE, 1]), n_heldout, n, (), HELDOUT_ID_OFFSET)
  keys = {(p.digits, p.ops) for p in held}
  train = _draw(np.random.default_rng([seed, 0xC0DE, 2]), n_train, n, keys, 0)
  assert not keys & {(p.digits, p.ops) for p in train}, "held-out overlaps train"
  return train, held


def sft_example(problem: Problem, rng: np.random.Generator,
                step_noise: float = DEFAULT_STEP_NOISE) -> synthetic.SFTExample:
  """Prompt + `</think>` + the program (each digit wrong w.p. `step_noise`) + `<eos>`."""
  if not 0.0 <= step_noise <= 1.0:
    raise ValueError(f"step_noise={step_noise} must be in [0, 1]")
  digits = [int((d + rng.integers(1, 10)) % 10) if rng.random() < step_noise else d
            for d in problem.digits]
  prompt = list(problem.prompt_tokens)
  completion = TOKENIZER.encode(" ".join([synthetic.END_THINK, *problem.program_words(digits),
                                          synthetic.EOS]))
  tokens = np.asarray(prompt + completion, np.int32)
  mask = np.asarray([False] * len(prompt) + [True] * len(completion), bool)
  return synthetic.SFTExample(problem.prompt_id, tokens, mask, len(prompt),
                              tuple(digits) == problem.digits, False)


def sft_examples(problems: Sequence[Problem], seed: int = 0,
                 step_noise: float = DEFAULT_STEP_NOISE) -> list[synthetic.SFTExample]:
  """Deterministic SFT examples (one per problem)."""
  rng = np.random.default_rng([seed, 0xC0DE, 3])
  return [sft_example(p, rng, step_noise) for p in problems]


def expected_pass_rate(step_noise: float = DEFAULT_STEP_NOISE,
                       num_terms: int = DEFAULT_NUM_TERMS) -> float:
  """P(all digits copied right) for an exact imitator of the noisy traces (collisions ignored)."""
  return (1.0 - step_noise) ** num_terms
