"""Exact weight deltas: a version sent as the change to the bits a generator already holds.

At RL learning rates one optimizer step moves most weights by less than half a bf16 ulp, so the
bf16 copy a generator holds changes in a few per cent of its elements per version (bench.weights
measures it on a real trajectory). A delta chunk carries only those: the indices of the changed
elements (gaps, uint32, zlib level 1) and their XOR with the base bits (zlib level 1), plus the
CRC-32C of the resulting bits. Applying it is exact: base XOR delta = the publisher's bits, checked
chunk by chunk against that CRC; anything that does not check (a wrong base, a corrupt or
truncated payload) raises `DeltaError` and the fetcher falls back to the full version (counted).

Payload of one chunk ("sparse-xor-zlib"): header `<4sIQII` = magic b"SDX1", CRC-32C of the result
bits, number of changed elements, bytes of the compressed gaps, bytes of the compressed XORs; then
the two zlib streams. Elements are the tensor's own width (bf16: 2 bytes), compared as unsigned
integers of that width, so deltas are bit-exact for any dtype.

Publisher side, `DeltaEncoder`: per learner process, the bits it last published of each of its
chunks (the base; host memory = this process's share of the model at the wire dtype) and that
version. A version is sent as a delta against the previous published version when the chunk table
is the same and `version % full_every != 0` (every `full_every`-th version only full chunks go out,
`weights.delta_full_every`). A learner WeightSource stages both the full and the delta message of
each chunk; a fetcher that holds the base version asks for the delta (`want_delta`), anyone else
(new, restarted, more than one version behind) gets the full version. No JAX.
"""
from __future__ import annotations

import hashlib
import json
import struct
import zlib
from typing import Optional

import crc32c
import numpy as np

from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws

DELTA_FORMAT = "scalerl-params-delta-v1"
ENCODING = "sparse-xor-zlib"
MAGIC = b"SDX1"
_HEAD = struct.Struct("<4sIQII")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


class DeltaError(ValueError):
  """A delta that does not apply exactly (wrong base, corrupt or truncated payload)."""


def as_bits(a: np.ndarray) -> np.ndarray:
  """A 1-D unsigned-integer view of an array's elements (no copy for a contiguous array)."""
  a = np.ascontiguousarray(a)
  return a.reshape(-1).view(_UINT[a.dtype.itemsize])


def encode(base: np.ndarray, new: np.ndarray) -> bytes:
  """The delta payload that turns `base` bits into `new` bits (same shape and width)."""
  b, n = as_bits(base), as_bits(new)
  if b.shape != n.shape or b.dtype != n.dtype:
    raise DeltaError(f"base {b.shape}/{b.dtype} and new {n.shape}/{n.dtype} differ in layout")
  idx = np.flatnonzero(b != n)
  gaps = np.diff(idx, prepend=0).astype("<u4")          # first gap = first index
  xor = (b[idx] ^ n[idx]).astype(n.dtype.newbyteorder("<"))
  zi, zv = zlib.compress(gaps.tobytes(), 1), zlib.compress(xor.tobytes(), 1)
  return b"".join((_HEAD.pack(MAGIC, crc32c.crc32c(n.data), idx.size, len(zi), len(zv)), zi, zv))


def apply(base: np.ndarray, payload, out: np.ndarray) -> int:
  """Writes base XOR delta into `out` (an array of base's layout, not base); DeltaError unless
  the result's CRC-32C is the one the publisher computed. Returns that CRC-32C."""
  b = as_bits(base)
  # `out` may be a strided box of a leaf (a shard cut along another dimension): work in a
  # contiguous buffer then, and copy the result in once it checked.
  direct = out.flags.c_contiguous
  o = out.reshape(-1).view(_UINT[out.dtype.itemsize]) if direct else np.empty_like(b)
  view = memoryview(payload)
  if view.nbytes < _HEAD.size:
    raise DeltaError(f"delta payload of {view.nbytes} bytes is shorter than its header")
  magic, crc, count, ni, nv = _HEAD.unpack_from(view, 0)
  if magic != MAGIC or _HEAD.size + ni + nv != view.nbytes or count > b.size:
    raise DeltaError("malformed delta payload (magic, lengths or count)")
  try:
    gaps = np.frombuffer(zlib.decompress(view[_HEAD.size:_HEAD.size + ni]), "<u4")
    xor = np.frombuffer(zlib.decompress(view[_HEAD.size + ni:]), b.dtype.newbyteorder("<"))
  except zlib.error as e:
    raise DeltaError(f"corrupt delta payload: {e}") from None
  if gaps.size != count or xor.size != count:
    raise DeltaError(f"delta lists {count} changes but carries {gaps.size} / {xor.size}")
  idx = np.cumsum(gaps, dtype=np.int64)
  if count and (idx[-1] >= b.size or (count > 1 and not (gaps[1:] > 0).all())):
    raise DeltaError("delta indices out of range or not increasing")
  o[...] = b
  o[idx] ^= xor
  if crc32c.crc32c(o.data) != crc:
    raise DeltaError("the delta applied to the held base does not give the published bits "
                     "(CRC-32C mismatch)")
  if not direct:
    out[...] = o.view(out.dtype).reshape(out.shape)
  return crc


def layout_key(manifest: dict) -> str:
  """What two versions must share for a delta: the tensors and the chunk table."""
  return json.dumps([manifest["tensors"], manifest["chunks"]], separators=(",", ":"))


class DeltaEncoder:
  """One learner process's delta state (see module docstring): the bits it last published of
  each of its chunks, and that version."""

  def __init__(self, full_every: int):
    """`full_every`: every full_every-th version goes out full only (>= 1; 1 = never a delta)."""
    self.full_every = max(1, int(full_every))
    self.version, self.layout = -1, ""
    self.base: dict[int, np.ndarray] = {}
    self.delta_bytes = self.full_bytes = 0        # bytes of the versions encoded so far

  def base_for(self, version: int, manifest: dict) -> int:
    """The version a delta to `version` is against, or -1 (send it full)."""
    if (self.version < 0 or version <= self.version or version % self.full_every == 0
        or layout_key(manifest) != self.layout):
      return -1
    return self.version

  def manifest_message(self, version: int, base: int, full_sha256: str, total_bytes: int) -> bytes:
    """The first message of a delta stream: which full manifest it is of, and its base."""
    text = json.dumps({"format": DELTA_FORMAT, "of": full_sha256, "base": int(base),
                       "encoding": ENCODING}, separators=(",", ":"))
    return pb.WeightChunk(version=int(version), total_bytes=int(total_bytes),
                          sha256=hashlib.sha256(text.encode()).hexdigest(), format=DELTA_FORMAT,
                          manifest=text).SerializeToString()

  def chunk_message(self, version: int, index: int, host: np.ndarray, base: int) -> Optional[bytes]:
    """Chunk `index`'s delta message against `base` (None when this process holds no base bits
    for it), then remembers `host` as the chunk's new base bits."""
    old = self.base.get(index) if base >= 0 else None
    msg = None
    if old is not None:
      payload = encode(old, host)
      head = pb.WeightChunk(version=int(version), chunk_index=int(index),
                            crc32=crc32c.crc32c(payload), format=DELTA_FORMAT)
      msg = ws.with_data(head.SerializeToString(), payload)   # format marks a delta chunk
      self.delta_bytes += len(payload)
    self.full_bytes += host.nbytes
    self.base[index] = as_bits(host).copy()
    return msg

  def reset(self) -> None:
    """Forgets the base (a publish that broke half way): the next version goes out full."""
    self.version, self.layout, self.base = -1, "", {}

  def finish(self, version: int, manifest: dict) -> None:
    """Records that `version` (of this layout) is now every chunk's base."""
    self.version, self.layout = int(version), layout_key(manifest)


def parse_delta_manifest(msg: ws.WeightMsg) -> Optional[dict]:
  """The delta header of a stream's first message, or None when it is a full manifest."""
  if msg.head.format != DELTA_FORMAT:
    return None
  d = json.loads(msg.head.manifest)
  if not isinstance(d, dict) or d.get("encoding") != ENCODING or not isinstance(d.get("base"), int):
    raise DeltaError(f"unsupported delta header {msg.head.manifest[:200]!r}")
  return d
