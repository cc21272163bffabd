"""Streamed weight updates: sharded learner params -> buffer -> generator, chunk by chunk.

Learner (every host of a multi-host learner runs the same call):
  pub = StreamPublisher(client, version, params)     # params: pytree of (sharded) jax.Arrays
  ack = pub.publish()                                # sends this host's chunks; resumes on breaks
Generator:
  f = StreamFetcher(client)
  got = f.fetch(have_version, wait_timeout_s=30)     # FetchedWeights(version, params) or None

Format "scalerl-params-v1": the manifest lists every leaf of the params pytree (its tree path, dtype,
global shape) and a chunk table: each chunk is a box [start, start + extent) of one leaf. The boxes
are the distinct shards of each leaf's sharding (`devices_indices_map`, replicas once), split along
their first dimension into pieces of at most `chunk_bytes`, so every host can compute the same table
without any communication. A box belongs to the lowest-id device that holds it; each host sends the
boxes whose owner device is one of its own (`process_index`), so no host ever gathers the model: it
holds one chunk at a time (on CPU a zero-copy view of its shard; on accelerators the chunk's slice is
copied device -> host). The buffer makes the version visible once all hosts' chunks arrived and
their checksums matched.

Chunks carry a CRC-32C (hardware, ~25 GB/s here; manifest "checksum", zlib CRC-32 for old
publishers). With `source=` (a weights.source.WeightSource in each learner process) the chunks are
staged on the learner hosts and the buffer only gets the manifest with "sources"/"owners" (a remote
version): generators fetch each host's chunks from that host, one hop instead of two.

The fetcher takes each version's arrays from its `ArrayPool` (weights/pool.py: 64-byte aligned, so
on CPU `jax.device_put` adopts them without a copy; the arrays of a version that nothing holds any
more, the generator, the evaluation lane or the fetcher's delta base, are reused, so the pages are
already mapped) and writes every chunk's bytes straight into its box as the chunk arrives: the
generator holds the new model once plus one chunk in flight per source. A version's digest
trailer is checked from the CRCs each chunk was verified with on arrival (no second pass). A fetch
that breaks keeps what it got; the next `fetch` resumes the same version with `have_chunks` (the
server skips them), unless a newer version was published meanwhile.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import math
import socket
from typing import Any, Callable, Iterator, NamedTuple, Optional

import grpc
import jax
import ml_dtypes
import numpy as np
from jax import tree_util as tu

from scalerl_jax import config as common
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.types import WeightUpdateError
from scalerl_jax.weights import bulk as wb
from scalerl_jax.weights import delta as wd
from scalerl_jax.weights.delta import DeltaEncoder
from scalerl_jax.weights.pool import ArrayPool

log = logging.getLogger("scalerl.weight_stream")
FORMAT = "scalerl-params-v1"
_RESUMABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)


class FetchedWeights(NamedTuple):
  """One fetched weight version: `params` is the pytree in our layout (host numpy arrays, as the
  manifest lists the leaves), assembled in place by `StreamFetcher`."""
  version: int
  params: Any


def _np_dtype(name: str) -> np.dtype:
  if name == "bfloat16":
    return np.dtype(ml_dtypes.bfloat16)
  return np.dtype(name)


def _path_key(k) -> str | int:
  if isinstance(k, (tu.DictKey, tu.FlattenedIndexKey)):
    return k.key
  if isinstance(k, tu.SequenceKey):
    return int(k.idx)
  if isinstance(k, tu.GetAttrKey):
    return k.name
  raise TypeError(f"unsupported pytree key {k!r}")


def flatten(params) -> list[tuple[list, Any]]:
  """[(path as a list of dict keys / list indices, leaf)] in pytree order."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(params)
  return [([_path_key(k) for k in path], leaf) for path, leaf in leaves]


def unflatten(paths: list[list], leaves: list) -> Any:
  """Nested dicts (str keys) / lists (int keys) from `flatten`'s paths."""
  root: dict = {}
  for path, leaf in zip(paths, leaves):
    node = root
    for k in path[:-1]:
      node = node.setdefault(k, {})
    node[path[-1]] = leaf

  def fix(n) -> Any:
    if isinstance(n, dict):
      if n and all(isinstance(k, int) for k in n):
        return [fix(n[i]) for i in range(len(n))]
      return {k: fix(v) for k, v in n.items()}
    return n
  return fix(root)


def _boxes(leaf) -> list[tuple[tuple[int, ...], tuple[int, ...], Any]]:
  """Distinct shards of a leaf as (start, extent, owner device or None for host arrays)."""
  shape = tuple(int(d) for d in np.shape(leaf))
  sharding = getattr(leaf, "sharding", None)
  if sharding is None:
    return [((0,) * len(shape), shape, None)]
  seen: dict = {}
  for dev, idx in sorted(sharding.devices_indices_map(shape).items(), key=lambda kv: kv[0].id):
    start = tuple(s.indices(d)[0] for s, d in zip(idx, shape))
    ext = tuple(len(range(*s.indices(d))) for s, d in zip(idx, shape))
    seen.setdefault((start, ext), dev)        # the lowest device id holding the box owns it
  return [(s, e, d) for (s, e), d in seen.items()]


def _split(start, ext, itemsize: int, chunk_bytes: int):
  """Splits a box along its first dimension into pieces of at most chunk_bytes (>= one row)."""
  if not ext:
    return [(start, ext)]
  row = itemsize * math.prod(ext[1:])
  rows = max(1, chunk_bytes // max(row, 1))
  out = []
  for r in range(0, max(ext[0], 1), rows):
    n = min(rows, ext[0] - r)
    out.append(((start[0] + r,) + tuple(start[1:]), (n,) + tuple(ext[1:])))
  return out


def build_manifest(params, chunk_bytes: int = 8 << 20, wire_dtype: Optional[str] = None) -> tuple[dict[str, Any], list, list]:
  """(manifest dict, leaves, [(leaf index, box start, box extent, shard start, owner device)]).
  `wire_dtype="bfloat16"`: float32 leaves travel (and arrive) as bf16 (round-to-nearest-even)."""
  flat = flatten(params)
  tensors, chunks, plan = [], [], []
  for t, (path, leaf) in enumerate(flat):
    dt = np.dtype(leaf.dtype)
    if wire_dtype and dt == np.float32:
      dt = _np_dtype(wire_dtype)
    tensors.append({"name": path, "dtype": dt.name, "itemsize": dt.itemsize,
                    "shape": [int(d) for d in np.shape(leaf)]})
    for bstart, bext, dev in _boxes(leaf):
      for s, e in _split(bstart, bext, dt.itemsize, chunk_bytes):
        chunks.append([t, list(s), list(e)])
        plan.append((t, s, e, bstart, dev))
  return {"format": FORMAT, "tensors": tensors, "chunks": chunks}, [l for _, l in flat], plan


class StreamPublisher:
  """Streams this host's chunks of one params version to the buffer (see module docstring)."""

  def __init__(self, client, version: int, params, chunk_bytes: int = 8 << 20,
               process_index: Optional[int] = None, wire_dtype: Optional[str] = None,
               checksum: str = "crc32c", source=None, sources: Optional[list[str]] = None,
               owners: Optional[list[int]] = None, delta: Optional[DeltaEncoder] = None):
    """`wire_dtype="bfloat16"` halves the bytes of float32 params (e.g. fp32 master weights for a
    bf16 generator); the generator then receives bf16 arrays. `source`: this process's
    WeightSource (chunks staged there, the buffer only announces the version); `sources`: every
    learner process's source address in process order (default: just `source.address`);
    `owners`: the source index of every chunk (default: its owner device's process). `delta`
    (with `source`): this process's weights.delta.DeltaEncoder; the source then also serves each
    chunk as an exact delta against the version this process published before."""
    self.client, self.version, self.source, self.delta = client, int(version), source, delta
    self.manifest, self.leaves, self.plan = build_manifest(params, chunk_bytes, wire_dtype)
    self.manifest["checksum"] = checksum
    self._checksum = ws.CHECKSUMS[checksum]
    if process_index is None:
      process_index = jax.process_index()
    self.process_index = process_index
    if source is not None:     # host arrays (no device) are served by process 0's source
      self.manifest["sources"] = list(sources or [source.address])
      self.manifest["owners"] = list(owners) if owners is not None else [
          0 if p[4] is None else p[4].process_index for p in self.plan]
      self.own = [i for i, o in enumerate(self.manifest["owners"]) if o == process_index]
    else:                      # host arrays are sent by every process (the buffer keeps one)
      self.own = [i for i, p in enumerate(self.plan)
                  if p[4] is None or p[4].process_index == process_index]
    self._dtypes = [_np_dtype(t["dtype"]) for t in self.manifest["tensors"]]
    text = json.dumps(self.manifest, separators=(",", ":"))
    self.sha256 = hashlib.sha256(text.encode()).hexdigest()
    self.total_bytes = sum(_nbytes(self.manifest, i) for i in range(len(self.plan)))
    self._first = pb.WeightChunk(version=self.version, total_bytes=self.total_bytes,
                                 sha256=self.sha256, format=FORMAT, manifest=text
                                 ).SerializeToString()
    self.sent_chunks = self.sent_bytes = 0
    self.peak_chunk_bytes = 0            # largest host buffer this publisher held at once
    self.on_chunk: Optional[Callable[[int], None]] = None   # test hook, may raise to break

  def _host_chunk(self, i: int) -> np.ndarray:
    """Chunk i on the host at the wire dtype. A device shard's box is cast on the device before
    the device -> host copy (a bf16 wire moves 2 bytes per parameter across it, not 4); a CPU
    shard without a cast is a zero-copy view."""
    t, s, e, bstart, dev = self.plan[i]
    leaf, want = self.leaves[t], self._dtypes[t]
    if dev is not None:
      shard = next(sh for sh in leaf.addressable_shards if sh.device == dev)
      rel = tuple(slice(a - b, a - b + n) for a, b, n in zip(s, bstart, e))
      if dev.platform == "cpu" and shard.data.dtype == want:
        return np.ascontiguousarray(np.asarray(shard.data)[rel])   # a view unless the box is strided
      box = shard.data[rel]
      if box.dtype != want:
        box = box.astype(want)                                      # on the device
      return np.ascontiguousarray(jax.device_get(box))              # this chunk only
    host = np.asarray(leaf)[tuple(slice(a, a + n) for a, n in zip(s, e))]
    return np.ascontiguousarray(host if host.dtype == want else host.astype(want))

  def encode(self, i: int, host: Optional[np.ndarray] = None) -> bytes:
    """Chunk i as one WeightChunk message (its bytes copied once, checksummed once)."""
    if self.on_chunk is not None:
      self.on_chunk(i)
    if host is None:
      host = self._host_chunk(i)
    view = host.reshape(-1).view(np.uint8).data       # .data: the array's memoryview, no copy
    msg = ws.encode_chunk(self.version, i, view, self._checksum(view))
    self.peak_chunk_bytes = max(self.peak_chunk_bytes, len(msg) + (
        host.nbytes if host.base is None else 0))
    self.sent_chunks += 1
    self.sent_bytes += host.nbytes
    return msg

  def messages(self, indices) -> Iterator[bytes]:
    """The manifest message, then one encoded chunk per index."""
    yield self._first
    for i in indices:
      yield self.encode(i)

  def missing(self) -> list[int]:
    """Chunks of this host the buffer still lacks (a manifest-only publish)."""
    ack = self.client.publish_raw(iter([self._first]))
    own = set(self.own)
    return [i for i in ack.missing_chunks if i in own]

  def publish(self, indices=None, retries: int = 5) -> pb.PublishAck:
    """Sends this host's chunks (or `indices` first), then whatever of this host's chunks the
    buffer still lacks; after a broken stream only those are resent. Returns the last PublishAck
    (visible once every host's chunks are in)."""
    if self.source is not None:
      return self._publish_to_source()
    todo = list(self.own if indices is None else indices)
    for attempt in range(retries + 1):
      try:
        ack = self.client.publish_raw(self.messages(todo))
        own = set(self.own)
        todo = [i for i in ack.missing_chunks if i in own]
        if not todo:
          return ack
      except grpc.RpcError as e:
        if e.code() not in _RESUMABLE or attempt == retries:
          raise
        todo = self.resume_list()
    raise IOError(f"version {self.version}: chunks still missing after {retries} retries")

  def _publish_to_source(self) -> pb.PublishAck:
    """Learner-hosted: this process's source starts holding the version, process 0 announces it
    to the buffer (fetchers may start at once), then this process's chunks are staged one by one
    (each is served as soon as it is staged). Returns when all of them are staged."""
    assert self.source is not None       # `publish` takes this path only with a source
    d = self.delta
    base = d.base_for(self.version, self.manifest) if d is not None else -1
    self.source.begin(self.version, self._first, len(self.own), delta_base=base,
                      delta_msg=d.manifest_message(self.version, base, self.sha256,
                                                   self.total_bytes) if d and base >= 0 else b"")
    ack = pb.PublishAck(version=self.version, total_bytes=self.total_bytes, visible=True)
    if self.process_index == 0:
      ack = self.client._retry(  # pylint: disable=protected-access
          lambda: self.client.publish_raw(iter([self._first])))
    try:
      for i in self.own:
        host = self._host_chunk(i)
        msg = self.encode(i, host)
        self.source.add(self.version, i, msg,
                        d.chunk_message(self.version, i, host, base) if d is not None else None)
    except BaseException:
      if d is not None:
        d.reset()          # its base bits are part old, part new: the next version goes full
      raise
    if d is not None:
      d.finish(self.version, self.manifest)
    return ack

  def resume_list(self) -> list[int]:
    """Missing chunks of this host, asking the buffer (retrying while it is unavailable)."""
    return self.client._retry(self.missing)  # pylint: disable=protected-access


def tensor_name(manifest: dict, t: int) -> str:
  """Tensor t of a manifest as "a/b/0/c" (its pytree path), for error lines."""
  return "/".join(str(k) for k in manifest["tensors"][t]["name"])


def _nbytes(manifest, i: int) -> int:
  t, _, ext = manifest["chunks"][i]
  return manifest["tensors"][t]["itemsize"] * math.prod(ext)


def _placer(p: dict) -> Callable[[Any, int], Optional[memoryview]]:
  """For weights/bulk.py: where a full chunk of p's version may be read in place (its box in
  p's arrays, when contiguous, of the announced size, and not held yet), else None."""
  manifest, dests, have = p["manifest"], p["dests"], p["have"]

  def place(head, nbytes: int) -> Optional[memoryview]:
    i = head.chunk_index
    if head.format or head.version != p["version"] or i >= len(manifest["chunks"]) or i in have:
      return None
    t, s, e = manifest["chunks"][i]
    dst = dests[t][tuple(slice(a, a + n) for a, n in zip(s, e)) + (Ellipsis,)]
    if not dst.flags.c_contiguous or dst.nbytes != nbytes:
      return None
    return memoryview(dst.reshape(-1).view(np.uint8))
  return place


class StreamFetcher:
  """Fetches streamed versions into host arrays (reused from versions nobody holds any more,
  weights/pool.py); resumable (see module docstring)."""

  def __init__(self, client, delta: bool = common.Weights.delta):
    """`delta`: ask learner sources for exact deltas against the version fetched last (its
    arrays are kept as the base: the generator holds them anyway)."""
    self.client, self.delta = client, bool(delta)
    self._peers: dict = {}                  # learner weight source address -> client
    self._partial: Optional[dict] = None    # version, manifest, dests, have (set of chunk ids)
    self._base: Optional[tuple] = None      # (version, layout key, arrays) of the last fetch
    # Versions are read into reused arrays once nothing holds them (weights/pool.py).
    self.pool = ArrayPool()
    self.delta_chunks = 0                   # chunks applied from deltas
    self.delta_fallbacks = 0                # delta streams that did not check: fetched full
    self.delta_misses = 0                   # delta asked for, the source had none for the base
    self.digests_checked = 0                # version digests (source trailers) that matched
    # Relay fan-out (weights/relay.py): `relay` (a WeightSource in this generator) re-serves what
    # this fetcher receives; `parents()` lists the relays to fetch from before the learner source.
    self.relay: Optional[Any] = None        # a weights.source.WeightSource
    self.parents: Callable[[], list[str]] = lambda: []
    self.relay_wait_s = 5.0                 # how long a relay parent may take to start a version
    self.relay_failovers = 0                # relay streams that failed (then the next one)
    self.received_chunks = self.received_bytes = 0
    self.peak_message_bytes = 0
    # The bulk channel (weights/bulk.py) to sources/relays that have one; gRPC otherwise.
    self.bulk = True
    self.bulk_local = True                  # over a source's local listener where it is reachable
    self.bulk_ring = True                   # ... through its shared-memory ring (no TLS)
    self._bulk_of: dict[str, str] = {}      # source/relay address -> its bulk address ("": none)
    self.bulk_streams = 0                   # streams fetched over a bulk channel
    self.local_streams = 0                  # ... of them over a local (same-namespace) socket
    self.bulk_fallbacks = 0                 # bulk channels that did not connect (gRPC instead)
    self.on_chunk: Optional[Callable[[int], None]] = None   # test hook, may raise to break

  def fetch(self, have_version: int = -1, wait_timeout_s: float = 0.0) -> Optional[FetchedWeights]:
    """Newest version newer than `have_version` (`FetchedWeights`), None on timeout."""
    p = self._partial
    req = pb.FetchWeightsRequest(have_version=have_version, wait_timeout_s=wait_timeout_s,
                                 streamed=True)
    if p is not None and p["version"] > have_version:
      req.resume_version, req.have_chunks[:] = p["version"], sorted(p["have"])
    stream = self.client.fetch_raw(req, timeout=wait_timeout_s + 600)
    try:
      return self._consume(stream, wait_timeout_s)
    finally:
      stream.cancel()   # no-op once the stream ended; frees the call after a break

  def _consume(self, stream, wait_timeout_s: float = 0.0) -> Optional[FetchedWeights]:
    p = self._partial
    first = next(stream, None)
    if first is None:
      return None
    m = ws.parse_weight_message(first)
    if isinstance(m, ws.Malformed):
      raise IOError(m.err)
    h = m.head
    if not h.manifest:
      raise IOError(f"version {h.version}: the first message carries no manifest")
    if hashlib.sha256(h.manifest.encode()).hexdigest() != h.sha256:
      raise IOError(f"version {h.version}: manifest sha256 mismatch")
    if p is None or p["version"] != h.version or p["sha256"] != h.sha256:
      manifest = json.loads(h.manifest)
      dests = self.pool.take([(t["shape"], _np_dtype(t["dtype"])) for t in manifest["tensors"]])
      p = self._partial = dict(version=h.version, sha256=h.sha256, manifest=manifest,
                               dests=dests, have=set(), first=first, crcs={})
    manifest, dests, have = p["manifest"], p["dests"], p["have"]
    if "sources" in manifest:
      self._from_sources(h, p, wait_timeout_s)
    else:
      self._take(stream, h, p)
    if len(have) != len(manifest["chunks"]):
      raise IOError(f"version {h.version}: stream ended with {len(have)} of "
                    f"{len(manifest['chunks'])} chunks (fetch again to resume)")
    self._partial = None
    if self.delta:
      self._base = (h.version, wd.layout_key(manifest), dests)
    names = [t["name"] for t in manifest["tensors"]]
    return FetchedWeights(h.version, unflatten(names, dests))

  def _check_digest(self, h, p, digest: str, own: Optional[list], delta: bool) -> None:
    """A source's version digest (its trailer) against the bits this fetcher now holds of the
    source's chunks (`own`); a mismatch raises DeltaError after a delta (then fetched full),
    WeightUpdateError otherwise."""
    manifest, dests, held = p["manifest"], p["dests"], p["crcs"]
    checksum = ws.checksum_of(manifest)
    crcs = {}
    for i in (own if own is not None else range(len(manifest["chunks"]))):
      if i in held:          # checked when it arrived, into its box (no second pass over it)
        crcs[i] = held[i]
        continue
      t, s, e = manifest["chunks"][i]
      box = dests[t][tuple(slice(a, a + n) for a, n in zip(s, e)) + (Ellipsis,)]
      crcs[i] = checksum(np.ascontiguousarray(box).reshape(-1).view(np.uint8))
    if ws.version_digest(h.version, crcs) != digest:
      if delta:
        raise wd.DeltaError(f"version {h.version}: the version digest does not match")
      raise WeightUpdateError(h.version, "", "the version digest does not match its chunks")
    self.digests_checked += 1

  def _take(self, stream, h, p, base: Optional[list] = None, own: Optional[list] = None) -> None:
    """Writes every chunk message of `stream` into its box of p's arrays (checksum verified); a
    delta chunk (`base`: the held version's arrays) is applied exactly (weights/delta.py) or
    raises DeltaError; a digest trailer is checked over the chunks `own` (this source's)."""
    manifest, dests, have = p["manifest"], p["dests"], p["have"]
    checksum = ws.checksum_of(manifest)
    for raw in stream:       # serialized messages (gRPC) or parsed ones (weights/bulk.py)
      c = raw if isinstance(raw, ws.WeightMsg) else ws.parse_weight_message(raw)
      if isinstance(c, ws.Malformed):
        raise IOError(c.err)
      self.peak_message_bytes = max(self.peak_message_bytes, len(c.raw) or c.data.nbytes)
      if c.head.format == ws.DIGEST_FORMAT:
        self._check_digest(h, p, c.head.sha256, own, base is not None)
        if self.relay is not None and len(manifest.get("sources", ())) <= 1:
          self.relay.relay_trailer(h.version, c.raw)
        continue
      i = c.head.chunk_index
      if c.head.version != h.version or i >= len(manifest["chunks"]):
        raise WeightUpdateError(h.version, "", f"chunk {i} of version {c.head.version} does not "
                                               f"fit this version's manifest")
      t, s, e = manifest["chunks"][i]
      is_delta = c.head.format == wd.DELTA_FORMAT
      if (ws.CHECKSUMS["crc32c"](c.data) if is_delta else checksum(c.data)) != c.head.crc32:
        raise WeightUpdateError(h.version, tensor_name(manifest, t),
                                f"chunk {i}: checksum mismatch after transfer")
      box = tuple(slice(a, a + n) for a, n in zip(s, e)) + (Ellipsis,)
      dst = dests[t][box]   # a view
      if is_delta:
        if base is None:
          raise wd.DeltaError(f"chunk {i}: a delta chunk in a full stream")
        crc = wd.apply(base[t][box], c.data, dst)    # the result's CRC-32C, checked
        if manifest.get("checksum", "crc32") == "crc32c":
          p["crcs"][i] = crc
        self.delta_chunks += 1
      elif c.data.nbytes != dst.nbytes:
        raise WeightUpdateError(h.version, tensor_name(manifest, t),
                                f"chunk {i}: {c.data.nbytes} bytes for a box of {dst.nbytes}")
      elif not c.placed:      # (a bulk chunk was read straight into its box)
        dst[...] = np.frombuffer(c.data, dst.dtype).reshape(dst.shape)
      if not is_delta:
        p["crcs"][i] = c.head.crc32
      have.add(i)
      if self.relay is not None:
        self.relay.relay_add(h.version, i, c.raw or ws.with_data(c.head.SerializeToString(),
                                                                 c.data), is_delta)
      self.received_chunks += 1
      self.received_bytes += c.data.nbytes
      del c, raw
      if self.on_chunk is not None:
        self.on_chunk(i)

  def _stream_from(self, addr: str, relay: bool, o: int, base, h, p, by_src, wait_timeout_s):
    """One FetchWeights stream of source o's chunks from `addr` (a relay or the learner source)
    into p's arrays; what arrives is relayed on when this fetcher has a relay."""
    manifest, have = p["manifest"], p["have"]
    got = {i for i in by_src[o] if i in have}
    if relay and len(by_src) > 1:        # a relay holds every source's chunks: only o's
      got |= set(range(len(manifest["chunks"]))) - set(by_src[o])
    req = pb.FetchWeightsRequest(
        have_version=h.version - 1 if base is None else base[0], resume_version=h.version,
        streamed=True, have_chunks=sorted(got), want_delta=base is not None,
        wait_timeout_s=self.relay_wait_s if relay else min(max(wait_timeout_s, 60.0), 600.0))
    stream, close = self._open(addr, req, p)
    try:
      first = next(stream, None)
      m = first if first is None or isinstance(first, ws.WeightMsg) else \
          ws.parse_weight_message(first)
      d = None if m is None or isinstance(m, ws.Malformed) else wd.parse_delta_manifest(m)
      if (d is not None and isinstance(m, ws.WeightMsg) and base is not None
          and d["of"] == h.sha256 and d["base"] == base[0]):
        if self.relay is not None:
          self.relay.relay_begin(h.version, p["first"], base[0], m.raw)
        self._take(stream, h, p, base[2], by_src[o])
        return
      if m is None or isinstance(m, ws.Malformed) or m.head.sha256 != h.sha256:
        raise IOError(f"version {h.version}: {addr} sent another manifest")
      self.delta_misses += base is not None
      if self.relay is not None:
        self.relay.relay_begin(h.version, p["first"])
      self._take(stream, h, p, None, by_src[o])
    finally:
      close()

  def _open(self, addr: str, req, p) -> tuple[Iterator, Callable[[], None]]:
    """(message stream, close) of one fetch from `addr`: over its bulk channel when it has one
    (weights/bulk.py: chunks read straight into p's boxes), else over gRPC. A bulk channel that
    does not connect is a counted fallback to gRPC (`bulk_fallbacks`)."""
    peer = self._peer(addr)
    if self.bulk:
      if addr not in self._bulk_of:
        try:
          self._bulk_of[addr] = peer.bulk_address()
        except grpc.RpcError:
          pass                           # asked again next time; gRPC now
      bulk_addr = self._bulk_of.get(addr, "")
      if bulk_addr and not self.bulk_local:
        bulk_addr = wb.split_address(bulk_addr)[0]
      if bulk_addr:
        try:
          sock = wb.connect(bulk_addr, peer.token, req, tls=peer.tls,
                            timeout=req.wait_timeout_s + 60, ring=self.bulk_ring)
        except OSError as e:
          self.bulk_fallbacks += 1
          self._bulk_of.pop(addr, None)
          log.warning("bulk weight channel %s of %s: %s; using gRPC", bulk_addr, addr, e)
        else:
          self.bulk_streams += 1
          self.local_streams += sock.family == socket.AF_UNIX
          return wb.messages(sock, _placer(p), peer.max_message_bytes), sock.close
    stream = peer.fetch_raw(req, timeout=1200)
    return stream, stream.cancel

  def _peer(self, address: str):
    if address not in self._peers:
      self._peers[address] = self.client.peer(address)
    return self._peers[address]

  def _from_sources(self, h, p, wait_timeout_s: float) -> None:
    """A remote version: each learner source's chunks from that source (in parallel), resuming
    with the chunks already held. A source that no longer holds the version answers NOT_FOUND."""
    manifest, have = p["manifest"], p["have"]
    by_src: dict[int, list[int]] = {}
    for i, o in enumerate(manifest["owners"]):
      by_src.setdefault(o, []).append(i)

    b = self._base
    base = b if (self.delta and b is not None and b[0] < h.version
                 and b[1] == wd.layout_key(manifest)) else None

    def attempt(o: int, base) -> bool:
      """Source o's chunks: from the relay parents first (a generator that has them), then from
      the learner source; a relay that fails or lacks them only costs a fallback. False: a delta
      did not check (counted; this source's chunks are to be fetched again, full)."""
      for addr in [*self.parents(), None]:
        if all(i in have for i in by_src[o]):
          return True
        try:
          self._stream_from(addr or manifest["sources"][o], addr is not None, o, base, h, p,
                            by_src, wait_timeout_s)
          if addr is not None and not all(i in have for i in by_src[o]):
            self.relay_failovers += 1          # a relay stream that ended short (it stopped)
        except wd.DeltaError as e:     # counted; this source's chunks come full
          self.delta_fallbacks += 1
          log.warning("version %d: delta from %s did not check (%s); fetching it full",
                      h.version, addr or manifest["sources"][o], e)
          have.difference_update(by_src[o])    # none of this source's delta chunks is trusted
          return False
        except (grpc.RpcError, IOError) as e:
          if addr is None:
            raise
          self.relay_failovers += 1
          log.info("version %d: relay %s failed (%s); next", h.version, addr,
                   e.code() if isinstance(e, grpc.RpcError) else e)
      return True

    def one(o: int, base) -> None:
      # (a loop, not a recursive closure: a closure that refers to itself is a reference cycle,
      # which kept p's arrays alive until a gc pass, so weights/pool.py could not reuse them)
      while not attempt(o, base):
        base = None

    if len(by_src) == 1:
      one(next(iter(by_src)), base)
    else:
      with concurrent.futures.ThreadPoolExecutor(min(len(by_src), 16)) as ex:
        for f in [ex.submit(one, o, base) for o in by_src]:
          f.result()
    log.info("fetched weights version %d from learner sources %s", h.version,
             {manifest["sources"][o]: len(ids) for o, ids in sorted(by_src.items())})
