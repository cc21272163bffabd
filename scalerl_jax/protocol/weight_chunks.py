"""Weight chunks on the wire: the `WeightChunk` message split without copies, manifests, checksums,
and `Version` (one version's chunks as held by a server). Shared by the buffer's weight store, the
learner's weight sources and the fetchers (weights/). The protocols (streamed, remote) are
described in buffer/weight_store.py. No JAX.
"""
from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
import zlib
from typing import Callable, Iterator, Optional, Sequence, cast

import crc32c
from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.wire import Malformed, read_varint, varint

STREAM_PREFIX = "stream:"   # WAL format tag of a persisted streamed version
MAX_CHUNKS = 1 << 20
MAX_SOURCES = 4096
# Chunk checksums by manifest name (absent: "crc32", what older publishers sent).
CHECKSUMS = {"crc32": zlib.crc32, "crc32c": crc32c.crc32c}


def checksum_of(manifest: dict) -> Callable[..., int]:
  """The chunk checksum function a (checked) manifest names."""
  return CHECKSUMS[manifest.get("checksum", "crc32")]


_DATA_TAG = (6 << 3) | 2



class WeightMsg:
  """A parsed WeightChunk: `head` (every field but data), `data` (memoryview), `raw` (the bytes);
  `placed`: `data` is already the receiver's destination (weights/bulk.py read it in place)."""
  __slots__ = ("head", "data", "raw", "placed")

  def __init__(self, head, data, raw, placed: bool = False):
    self.head, self.data, self.raw, self.placed = head, data, raw, placed


def parse_weight_message(raw: bytes) -> WeightMsg | Malformed:
  """Splits a serialized WeightChunk into a WeightMsg without copying `data`; Malformed if invalid
  (bad wire format, unknown or mistyped fields)."""
  view, pos, n, head, data = memoryview(raw), 0, len(raw), [], memoryview(b"")
  try:
    while pos < n:
      start = pos
      tag, pos = read_varint(view, pos)
      wt = tag & 7
      if wt == 0:
        _, pos = read_varint(view, pos)
      elif wt == 1:
        pos += 8
      elif wt == 5:
        pos += 4
      elif wt == 2:
        size, pos = read_varint(view, pos)
        if tag == _DATA_TAG:
          if pos + size > n:
            return Malformed("WeightChunk: truncated data")
          data, pos = view[pos:pos + size], pos + size
          continue
        pos += size
      else:
        return Malformed(f"WeightChunk: unsupported wire type {wt}")
      if pos > n:
        return Malformed("WeightChunk: truncated field")
      head.append(view[start:pos])
    m = pb.WeightChunk.FromString(b"".join(head))
  except (pb_message.DecodeError, ValueError, RuntimeError, IndexError) as e:
    return Malformed(f"cannot parse WeightChunk: {e}")
  u = unknown_fields.UnknownFieldSet(m)
  if len(u):
    return Malformed(f"WeightChunk: unknown or mistyped field number(s) "
                     f"{sorted({f.field_number for f in u})[:8]}")
  return WeightMsg(m, data, raw)


def encode_chunk(version: int, index: int, data, crc: int) -> bytes:
  """One streamed chunk message: the small header, then `data` as field 6 (one copy of data)."""
  head = pb.WeightChunk(version=version, chunk_index=index, crc32=crc).SerializeToString()
  return with_data(head, data)


def with_data(head: bytes, data) -> bytes:
  """A serialized WeightChunk header followed by `data` as field 6 (one copy of data)."""
  return b"".join((head, bytes((_DATA_TAG,)), varint(memoryview(data).nbytes), data))


def check_manifest(text: str, max_bytes: int) -> tuple[dict, list[int]]:
  """Validates a manifest; returns (manifest, nbytes per chunk). Raises ValueError.

  {"tensors": [{"name": [...], "dtype": str, "shape": [...]}, ...],
   "chunks": [[tensor_index, [start per dim], [extent per dim]], ...],   (itemsize from "itemsize")
   optional "checksum": "crc32" | "crc32c", "sources": ["host:port", ...], "owners": [int, ...]}."""
  m = json.loads(text)
  tensors, chunks = m["tensors"], m["chunks"]
  if not isinstance(tensors, list) or not isinstance(chunks, list) or not chunks:
    raise ValueError("manifest needs non-empty lists 'tensors' and 'chunks'")
  if len(chunks) > MAX_CHUNKS:
    raise ValueError(f"{len(chunks)} chunks > {MAX_CHUNKS}")
  if m.get("checksum", "crc32") not in CHECKSUMS:
    raise ValueError(f"unknown checksum {m.get('checksum')!r}; expected one of {sorted(CHECKSUMS)}")
  if "sources" in m or "owners" in m:
    src, own = m.get("sources"), m.get("owners")
    if (not isinstance(src, list) or not 0 < len(src) <= MAX_SOURCES
        or not all(isinstance(a, str) and 0 < len(a) <= 256 and ":" in a for a in src)):
      raise ValueError(f"'sources' must be 1..{MAX_SOURCES} 'host:port' strings")
    if (not isinstance(own, list) or len(own) != len(chunks)
        or not all(isinstance(o, int) and 0 <= o < len(src) for o in own)):
      raise ValueError("'owners' must give a source index for every chunk")
  sizes, total = [], 0
  for c in chunks:
    t, start, ext = c
    td = tensors[t]
    shape, item = td["shape"], int(td["itemsize"])
    if not (len(start) == len(ext) == len(shape)) or item not in (1, 2, 4, 8):
      raise ValueError(f"chunk {c}: rank or itemsize does not match tensor {t}")
    if any(s < 0 or e < 0 or s + e > d for s, e, d in zip(start, ext, shape)):
      raise ValueError(f"chunk {c}: outside tensor {t} of shape {shape}")
    nb = item
    for e in ext:
      nb *= int(e)
    sizes.append(nb)
    total += nb
    if total > max_bytes:
      raise OverflowError(f"manifest total bytes exceed {max_bytes}")
  return m, sizes


class Version:
  """One streamed weight version: its manifest message + chunk messages as received."""

  def __init__(self, version: int, fmt: str, sha256: str, total_bytes: int, *,
               manifest_raw: bytes, sizes: Optional[list[int]] = None,
               manifest: Optional[dict] = None, expected: Optional[int] = None):
    """`manifest_raw`: the first message, as sent to fetchers; `manifest` (parsed) gives the
    checksum and, with "sources", makes the version remote (no chunks held here); `expected`: how
    many chunks this holder will have (default: all)."""
    self.version, self.format, self.sha256, self.total_bytes = version, fmt, sha256, total_bytes
    self.manifest_raw = manifest_raw
    self.sizes = sizes or []
    manifest = manifest or {}
    self.checksum = checksum_of(manifest)
    self.remote = "sources" in manifest         # chunks live on the learner hosts
    self.chunks: list[Optional[bytes]] = [] if self.remote else [None] * len(self.sizes)
    self.order: list[int] = []                  # chunk indices in arrival order (fetchers follow it)
    self.expected = 0 if self.remote else len(self.sizes) if expected is None else expected
    self.missing = self.expected
    self.dropped = False                        # evicted before completion (fetchers give up)
    # Exact deltas (weights/delta.py), learner sources only: against `delta_base` (-1: none), the
    # delta stream's first message and each chunk's delta message (None: served full).
    self.delta_base, self.delta_raw = -1, b""
    self.delta_chunks: list[Optional[bytes]] = [None] * len(self.chunks)
    self.crcs: dict[int, int] = {}              # chunk index -> checksum (learner sources)
    self.trailer = b""                          # digest message, once every chunk is staged
    self.relay = False                          # a generator relaying what it fetched

  def missing_list(self) -> list[int]:
    return [i for i, c in enumerate(self.chunks) if c is None]

  def pack(self) -> bytes:
    """The version as one byte string (WAL): u64 count, then u64-length-prefixed messages (a
    remote version: the manifest only)."""
    # Packed once complete (buffer/weight_store: a visible version): every chunk is bytes.
    msgs = [self.manifest_raw] + ([] if self.remote else cast(list[bytes], self.chunks))
    return b"".join([struct.pack("<Q", len(msgs))] + [
        x for m in msgs for x in (struct.pack("<Q", len(m)), m)])

  @staticmethod
  def unpack(packed: bytes, max_bytes: int) -> "Version":
    """Inverse of `pack`."""
    view, (n,), pos, msgs = memoryview(packed), struct.unpack_from("<Q", packed, 0), 8, []
    for _ in range(n):
      (size,) = struct.unpack_from("<Q", packed, pos)
      msgs.append(bytes(view[pos + 8:pos + 8 + size]))
      pos += 8 + size
    first = parse_weight_message(msgs[0])
    if isinstance(first, Malformed):
      raise ValueError(f"packed weights version: bad manifest message ({first.err})")
    head = first.head
    manifest, sizes = check_manifest(head.manifest, max_bytes)
    v = Version(head.version, head.format, head.sha256, head.total_bytes, manifest_raw=msgs[0],
                sizes=sizes, manifest=manifest)
    if not v.remote:
      v.chunks, v.missing, v.order = msgs[1:], 0, list(range(len(msgs) - 1))
    return v


def stream_chunks(cv: threading.Condition, v: Version, skip, context, stall_s: float,
                  delta: bool = False) -> Iterator[Optional[bytes]]:
  """Manifest, then v's chunks in arrival order, waiting (on `cv`) for the rest while it is
  published; ends early (a short stream, which the fetcher resumes) if v is superseded or stalls
  for stall_s. Shared by the buffer and the learner weight servers (weights/source.py). `delta`:
  the delta stream (v.delta_raw, then each chunk's delta message, or its full one where it has
  none: a chunk's full bytes are a valid answer in a delta stream too)."""
  yield v.delta_raw if delta else v.manifest_raw
  pos = 0
  while pos < v.expected:
    with cv:
      t_wait = time.time()
      while pos == len(v.order):
        if v.dropped or not context.is_active() or time.time() - t_wait > stall_s:
          return
        cv.wait(0.25)
      ready = v.order[pos:]
    pos += len(ready)
    for i in ready:
      if i not in skip:
        yield (v.delta_chunks[i] or v.chunks[i]) if delta else v.chunks[i]
  with cv:                                      # a relay gets the trailer after the chunks
    t_wait = time.time()
    while v.relay and not v.trailer and not v.dropped and time.time() - t_wait < min(stall_s, 5.0):
      cv.wait(0.1)
  if v.trailer:
    yield v.trailer


DIGEST_FORMAT = "scalerl-version-digest-v1"


def version_digest(version: int, crcs: dict[int, int]) -> str:
  """The digest of one version as one holder serves it: sha256 over (chunk index, checksum of the
  chunk's bytes) of its chunks in index order (the fetcher recomputes it from the bits it holds)."""
  h = hashlib.sha256(struct.pack("<q", int(version)))
  for i in sorted(crcs):
    h.update(struct.pack("<QI", i, crcs[i] & 0xFFFFFFFF))
  return h.hexdigest()


def digest_message(version: int, crcs: dict[int, int]) -> bytes:
  """The trailer a learner source ends a version's stream with (format DIGEST_FORMAT)."""
  return pb.WeightChunk(version=int(version), format=DIGEST_FORMAT,
                        sha256=version_digest(version, crcs)).SerializeToString()


def tree_parents(index: int, fanout: int, addresses: Sequence[str], depth: int = 3) -> list[str]:
  """The relay addresses generator `index` fetches from, nearest ancestor first (at most `depth`
  of them; [] for the root or fanout 0). `addresses[j]`: generator j's relay."""
  out: list[str] = []
  if fanout < 1:
    return out
  j = int(index)
  while j > 0 and len(out) < depth:
    j = (j - 1) // fanout
    if j < len(addresses) and addresses[j]:
      out.append(addresses[j])
  return out
