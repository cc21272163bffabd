"""A leased group and its stored rollouts, as the buffer keeps them (buffer/state.py admits and
delivers them, buffer/durability.py logs and replays them)."""
from __future__ import annotations

import collections
import dataclasses
from typing import Iterable, Sequence

from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.protocol import wire


@dataclasses.dataclass
class Stored:
  """One accepted rollout of a group: its id, its serialized bytes and what validation found."""
  rollout_id: str
  raw: bytes                       # the serialized Rollout (a view of the request bytes), forwarded
                                   # unchanged to the learner
  checked: val.Checked


@dataclasses.dataclass
class Group:
  """A leased group: its lease, the generator holding it, its deadline (the last learner step
  that may train on it), its lease expiry and the rollouts stored so far."""
  view: val.LeaseView
  generator_id: str
  deadline: int
  expires_at: float
  samples: dict = dataclasses.field(default_factory=dict)   # sample_index -> Stored
  completed_seq: int = -1          # completion order, for FIFO among equal deadlines

  @property
  def complete(self) -> bool:
    return len(self.samples) == self.view.group_size

  @property
  def max_version(self) -> int:
    """The newest policy version among the stored tokens (-1 when none is stored)."""
    return max((st.checked.min_version + len(st.checked.version_counts) - 1
                for st in self.samples.values()), default=-1)


def group_item_bytes(g: Group) -> bytes:
  """Serializes `BatchItem{group: Group}` by splicing the stored rollout bytes (one copy, no
  re-encoding of the payload)."""
  parts = [pb.Group(group_id=g.view.group_id, prompt_id=g.view.prompt_id).SerializeToString()]
  for i in range(g.view.group_size):
    raw = g.samples[i].raw
    parts += (b"\x1a", wire.varint(len(raw)), raw)   # Group field 3 (rollouts), wire type 2
  inner = sum(len(p) for p in parts)
  return b"".join([b"\x0a", wire.varint(inner)] + parts)  # BatchItem field 1 (group), wire type 2


def lag_histogram(counts: Sequence[int], negative: int) -> pb.LagHistogram:
  """The wire histogram of policy lags (`counts[i]`: rollouts i versions behind)."""
  nz = [i for i, c in enumerate(counts) if c]
  return pb.LagHistogram(counts=list(counts), negative=negative, max_lag=nz[-1] if nz else 0)


class PromptQueue(collections.deque):
  """The prompt sampler's queue (prompt ids, next first). Prompts whose group went back (a lease
  that expired or was released, a learner rewind) are at its front in lease order (group id), as
  they were first leased: `returned` holds those groups' ids, one per front entry. So the order
  of the next leases does not depend on how the groups came back (released on SIGTERM, then
  rewound; or rewound alone), and a resumed run leases what the uninterrupted one did."""

  def __init__(self, items: Iterable[int] = ()):
    super().__init__(items)
    self.returned: collections.deque = collections.deque()   # group ids of the front entries

  def popleft(self) -> int:
    if self.returned:
      self.returned.popleft()
    return super().popleft()

  def remove(self, value: int) -> None:
    i = self.index(value)
    del self[i]
    if i < len(self.returned):
      del self.returned[i]

  def clear(self) -> None:
    super().clear()
    self.returned.clear()

  def put_back(self, groups: Iterable[tuple[int, int]]) -> None:
    """Puts (group id, prompt id) pairs back at the front, merged with the prompts already
    returned there, in group-id (lease) order."""
    pairs = [(g, super(PromptQueue, self).popleft()) for g in self.returned]
    pairs = sorted(pairs + [(int(g), int(p)) for g, p in groups])
    self.extendleft(reversed([p for _, p in pairs]))
    self.returned = collections.deque(g for g, _ in pairs)

  def restore(self, order: Sequence[int], returned: Sequence[int] = ()) -> None:
    """Replaces the contents (a WAL snapshot's QUEUE record)."""
    self.clear()
    self.extend(order)
    self.returned.extend(int(g) for g in returned[:len(order)])
