"""A leased group and its stored rollouts, as the buffer keeps them (buffer/state.py admits and
delivers them, buffer/durability.py logs and replays them)."""
from __future__ import annotations

import dataclasses

from scalerl_jax.protocol import validation as val


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
