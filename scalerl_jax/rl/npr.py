"""No-Positive-Resampling (PAPER_NOTES §3): per-prompt pass-rate history; easy prompts retire.

A prompt whose latest pass rate is >= ``threshold`` (0.9 in the paper) is retired permanently: the
data sampler skips it in later epochs. The object is plain Python and round-trips through a
JSON-able dict (``to_dict`` / ``from_dict``) so it is checkpointed next to the learner state.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


class PassRateHistory:
  """Pass-rate history per prompt id.

  Args:
    threshold: retire a prompt when a group's pass rate is >= threshold.
    pass_reward: a completion "passes" when its reward >= pass_reward (rewards 0/1 or ±1 -> 0.5).
  """

  def __init__(self, threshold: float = 0.9, pass_reward: float = 0.5):
    if not 0.0 < threshold <= 1.0:
      raise ValueError(f"threshold must be in (0, 1], got {threshold}")
    self.threshold = float(threshold)
    self.pass_reward = float(pass_reward)
    self._history: dict[int, list[tuple[int, int]]] = {}   # pid -> [(passes, samples), ...]
    self._retired: set[int] = set()

  def update(self, pid: int, rewards: Sequence[float] | np.ndarray) -> float:
    """Records one group's rewards for prompt `pid`; returns its pass rate."""
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if r.size == 0:
      raise ValueError(f"prompt {pid}: empty reward group")
    if not np.all(np.isfinite(r)):
      raise ValueError(f"prompt {pid}: non-finite rewards {r}")
    passes = int(np.sum(r >= self.pass_reward))
    pid = int(pid)
    self._history.setdefault(pid, []).append((passes, int(r.size)))
    rate = passes / r.size
    if rate >= self.threshold:
      self._retired.add(pid)
    return rate

  def update_batch(self, prompt_ids: Sequence[int], rewards: Sequence[float]) -> None:
    """Groups a flat [B] batch by prompt id and updates each prompt once (padding ids < 0 skipped)."""
    ids = np.asarray(prompt_ids).reshape(-1)
    r = np.asarray(rewards, dtype=np.float64).reshape(-1)
    if ids.shape != r.shape:
      raise ValueError(f"prompt_ids {ids.shape} and rewards {r.shape} differ in shape")
    for pid in np.unique(ids[ids >= 0]):
      self.update(int(pid), r[ids == pid])

  def is_retired(self, pid: int) -> bool:
    return int(pid) in self._retired

  def active(self, pids: Iterable[int]) -> list[int]:
    """The prompt ids of `pids` (order kept) that are not retired."""
    return [int(p) for p in pids if int(p) not in self._retired]

  def pass_rate(self, pid: int) -> float | None:
    """Latest pass rate of `pid` (None if never seen)."""
    h = self._history.get(int(pid))
    return None if not h else h[-1][0] / h[-1][1]

  @property
  def num_retired(self) -> int:
    return len(self._retired)

  def to_dict(self) -> dict:
    """JSON-able state (string keys)."""
    return dict(threshold=self.threshold, pass_reward=self.pass_reward,
                history={str(k): [list(x) for x in v] for k, v in self._history.items()},
                retired=sorted(self._retired))

  @classmethod
  def from_dict(cls, d: dict) -> "PassRateHistory":
    obj = cls(threshold=d["threshold"], pass_reward=d.get("pass_reward", 0.5))
    obj._history = {int(k): [(int(x[0]), int(x[1])) for x in v] for k, v in d["history"].items()}
    obj._retired = {int(p) for p in d["retired"]}
    return obj
