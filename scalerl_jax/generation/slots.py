"""What a continuous generator works on, backend-free (no JAX, no vLLM): one sample per request
(`SlotRequest`), the requests of a group (`requests_for`), and the counters both continuous
decoders and the drain-per-lease loop keep (`DecodeStats`, sent with the generator's heartbeats).

The decoders: generation/continuous.py `ContinuousDecoder` (the JAX sampler, slot-wise prefill
into a running KV cache) and generation/vllm/generator.py `VLLMSlots` (one vLLM request per
sample, the engine batches them). Both take `insert(requests)` while `free` slots remain and
return finished samples from `step()`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from scalerl_jax.generation.interruption import think_budget
from scalerl_jax.rewards.isolation import FAULTS
from scalerl_jax.types import PromptSpec, SamplingSpec


@dataclasses.dataclass
class SlotRequest:
  """One sample to decode: sample `sample_index` of `prompt`, seeded by `seed` (with the prompt
  id and the sample index), thinking for at most `think_budget` tokens and answering for at most
  `answer_budget`. `tag` is the caller's (e.g. its group); handed back with the completion."""
  prompt: PromptSpec
  sample_index: int
  seed: int
  think_budget: int
  answer_budget: int
  tag: Any = None


def requests_for(prompts: Sequence[PromptSpec], n: int, spec: SamplingSpec, tag: Any = None
                 ) -> list[SlotRequest]:
  """`n` SlotRequests per prompt with the spec's seed and answer budget, and thinking budgets
  drawn as both backends draw them (interruption.think_budget). `tag` (default: the prompt's
  index) goes with every request."""
  return [SlotRequest(p, j, spec.seed, think_budget(spec.seed, p.prompt_id, j,
                                                    spec.think_budget_min, spec.think_budget_max),
                      spec.answer_budget, tag if tag is not None else i)
          for i, p in enumerate(prompts) for j in range(n)]


@dataclasses.dataclass
class DecodeStats:
  """What a decoder did: `live_row_steps` of `slot_steps` (occupancy = their ratio: sequences in
  flight / capacity), of `row_steps` (the rows decode steps computed: the JAX decoder decodes a
  bucket of packed slots, `moves` of them moved down to pack them, and in `window_chunks` of its
  chunks attention read a window of its ring; compute occupancy = live_row_steps / row_steps), seconds decoding, inserting and idle (no slot busy and nothing to
  insert: `note_idle`), and grading (`grade_s`, booked by the generator worker), with the grades
  done and their faults by reason (`graded`, `grade_timeout`, ...: `count_grade`). The
  drain-per-lease loop books the same fields."""
  chunks: int = 0
  slot_steps: int = 0
  live_row_steps: int = 0
  row_steps: int = 0
  moves: int = 0
  window_chunks: int = 0
  tokens: int = 0
  policy_tokens: int = 0
  completions: int = 0
  decode_s: float = 0.0
  insert_s: float = 0.0
  idle_s: float = 0.0
  grade_s: float = 0.0
  weight_failures: int = 0     # weight updates that failed (the generator kept its version)
  delta_fallbacks: int = 0     # weight deltas that did not check: the version was fetched full
  # grades done and those scored 0 by a grading fault (rewards/isolation.py FAULTS), by reason
  graded: int = 0
  grade_timeout: int = 0
  grade_oom: int = 0
  grade_error: int = 0
  grade_guard: int = 0

  HEARTBEAT_KEYS = ("slot_steps", "live_row_steps", "row_steps", "decode_s", "insert_s", "idle_s",
                    "grade_s", "weight_failures", "delta_fallbacks",
                    "graded", "grade_timeout", "grade_oom", "grade_error", "grade_guard")

  def count_grade(self, reason: str) -> None:
    """Books one grade (and its fault, for a grade_* reason). Not thread-safe: callers lock."""
    self.graded += 1
    if reason in FAULTS:
      setattr(self, reason, getattr(self, reason) + 1)

  def heartbeat_stats(self) -> dict[str, float]:
    """The counters a generator reports in its heartbeats (HeartbeatRequest.stats)."""
    return {k: float(getattr(self, k)) for k in self.HEARTBEAT_KEYS}

  @property
  def occupancy(self) -> float:
    """Mean sequences in flight / capacity over the decode steps run."""
    return self.live_row_steps / self.slot_steps if self.slot_steps else 0.0

  @property
  def compute_occupancy(self) -> float:
    """Mean sequences in flight / rows computed over the decode steps run."""
    return self.live_row_steps / self.row_steps if self.row_steps else 0.0

  def as_dict(self) -> dict:
    """Every counter and the occupancy, as a dict (bench and log lines)."""
    return dict(dataclasses.asdict(self), occupancy=self.occupancy,
                compute_occupancy=self.compute_occupancy)


def drive(decoder, requests: Sequence[SlotRequest]) -> list:
  """Decodes all `requests` on a continuous decoder (ContinuousDecoder or VLLMSlots), refilling
  slots as samples finish (`step(refill=True)` while samples wait); returns (request,
  Completion) pairs in finishing order. For benches and tests; the generator worker drives
  insert/step itself (leases, grading, pushes)."""
  pending = list(requests)
  out: list = []
  while pending or decoder.in_flight:
    k = min(decoder.free, len(pending))
    if k:
      decoder.insert(pending[:k])
      pending = pending[k:]
    out.extend(decoder.step(refill=bool(pending)))
  return out
