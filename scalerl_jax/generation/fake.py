"""Fake generators for tests, benchmarks and wiring demos (no model).

`run_fake_generator` leases groups, "generates" random tokens/log-probs with small random sleeps,
stamps each token with the policy version it last fetched (picking up new versions in flight, as
PipelineRL does, unless the lease pins one version), and streams the group back.

`ScriptedInstructModel` (generator.backend="scripted") is a `Generator` that answers arithmetic
prompts the way an instruct model does, deterministically: in the format the prompt asks for, and
ending its turn at the end-of-turn token otherwise. It exercises the prompt template, the verifier
and the step-0 reward check of a real run (buffer, worker grading, learner) without weights.
"""
from __future__ import annotations

import re
import time
from typing import Optional, Sequence

import grpc
import numpy as np

from scalerl_jax.generation.generator import Engine, Generator
from scalerl_jax.generation.slots import DecodeStats
from scalerl_jax.protocol import codec
from scalerl_jax.protocol.client import BufferClient, assignment_prompt
from scalerl_jax.types import FINISH_LENGTH, FINISH_STOP, Completion, PromptSpec, SamplingSpec


def random_completion(rng: np.random.Generator, prompt_id: int, length: int, version: int,
                      vocab: int = 1000) -> Completion:
  """A completion of random tokens, log-probs in (-inf, 0], all stamped with `version`."""
  return Completion(prompt_id=prompt_id, tokens=rng.integers(0, vocab, length, dtype=np.int32),
                    logprobs=-rng.exponential(1.0, length).astype(np.float32),
                    versions=np.full(length, version, np.int32), policy_mask=np.ones(length, bool),
                    finish_reason=FINISH_STOP if rng.random() < 0.8 else FINISH_LENGTH,
                    reward=float(rng.integers(0, 2)))


def run_fake_generator(address: str, token: str, generator_id: str, seed: int = 0,
                       stop_event=None, max_sleep_s: float = 0.02, min_len: int = 4,
                       max_len: int = 32, max_seconds: float = 300.0,
                       log_queue=None) -> int:
  """Generator loop; returns the number of rollouts acknowledged. Ends on `stop_event`, after
  `max_seconds`, or when the server goes away."""
  rng = np.random.default_rng(seed)
  c = BufferClient(address, token, retries=2)
  version: Optional[int] = None
  acked = 0
  end = time.time() + max_seconds
  try:
    got = c.fetch_version(-1, wait_timeout_s=60)
    version = got if got is not None else 0
    while time.time() < end and not (stop_event is not None and stop_event.is_set()):
      for a in c.lease(generator_id, max_groups=1, wait_timeout_s=0.2):
        if version < a.min_version:                       # must generate with >= min_version
          got = c.fetch_version(version, wait_timeout_s=60)
          version = got if got is not None else version
        p = assignment_prompt(a)
        pinned = a.max_version >= 0
        rollouts = []
        for i in range(a.group_size):
          L = int(rng.integers(min_len, max_len + 1))
          comp = random_completion(rng, a.prompt_id, L, version)
          time.sleep(rng.random() * max_sleep_s)
          if not pinned and rng.random() < 0.5:           # in-flight weight update mid-sequence
            got = c.fetch_version(version, wait_timeout_s=0)
            if got is not None:
              version = got
              cut = int(rng.integers(1, L))
              comp.versions[cut:] = version
          rollouts.append(codec.completion_to_rollout(
              comp, group_id=a.group_id, sample_index=i, prompt_tokens=p.tokens,
              generator_id=generator_id))
        try:
          acks = c.push(rollouts)
          acked += sum(1 for x in acks if not x.duplicate)
          if log_queue is not None:
            log_queue.put((generator_id, a.group_id, [x.rollout_id for x in acks]))
        except grpc.RpcError as e:
          if e.code() != grpc.StatusCode.FAILED_PRECONDITION:   # lease expired: drop the group
            raise
  except grpc.RpcError as e:
    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
      raise
  finally:
    c.close()
  return acked


_ARITH = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)")
SCRIPTED_LOGPROB = -0.5          # the log-prob the scripted model reports for each of its tokens


def solve_arithmetic(text: str) -> int | None:
  """The value of the first `a + b` / `a - b` / `a * b` in `text` (None when there is none)."""
  m = _ARITH.search(text)
  if m is None:
    return None
  a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
  return a + b if op == "+" else a - b if op == "-" else a * b


def scripted_reply(prompt_text: str, sample_index: int) -> str:
  """What the scripted instruct model writes after `prompt_text` (without the end-of-turn token).

  - the assistant turn is pre-filled with `<think>` (template reasoning_instruct): it goes on
    reasoning, closes it with `</think>` and boxes the answer;
  - the user turn asks for `\\boxed{}` (template instruct): a boxed answer, no `</think>`;
  - otherwise (template bare): a plain sentence, no `</think>`, no box.
  Even samples are right, odd ones are off by one (every group has reward variance)."""
  v = solve_arithmetic(prompt_text)
  if v is None:
    return "I do not know."
  if sample_index % 2:
    v += 1
  if prompt_text.rstrip().endswith("<think>"):
    return f"I compute the expression step by step. It equals {v}.\n</think>\n\nThe answer is \\boxed{{{v}}}."
  if "\\boxed" in prompt_text:
    return f"Computing the expression gives {v}, so the answer is \\boxed{{{v}}}."
  return f"The answer is {v}."


# Answers whose exact value no machine can compute (rewards/isolation.py must contain them): what
# `generator.scripted_hostile_every` makes the scripted model box (in turn).
HOSTILE_ANSWERS = ("2^{2^{40}}", "10^{10^{10}}", "9999999999^{9999999999}", "(10^9)!",
                   "7^{10^7}")


class ScriptedInstructModel(Generator):
  """generator.backend="scripted": `scripted_reply` to each prompt (decoded with `tokenizer`),
  encoded and ended with the first stop token, every token at log-prob SCRIPTED_LOGPROB and
  stamped with the current version. Weight updates only move the version (no weights).
  `hostile_every` N > 0: every Nth sample (counted over the process) replaces its boxed answer
  with one of HOSTILE_ANSWERS."""

  def __init__(self, tokenizer, version: int = 0, hostile_every: int = 0):
    self.tokenizer = tokenizer
    self._version = int(version)
    self._pending: int | None = None
    self.hostile_every = int(hostile_every)
    self.samples = 0        # samples written so far
    self.hostile = 0        # of them hostile

  def reply_tokens(self, text: str, sample_index: int, spec: SamplingSpec) -> tuple[list, str]:
    """The tokens of one scripted sample (stop token included) and its finish reason."""
    reply = scripted_reply(text, sample_index)
    self.samples += 1
    if self.hostile_every and self.samples % self.hostile_every == 0 and "\\boxed{" in reply:
      reply = reply[:reply.index("\\boxed{")] + "\\boxed{%s}." % HOSTILE_ANSWERS[
          self.hostile % len(HOSTILE_ANSWERS)]
      self.hostile += 1
    toks = list(self.tokenizer.encode(reply)) + list(spec.stop_tokens[:1])
    budget = int(spec.think_budget_max) + int(spec.answer_budget)
    if len(toks) > budget:
      return toks[:budget], FINISH_LENGTH
    return toks, FINISH_STOP

  def completion(self, prompt: PromptSpec, toks: list, reason) -> Completion:
    """A Completion of `toks` at the current version."""
    L = len(toks)
    return Completion(prompt_id=prompt.prompt_id, tokens=np.asarray(toks, np.int32),
                      logprobs=np.full(L, SCRIPTED_LOGPROB, np.float32),
                      versions=np.full(L, self._version, np.int32), policy_mask=np.ones(L, bool),
                      finish_reason=reason)

  @property
  def version(self) -> int:
    return self._version

  def load_weights(self, weights, version: int) -> None:
    self._pending = int(version)

  def load_params(self, params, version: int, model_cfg=None) -> None:
    self._pending = int(version)

  def apply_pending(self) -> None:
    if self._pending is not None and (self.max_version is None or self._pending <= self.max_version):
      self._version, self._pending = self._pending, None

  def generate(self, prompts: Sequence[PromptSpec], n: int,
               spec: SamplingSpec) -> list[list[Completion]]:
    self.apply_pending()
    out = []
    for p in prompts:
      text = self.tokenizer.decode(p.tokens)
      out.append([self.completion(p, *self.reply_tokens(text, i, spec)) for i in range(n)])
    return out


class ScriptedSlots:
  """The scripted model as a continuous decoder (generation/slots.py interface): each `step`
  "decodes" one token of every sample in flight (`capacity` slots); a sample ends when its
  scripted tokens are out. For tests of the continuous loop with text-level answers (no JAX)."""

  def __init__(self, gen: ScriptedInstructModel, capacity: int, spec: SamplingSpec):
    self.gen, self.capacity, self.spec = gen, int(capacity), spec
    self.stats = DecodeStats()
    self._live: list = []          # [request, tokens, reason, steps left]

  @property
  def free(self) -> int:
    return self.capacity - len(self._live)

  @property
  def in_flight(self) -> list:
    return [r for r, *_ in self._live]

  def insert(self, requests) -> None:
    """Starts `requests` (at most `free`)."""
    if len(requests) > self.free:
      raise ValueError(f"{len(requests)} requests for {self.free} free slots")
    for r in requests:
      toks, reason = self.gen.reply_tokens(self.gen.tokenizer.decode(r.prompt.tokens),
                                           r.sample_index, self.spec)
      self._live.append([r, toks, reason, len(toks)])

  def step(self, refill: bool = False) -> list:
    """One decode step of every sample in flight; returns the (request, Completion) that ended."""
    self.gen.apply_pending()
    t = time.perf_counter()
    self.stats.chunks += 1
    self.stats.slot_steps += self.capacity
    self.stats.row_steps += len(self._live)
    self.stats.live_row_steps += len(self._live)
    done, keep = [], []
    for e in self._live:
      e[3] -= 1
      (done if e[3] <= 0 else keep).append(e)
    self._live = keep
    self.stats.decode_s += time.perf_counter() - t
    return [(r, self.gen.completion(r.prompt, toks, reason)) for r, toks, reason, _ in done]

  def note_idle(self, seconds: float) -> None:
    """Books `seconds` waited with free slots and nothing to insert."""
    self.stats.idle_s += float(seconds)


class ScriptedEngine(Engine):
  """The "scripted" generator backend (generation/backends.py): a ScriptedInstructModel on the
  dataset's tokenizer; it needs no weights (`needs_params` False); its continuous decoder is
  `ScriptedSlots` (one token per step)."""

  needs_params = False

  def make(self, model_cfg, params, version, workdir, dataset) -> ScriptedInstructModel:
    return ScriptedInstructModel(dataset.tokenizer, version=version,
                                 hostile_every=self.config.generator.scripted_hostile_every)

  def continuous(self, gen, spec, capacity=None) -> ScriptedSlots:
    assert isinstance(gen, ScriptedInstructModel), type(gen)
    return ScriptedSlots(gen, capacity or self.config.generator.decode_batch, spec)
