"""Length control helpers (PAPER_NOTES §3), pure numpy so both generator backends share them.

Forced interruption: when thinking exceeds a budget drawn uniformly in [think_budget_min,
think_budget_max], the generator appends the interruption text ("Okay, time is up. ... </think>") and
lets the model answer for up to `answer_budget` more tokens (`think_budget` draws the budget; each
backend injects the tokens its own way). The injected tokens are not the policy's: they are flagged
`policy_mask=False` (kept out of the loss) and carry log-prob 0.
Length penalty (the studied alternative): on correct traces the reward gets
clip((L_max - |y|) / L_cache - 1, -1, 0) added (L_max=14336, L_cache=2048 by default).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import numpy as np

from scalerl_jax.types import SamplingSpec


# The completion-length bound (think_budget_max + the injected text's allowance + answer_budget)
# is a pure function of the rollout section: the config layer's, re-exported here.
from scalerl_jax.config import INTERRUPTION_ALLOWANCE as INTERRUPTION_ALLOWANCE
from scalerl_jax.config import max_completion_len as max_completion_len


def think_budget(seed: int, prompt_id: int, sample: int, lo: int, hi: int) -> int:
  """The thinking budget of sample `sample` of prompt `prompt_id`: uniform over the integers in
  [lo, hi] (both inclusive), reproducible per (seed, prompt, sample) whatever the batch around it.
  Both backends draw here (the JAX sampler per row, the vLLM worker per request)."""
  if not 0 <= lo <= hi:
    raise ValueError(f"need 0 <= think_budget_min <= think_budget_max, got [{lo}, {hi}]")
  rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(prompt_id) & 0xFFFFFFFF, int(sample)])
  return int(rng.integers(lo, hi + 1))


def length_penalty(length: int | np.ndarray, l_max: int = 14336, l_cache: int = 2048
                   ) -> float | np.ndarray:
  """clip((L_max - |y|) / L_cache - 1, -1, 0): 0 up to L_max - L_cache, linear to -1 at L_max."""
  if l_cache <= 0 or l_max <= l_cache:
    raise ValueError(f"need 0 < L_cache < L_max, got L_max={l_max}, L_cache={l_cache}")
  p = np.clip((l_max - np.asarray(length, np.float64)) / l_cache - 1.0, -1.0, 0.0)
  return float(p) if np.ndim(p) == 0 else p


def apply_length_penalty(reward: float | np.ndarray, length: int | np.ndarray,
                         correct: bool | np.ndarray, l_max: int = 14336, l_cache: int = 2048
                         ) -> float | np.ndarray:
  """The reward transform: correct traces get `length_penalty` added; others are unchanged."""
  r = np.asarray(reward, np.float64) + np.where(correct, length_penalty(length, l_max, l_cache), 0.0)
  return float(r) if np.ndim(r) == 0 else r


# ----------------------------------------------------------------------------- end of thinking
# THE rule both backends use to decide where thinking ended (the JAX sampler inside its jitted
# decode loop, the vLLM worker on the token ids vLLM returns):
#
#   thinking ends at the first generated token after which the decoded text of the completion so
#   far contains `think_end_text` ("</think>"), read token by token.
#
# A tokenizer may split "</think>" into several tokens (Llama-3-style byte-level BPE: "</",
# "think", ">") and merge its ends with the neighbouring text ("</think>\n" -> "</", "think",
# ">\n"), so neither "the first token of </think>" nor "the exact id sequence of encode('</think>')"
# is right. The rule is run as a token-level automaton (KMP over the decoded text of each token):
# a per-row int state, one table lookup per token, jit-friendly. Only the few vocabulary tokens
# that can advance a partial match or complete one matter (`think_end_vocab`); every other token
# resets the state. Without the vocabulary's texts (the built-in word-level tasks, whose
# "</think>" is one special token) the rule is the exact id sequence `think_end_tokens`, run by the
# same automaton over one private symbol per distinct id.

_SYMBOL0 = 0xE000   # Unicode private-use area: one symbol per distinct id in id mode


def _kmp_failure(pattern: str) -> list[int]:
  """fail[i] = length of the longest proper border of pattern[:i] (KMP), for i in 0..len."""
  fail = [0] * (len(pattern) + 1)
  k = 0
  for i in range(1, len(pattern)):
    while k and pattern[i] != pattern[k]:
      k = fail[k]
    if pattern[i] == pattern[k]:
      k += 1
    fail[i + 1] = k
  return fail


def _read(pattern: str, fail: list[int], state: int, text: str) -> tuple[int, bool]:
  """(state after reading `text` from `state`, whether `pattern` was completed inside it)."""
  m, hit = len(pattern), False
  for ch in text:
    while state and (state == m or pattern[state] != ch):
      state = fail[state]
    if pattern[state] == ch:
      state += 1
    hit |= state == m
  return state, hit


def think_end_vocab(texts: Sequence[str], end_text: str = "</think>"
                    ) -> tuple[tuple[int, str], ...]:
  """The (id, decoded text) pairs of the vocabulary tokens that take part in writing `end_text`:
  those that complete it, or leave (from some partial match, incl. none) a partial match. `texts`
  is the decoded text of every id (texts[i] = decode([i])). All other tokens reset a match.
  Cached per (texts, end_text)."""
  return _think_end_vocab(tuple(texts), str(end_text))


@functools.lru_cache(maxsize=4)
def _think_end_vocab(texts: tuple[str, ...], end_text: str) -> tuple[tuple[int, str], ...]:
  if not end_text:
    raise ValueError("think_end_text is empty: give the text that closes the thinking (</think>)")
  fail, first, rest = _kmp_failure(end_text), end_text[0], set(end_text[1:])
  out = []
  for i, w in enumerate(texts):
    if not w or (first not in w and w[0] not in rest):   # cannot start, continue or end a match
      continue
    if any(_read(end_text, fail, s, w) != (0, False) for s in range(len(end_text))):
      out.append((i, w))
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class ThinkEndAutomaton:
  """The end-of-thinking rule compiled to a token-level automaton (see the rule above).

  `ids` [R] are the tokens that matter; column R of the tables stands for every other token.
  `next_state[s, c]` / `hit[s, c]` [S+1, R+1]: the state after token column c from state s, and
  whether the text `end` was completed by it. State 0 = no partial match."""
  ids: np.ndarray
  next_state: np.ndarray
  hit: np.ndarray

  def columns(self, vocab_size: int) -> np.ndarray:
    """Dense token id -> table column map [vocab_size] int32 (for a jitted lookup)."""
    col = np.full((vocab_size,), len(self.ids), np.int32)
    ok = (self.ids >= 0) & (self.ids < vocab_size)
    col[self.ids[ok]] = np.nonzero(ok)[0].astype(np.int32)
    return col

  def end_index(self, tokens: Sequence[int]) -> int:
    """Index just past the token that ends thinking in `tokens` (generated ids), or -1."""
    where = {int(t): c for c, t in enumerate(self.ids)}
    other, state = len(self.ids), 0
    for i, t in enumerate(tokens):
      c = where.get(int(t), other)
      if self.hit[state, c]:
        return i + 1
      state = int(self.next_state[state, c])
    return -1


@functools.lru_cache(maxsize=8)
def _automaton(think_end_tokens: tuple[int, ...], think_end_text: str,
               vocab: tuple[tuple[int, str], ...]) -> ThinkEndAutomaton:
  if vocab:
    pattern, pairs = think_end_text, vocab
  else:   # id mode: the exact id sequence, one private symbol per distinct id
    sym = {t: chr(_SYMBOL0 + k) for k, t in enumerate(dict.fromkeys(think_end_tokens))}
    pattern, pairs = "".join(sym[t] for t in think_end_tokens), tuple((t, sym[t]) for t in sym)
  R = len(pairs)
  nxt = np.zeros((len(pattern) + 1, R + 1), np.int32)
  hit = np.zeros((len(pattern) + 1, R + 1), bool)
  if pattern:
    fail = _kmp_failure(pattern)
    for c, (_, w) in enumerate(pairs):
      for s in range(len(pattern)):   # state len(pattern) is never held: thinking has ended
        nxt[s, c], hit[s, c] = _read(pattern, fail, s, w)
  return ThinkEndAutomaton(np.asarray([t for t, _ in pairs], np.int64).reshape(-1), nxt, hit)


def think_end_automaton(think_end_tokens: Sequence[int] = (), think_end_text: str = "",
                        think_end_vocab: Sequence[Sequence] = ()) -> ThinkEndAutomaton:
  """The end-of-thinking automaton of a SamplingSpec's fields (a dict's lists work too): text mode
  when `think_end_vocab` is given (`think_end_text` then required), else the exact id sequence
  `think_end_tokens` (empty: thinking never ends naturally). Cached per distinct rule."""
  vocab = tuple((int(t), str(w)) for t, w in think_end_vocab)
  if vocab and not think_end_text:
    raise ValueError("SamplingSpec.think_end_vocab is set but think_end_text is empty")
  return _automaton(tuple(int(t) for t in think_end_tokens), str(think_end_text), vocab)


def sampling_spec(config, dataset, seed: int, temperature: float | None = None,
                  top_p: float | None = None) -> SamplingSpec:
  """Generation settings: budgets, interruption tokens, stop tokens (config.rollout/generator);
  `temperature` / `top_p` override the generator's (evaluation: config.eval)."""
  r, g = config.rollout, config.generator
  interrupt = config.rl.length_control == "interrupt"
  # Text mode of the end-of-thinking rule when the tokenizer exposes its vocabulary's texts (HF
  # tokenizers: "</think>" may be several tokens); else the exact id sequence (interruption.py).
  texts = getattr(dataset.tokenizer, "vocab_texts", None)
  end_text = getattr(dataset.tokenizer, "think_end_text", "") if texts else ""
  return SamplingSpec(
      temperature=float(g.temperature if temperature is None else temperature),
      top_p=float(g.top_p if top_p is None else top_p), stop_tokens=tuple(dataset.stop_tokens),
      think_budget_min=int(r.think_budget_min), think_budget_max=int(r.think_budget_max),
      answer_budget=int(r.answer_budget), think_end_tokens=tuple(dataset.think_end_tokens),
      think_end_text=end_text,
      think_end_vocab=think_end_vocab(texts, end_text) if texts and end_text else (),
      interruption_tokens=(tuple(dataset.interruption_tokens(r.interruption_text))
                           if interrupt else ()),
      seed=int(seed))
