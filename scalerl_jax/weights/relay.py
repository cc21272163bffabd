"""Relay fan-out: generators pass on the weight chunks they fetched, so a learner source sends about
one model's worth of bytes per version whatever the number of generators.

Every generator runs a relay: a `WeightSource` (same bearer token, same TLS as every other channel;
port `weights.relay_port`) into which its `StreamFetcher` stages each chunk message as it arrives
and checks (full or delta, as received; `relay_begin` / `relay_add` / `relay_trailer`). The
generators form a tree of fan-out `weights.relay_fanout` (k) in the order of their ids: generator
j fetches from its parent (j - 1) // k, then its grandparent, ..., then the learner source, so the
learner source serves only the root and every generator uploads at most k streams. A tree, not a
chain: a chain's depth is G (the slowest link and every failure sit on the path of everyone after
it) while a tree's is log_k G; a swarm (chunks from many peers) spreads load further but needs a
chunk-availability protocol this codebase does not have. Chunks flow down the tree as they arrive
(a relay serves a version while it is still fetching it), so depth adds a chunk's latency per
level, not a version's.

A relay that dies or stalls costs its children a fallback: their stream breaks (or does not start
within `StreamFetcher.relay_wait_s`) and they resume from the next ancestor with the chunks they
already hold (`have_chunks`). A relay holding a version as a delta serves it only to fetchers that
hold its base (others get NOT_FOUND and go up the tree). The buffer assigns the tree: each
generator reports its relay address in its heartbeats and gets back its ancestors' addresses
(`BufferState.relay_parents`, `protocol.weight_chunks.tree_parents`). No JAX.
"""
from __future__ import annotations

from typing import Optional

from scalerl_jax import config as common
from scalerl_jax.weights.source import WeightSource


def start_relay(token: str, *, host: str = "0.0.0.0", port: int = 0,
                advertise: Optional[str] = None, tls=None,
                bulk_port: int = common.Weights.relay_bulk_port) -> WeightSource:
  """A generator's relay server: a WeightSource holding one version (the newest being relayed);
  a version older than what its children ask for is not kept (they go up the tree). Its bulk
  channel listens on `bulk_port` (`weights.relay_bulk_port`)."""
  return WeightSource(token, host=host, port=port, advertise=advertise, keep=1, tls=tls,
                      stall_s=10.0, bulk_port=bulk_port)
