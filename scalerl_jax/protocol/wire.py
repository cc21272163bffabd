"""The rollout data path on the wire: strict request parsers and the PushRequest fast path.

PushRollouts is registered with `parse_push` as its request deserializer, so the handler receives
the raw PushRequest bytes split into (Rollout, bytes view) pairs: each Rollout is parsed once (upb)
for validation, and the bytes that were validated are what the buffer stores, writes to the WAL and
splices unchanged into the learner's `BatchItem{group}` responses (buffer/state.py), so a rollout's
payload is never re-encoded on the server. Tensor payloads are checked through `np.frombuffer` views.
This module must not import jax (the buffer server process does not).
"""
from __future__ import annotations

import ctypes
from typing import NoReturn, Optional

from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from scalerl_jax.protocol import rollout_pb2 as pb
_ROLLOUT_SUBMESSAGES = ("prompt_tokens", "completion_tokens", "logprobs", "versions",
                        "policy_mask", "timing", "routes")
_PARSE_ERRORS = (pb_message.DecodeError, ValueError, RuntimeError, IndexError)


class Malformed:
  """Stands in for a request whose bytes did not parse (the handler answers INVALID_ARGUMENT)."""

  def __init__(self, err: str):
    self.err = err


def abort(context, code, message: str) -> NoReturn:
  """`context.abort(code, message)`: grpc's ServicerContext.abort always raises (documented, but its
  signature does not say so), so the type checker knows a handler does not go on after it."""
  context.abort(code, message)
  raise AssertionError("unreachable: ServicerContext.abort raises")


def unknown(msg, name: str) -> Optional[str]:
  """Strict parsing: the error for unknown or mistyped fields (e.g. a message of another type)."""
  u = unknown_fields.UnknownFieldSet(msg)
  if len(u):
    nums = sorted({f.field_number for f in u})
    return f"{name}: unknown or mistyped field number(s) {nums[:8]}"
  return None


def parser(cls):
  """A strict request deserializer for message class `cls` (returns `Malformed` on bad bytes)."""
  name = cls.DESCRIPTOR.name

  def parse(data: bytes):
    try:
      m = cls.FromString(data)
    except _PARSE_ERRORS as e:
      return Malformed(f"cannot parse {name}: {e}")
    err = unknown(m, name)
    return Malformed(err) if err else m
  return parse


def serialize(x) -> bytes:
  """Response serializer: pre-encoded bytes pass through untouched, messages are serialized."""
  return x if isinstance(x, bytes) else x.SerializeToString()


def read_varint(view, pos: int) -> tuple[int, int]:
  """Decodes a base-128 varint at `pos`; returns (value, position after it)."""
  b = view[pos]
  if b < 0x80:
    return b, pos + 1
  result, shift = b & 0x7F, 7
  while True:
    pos += 1
    if shift > 63:
      raise ValueError("varint too long")
    b = view[pos]
    result |= (b & 0x7F) << shift
    if b < 0x80:
      return result, pos + 1
    shift += 7


def varint(n: int) -> bytes:
  """Encodes a non-negative int as a base-128 varint."""
  if n < 0x80:
    return bytes((n,))
  out = bytearray()
  while n > 0x7F:
    out.append((n & 0x7F) | 0x80)
    n >>= 7
  out.append(n)
  return bytes(out)


def parse_push(data: bytes):
  """Splits a serialized PushRequest into (Rollout, raw bytes view) pairs without copying payloads.

  The outer message may only contain field 1 (rollouts, length-delimited); each element is parsed
  on its own and checked for unknown fields at every level, so the stored bytes are exactly the
  bytes that were validated. Returns a list, or `Malformed`."""
  view, pos, n, out = memoryview(data), 0, len(data), []
  from_string = pb.Rollout.FromString
  try:
    while pos < n:
      if view[pos] != 0x0A:
        tag, _ = read_varint(view, pos)
        return Malformed(f"PushRequest: unexpected field {tag >> 3} (wire type {tag & 7})")
      size, pos = read_varint(view, pos + 1)
      end = pos + size
      if end > n:
        return Malformed("PushRequest: truncated rollout")
      raw = view[pos:end]
      # FromString takes any buffer (the stub says bytes): parsed from the request, no copy
      r = from_string(raw)  # pyright: ignore[reportArgumentType]
      name = f"rollouts[{len(out)}]"
      err = unknown(r, name)
      for f in _ROLLOUT_SUBMESSAGES:
        if err:
          break
        if r.HasField(f):
          err = unknown(getattr(r, f), f"{name}.{f}")
          if not err and f == "routes" and r.routes.HasField("experts"):
            err = unknown(r.routes.experts, f"{name}.routes.experts")
      if err:
        return Malformed(err)
      out.append((r, raw))
      pos = end
  except _PARSE_ERRORS as e:
    return Malformed(f"cannot parse PushRequest: {e}")
  if not out:
    return Malformed("PushRequest carries no rollouts")
  return out


def retain(raws: list) -> list:
  """What to store for the accepted rollouts of one request: zero-copy views of the request bytes,
  unless they are less than half of it (mostly duplicates or rejected-and-resent), in which case
  they are copied so a few stored rollouts cannot pin whole 64 MB requests in memory."""
  base = {id(v.obj): memoryview(v.obj).nbytes for v in raws if isinstance(v, memoryview)}
  if sum(len(v) for v in raws) * 2 >= sum(base.values()):
    return list(raws)
  return [bytes(v) for v in raws]


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
  """Keeps glibc from mmap/munmap-ing every multi-MB buffer (each fresh mapping costs a page fault
  per 4 KiB): large rollout/group buffers are then recycled from the heap. Process-wide; the server
  process calls it, other processes may opt in. Returns False where glibc's mallopt is missing."""
  try:
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
  except (OSError, AttributeError):
    return False
