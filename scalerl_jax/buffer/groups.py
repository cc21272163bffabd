"""A leased group and its stored rollouts, as the buffer keeps them (buffer/state.py admits and
delivers them, buffer/durability.py logs and replays them)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

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
