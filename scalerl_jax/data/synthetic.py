"""Synthetic verifiable task for the tiny CPU demo: running digit sum modulo 10 with a thinking trace.

A problem is `num_terms` digits d_1..d_n (default 8). The answer is (d_1 + ... + d_n) mod 10. The gold
"thinking" is the chain of partial sums s_i = (s_{i-1} + d_i) mod 10, one token each, so every reasoning
step is local (one lookup in a 10x10 table plus attention to the matching prompt digit).

Token format (word-level tokenizer, one token per whitespace-separated word)::

  prompt:      <bos> sum 3 7 2 5 4 1 8 0 = <think>
  completion:  3 0 2 7 1 2 0 0 </think> 0 <eos>
  interrupted: 3 0 2 Okay, time is up. Let me stop thinking and formulate a final answer now. </think> 2 <eos>

The prompt ends with `<think>` (like R1-style chat templates), so a completion starts with reasoning.
The verifier (`reward`) reads the text after the LAST `</think>` up to `<eos>`; it must be exactly the
answer digit (no `</think>` -> 0; trailing junk -> 0).

Difficulty knob: SFT traces are *noisy* (`step_noise`): each partial sum is replaced, with that
probability, by a random wrong digit and the chain continues from the written value; the trace's answer
is its last written partial sum. A model that imitates these traces samples the correct step with
probability ~(1 - step_noise); errors can cancel mod 10, so its temperature-1 pass rate is
`expected_pass_rate(step_noise, num_terms)` = (1 + 9 (1 - 10 q / 9)^n) / 10 (0.309 for q=0.15, n=8;
an under-trained imitator scores lower, chance is 0.1) while the correct step stays the mode, which RL
can sharpen. See docs/DATA.md.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

from scalerl_jax.rewards import synthetic as rewards_synthetic
from scalerl_jax.types import PromptSpec

BOS, UNK, THINK = "<bos>", "<unk>", "<think>"
PAD, EOS, END_THINK = rewards_synthetic.PAD, rewards_synthetic.EOS, rewards_synthetic.END_THINK
INTERRUPTION_TEXT = ("Okay, time is up. Let me stop thinking and formulate a final answer now. "
                     "</think>")
DIGITS = tuple(str(i) for i in range(10))
TASK_WORDS = ("sum", "=")
# The interruption phrase without its final "</think>" (already a special token).
INTERRUPTION_WORDS = tuple(INTERRUPTION_TEXT.split()[:-1])
VOCAB = (PAD, BOS, EOS, UNK, THINK, END_THINK) + DIGITS + TASK_WORDS + INTERRUPTION_WORDS
VOCAB_SIZE = len(VOCAB)  # 32; a model may use a larger (padded) vocab: extra ids decode as <unk:N>
MODULUS = 10
HELDOUT_ID_OFFSET = 1 << 30   # held-out prompt ids are HELDOUT_ID_OFFSET + i (train ids are 0..n-1)
DEFAULT_NUM_TERMS = 8
DEFAULT_STEP_NOISE = 0.15
DEFAULT_INTERRUPT_PROB = 0.05

assert len(set(VOCAB)) == len(VOCAB), "duplicate vocabulary entries"


class SyntheticTokenizer:
  """Fixed word-level tokenizer: `encode` splits on whitespace; digit runs ("307") split per digit.

  `vocab` defaults to this task's 32 words; a task that extends it (data/tiny_code.py) passes a
  superset whose first 32 words are these, so token ids mean the same in both."""

  def __init__(self, vocab: tuple[str, ...] = VOCAB):
    self.vocab = tuple(vocab)
    self._ids = {w: i for i, w in enumerate(self.vocab)}
    self.pad_id, self.bos_id, self.eos_id = self._ids[PAD], self._ids[BOS], self._ids[EOS]
    self.unk_id = self._ids[UNK]
    self.think_id, self.end_think_id = self._ids[THINK], self._ids[END_THINK]

  @property
  def vocab_size(self) -> int:
    return len(self.vocab)

  def token_id(self, word: str) -> int:
    if word not in self._ids:
      raise KeyError(f"synthetic tokenizer: {word!r} is not in the vocabulary {self.vocab}")
    return self._ids[word]

  def encode(self, text: str) -> list[int]:
    """Whitespace-split `text`; every word must be in the vocabulary (digit runs split per digit)."""
    ids = []
    for word in text.split():
      if word in self._ids:
        ids.append(self._ids[word])
      elif word.isdigit() and word.isascii():
        ids.extend(self._ids[ch] for ch in word)
      else:
        raise ValueError(f"synthetic tokenizer: unknown word {word!r} in {text!r}")
    return ids

  def decode(self, ids: Iterable[int]) -> str:
    """Space-joined words; ids outside the vocabulary decode as `<unk:N>` (never raises)."""
    words = []
    for i in ids:
      i = int(i)
      words.append(self.vocab[i] if 0 <= i < len(self.vocab) else f"<unk:{i}>")
    return " ".join(words)

  @property
  def interruption_ids(self) -> list[int]:
    """Token ids of the forced-interruption phrase (ends with `</think>`)."""
    return self.encode(INTERRUPTION_TEXT)


TOKENIZER = SyntheticTokenizer()


@dataclasses.dataclass(frozen=True)
class Problem:
  """One synthetic problem. `answer` is the gold answer digit as a string."""
  prompt_id: int
  terms: tuple[int, ...]
  width: int = 0           # > len(terms): the prompt has this many digit slots, the rest `<unk>`

  def __post_init__(self):
    if self.width and self.width < len(self.terms):
      raise ValueError(f"problem {self.prompt_id}: {len(self.terms)} terms in {self.width} slots")

  @property
  def partial_sums(self) -> tuple[int, ...]:
    return tuple(int(x) for x in np.cumsum(self.terms) % MODULUS)

  @property
  def answer(self) -> str:
    return str(self.partial_sums[-1])

  @property
  def prompt_text(self) -> str:
    slots = [*map(str, self.terms), *[UNK] * max(0, self.width - len(self.terms))]
    return " ".join([BOS, "sum", *slots, "=", THINK])

  @property
  def prompt_tokens(self) -> np.ndarray:
    return np.asarray(TOKENIZER.encode(self.prompt_text), np.int32)

  @property
  def gold_completion_text(self) -> str:
    return " ".join([*map(str, self.partial_sums), END_THINK, self.answer, EOS])

  @property
  def gold_completion_tokens(self) -> np.ndarray:
    return np.asarray(TOKENIZER.encode(self.gold_completion_text), np.int32)

  def to_prompt_spec(self) -> PromptSpec:
    return PromptSpec(prompt_id=self.prompt_id, tokens=self.prompt_tokens, answer=self.answer)


def expected_pass_rate(step_noise: float = DEFAULT_STEP_NOISE,
                       num_terms: int = DEFAULT_NUM_TERMS) -> float:
  """P(final answer correct) for a policy whose every step errs w.p. `step_noise` uniformly.

  The final written sum is the true sum plus the sum of per-step error offsets mod 10; each offset's
  non-zero Fourier coefficient is 1 - 10 q / 9, hence (1 + 9 (1 - 10 q / 9)^n) / 10.
  """
  return (1.0 + 9.0 * (1.0 - 10.0 * step_noise / 9.0) ** num_terms) / 10.0


def _num_terms(rng: np.random.Generator, num_terms) -> int:
  if isinstance(num_terms, (tuple, list)):
    lo, hi = num_terms
    return int(rng.integers(lo, hi + 1))
  return int(num_terms)


def _draw(rng, count, num_terms, exclude, first_id, width=0):
  out, seen = [], set(exclude)
  space = (MODULUS ** (max(num_terms) if isinstance(num_terms, (tuple, list)) else num_terms))
  if count + len(seen) > space // 2:
    raise ValueError(f"asked for {count} problems but only {space} distinct ones exist")
  while len(out) < count:
    terms = tuple(int(x) for x in rng.integers(0, MODULUS, _num_terms(rng, num_terms)))
    if terms in seen:
      continue
    seen.add(terms)
    out.append(Problem(prompt_id=first_id + len(out), terms=terms, width=width))
  return out


def make_split(seed: int = 0, n_train: int = 4096, n_heldout: int = 64,
               num_terms: int | tuple[int, int] = DEFAULT_NUM_TERMS,
               width: int = 0) -> tuple[list[Problem], list[Problem]]:
  """Deterministic (train, heldout) problems; held-out is drawn first from its own stream.

  The held-out set depends only on (seed, n_heldout, num_terms), never on n_train, and no train
  problem equals a held-out problem (asserted). Problems are distinct within each split.
  `num_terms` is an int or an inclusive (lo, hi) range. `width` > 0 writes every prompt in that
  many digit slots (the unused ones `<unk>`): thinking step i then reads prompt slot i at the same
  offset whatever the problem's length, which a tiny model learns (without it, 2-24 digits stay at
  chance after 600 SFT steps: NOTES.md of 2026-12-05 (2-core AMD EPYC)).
  """
  if n_train < 0 or n_heldout < 0:
    raise ValueError(f"n_train={n_train} and n_heldout={n_heldout} must be >= 0")
  heldout = _draw(np.random.default_rng([seed, 0xE7A1]), n_heldout, num_terms, (), HELDOUT_ID_OFFSET, width)
  held_keys = {p.terms for p in heldout}
  train = _draw(np.random.default_rng([seed, 0x7A1A]), n_train, num_terms, held_keys, 0, width)
  assert not held_keys & {p.terms for p in train}, "held-out overlaps train"
  return train, heldout


@dataclasses.dataclass(frozen=True)
class SFTExample:
  """Prompt + (possibly noisy) trace. `loss_mask` is True on completion tokens the policy should
  learn (False on the prompt and on the injected interruption phrase)."""
  prompt_id: int
  tokens: np.ndarray       # int32 [T]
  loss_mask: np.ndarray    # bool [T]
  prompt_len: int
  correct: bool            # whether the trace's final answer is the gold answer
  interrupted: bool


def sft_example(problem: Problem, rng: np.random.Generator, step_noise: float = DEFAULT_STEP_NOISE,
                interrupt_prob: float = DEFAULT_INTERRUPT_PROB) -> SFTExample:
  """One SFT example. Each partial sum is wrong w.p. `step_noise` (the chain continues from the
  written value); w.p. `interrupt_prob` the trace is cut after k < n steps, the interruption phrase is
  injected (masked out of the loss) and the answer is the last written partial sum."""
  if not 0.0 <= step_noise <= 1.0 or not 0.0 <= interrupt_prob <= 1.0:
    raise ValueError(f"step_noise={step_noise}, interrupt_prob={interrupt_prob} must be in [0, 1]")
  written, s = [], 0
  for d in problem.terms:
    s = (s + d) % MODULUS
    if rng.random() < step_noise:
      s = int((s + rng.integers(1, MODULUS)) % MODULUS)   # a uniformly random wrong digit
    written.append(s)
  interrupted = len(written) > 1 and rng.random() < interrupt_prob
  if interrupted:
    written = written[:int(rng.integers(1, len(written)))]
  prompt = list(problem.prompt_tokens)
  think = TOKENIZER.encode(" ".join(map(str, written)))
  inject = TOKENIZER.interruption_ids if interrupted else [TOKENIZER.end_think_id]
  answer = [TOKENIZER.token_id(str(written[-1])), TOKENIZER.eos_id]
  tokens = prompt + think + inject + answer
  mask = [False] * len(prompt) + [True] * len(think) + [not interrupted] * len(inject) + [True] * 2
  return SFTExample(problem.prompt_id, np.asarray(tokens, np.int32), np.asarray(mask, bool),
                    len(prompt), str(written[-1]) == problem.answer, interrupted)


def sft_examples(problems: Sequence[Problem], seed: int = 0, step_noise: float = DEFAULT_STEP_NOISE,
                 interrupt_prob: float = DEFAULT_INTERRUPT_PROB) -> list[SFTExample]:
  """Deterministic SFT examples (one per problem) for `problems`."""
  rng = np.random.default_rng([seed, 0x5F7])
  return [sft_example(p, rng, step_noise, interrupt_prob) for p in problems]


def pad_batch(examples: Sequence[SFTExample], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads examples to `[N, length]` -> (tokens int32, loss_mask bool); pad id is 0."""
  length = length or max(len(e.tokens) for e in examples)
  tokens = np.full((len(examples), length), TOKENIZER.pad_id, np.int32)
  mask = np.zeros((len(examples), length), bool)
  for i, e in enumerate(examples):
    if len(e.tokens) > length:
      raise ValueError(f"example {e.prompt_id} has {len(e.tokens)} tokens > length {length}")
    tokens[i, :len(e.tokens)] = e.tokens
    mask[i, :len(e.tokens)] = e.loss_mask
  return tokens, mask


def extract_answer(completion: str | Sequence[int] | np.ndarray) -> str | None:
  """The answer text after the last `</think>`, cut at `<eos>`; None when there is no `</think>`."""
  text = completion if isinstance(completion, str) else TOKENIZER.decode(completion)
  return rewards_synthetic.extract_answer(text)


def reward(completion: str | Sequence[int] | np.ndarray, answer: str) -> float:
  """1.0 iff the text after the last `</think>` (up to `<eos>`) is exactly the answer digit."""
  text = completion if isinstance(completion, str) else TOKENIZER.decode(completion)
  return rewards_synthetic.synthetic_reward(text, answer)
