"""What the buffer knows of its generators from their heartbeats: cumulative counters, the policy
version each samples with, and the relay each serves weights from. Not in the WAL (a restarted
buffer relearns it from the next heartbeats). Callers hold the buffer's lock."""
from __future__ import annotations

from typing import Mapping

from scalerl_jax.protocol.weight_chunks import tree_parents

RETIRED = "(retired)"   # the folded counters of incarnations past MAX_STATS


class Fleet:
  """Per-generator (incarnation) heartbeat facts, bounded in size."""

  MAX_STATS = 256     # counter entries before the oldest is folded into RETIRED
  MAX_SEEN = 4096     # versions / relays before the longest-silent one is forgotten

  def __init__(self) -> None:
    self.stats: dict[str, dict[str, float]] = {}      # generator -> its cumulative counters
    self.versions: dict[str, tuple[int, float]] = {}  # generator -> (version, heartbeat time)
    self.relays: dict[str, tuple[str, float]] = {}    # generator -> (relay address, time)

  def record(self, generator_id: str, stats: Mapping[str, float], version: int | None,
             relay_address: str, now: float) -> None:
    """Books one heartbeat's facts (`stats` already validated)."""
    if stats:
      self.stats[generator_id] = dict(stats)
      if len(self.stats) > self.MAX_STATS:   # many incarnations: fold the oldest into one entry
        old = next(k for k in self.stats if k != RETIRED)
        merged = self.stats.setdefault(RETIRED, {})
        for k, v in self.stats.pop(old).items():
          merged[k] = merged.get(k, 0.0) + v
    if relay_address:
      self._remember(self.relays, generator_id, relay_address, now)
    if version is not None:
      self._remember(self.versions, generator_id, int(version), now)

  def _remember(self, table: dict, generator_id: str, value, now: float) -> None:
    table[generator_id] = (value, now)
    if len(table) > self.MAX_SEEN:
      table.pop(min(table, key=lambda g: table[g][1]))

  def relay_parents(self, generator_id: str, fanout: int, now: float, ttl_s: float) -> list[str]:
    """The relays `generator_id` fetches weights from, nearest ancestor first: the live relays
    (a heartbeat within `ttl_s`) in generator-id order form a tree of `fanout`
    (weights/relay.py); [] for the root, an unknown generator or fanout 0."""
    live = sorted(g for g, (_, t) in self.relays.items() if now - t <= ttl_s)
    if generator_id not in live:
      return []
    return tree_parents(live.index(generator_id), fanout, [self.relays[g][0] for g in live])

  def totals(self, now: float, ttl_s: float, behind_version: int) -> dict[str, float]:
    """The counters summed over every incarnation (each is cumulative, so the sum only grows),
    plus the gauge `generators_behind`: live generators sampling below `behind_version`."""
    total: dict[str, float] = {}
    for st in self.stats.values():
      for k, v in st.items():
        total[k] = total.get(k, 0.0) + v
    if self.versions:
      total["generators_behind"] = float(sum(
          1 for v, t in self.versions.values() if now - t <= ttl_s and v < behind_version))
    return total
