"""Wire protocol between the project side (`VLLMGenerator`, .venv) and the vLLM worker (.venv-vllm).

Pure stdlib + numpy so both virtual environments can import it (no jax, no torch, no vllm, and no
pickle on the wire). One message is one frame:

    b"SRLV" | u32 header_len | u64 payload_len | header (UTF-8 JSON) | payload (raw array bytes)

all integers little-endian. The header is a JSON object with at least `op` (str) and `id` (int, the
request id that the reply echoes); `arrays` lists the arrays packed back to back in the payload:
`[{"name", "dtype", "shape", "offset", "nbytes"}, ...]`, each array C-contiguous little-endian.
dtype strings are numpy names plus "bfloat16", which travels as its raw 16-bit pattern (uint16).

Ops (client -> worker; the worker answers each with {"op": "ok"|"error", "id": same id, ...}):
  generate       header: prompt_ids, n, spec (SamplingSpec fields); arrays: prompt_tokens int32 (all
                 prompts concatenated), prompt_lens int32. Reply: completions meta list (prompt_id,
                 finish_reason, length, sample) + arrays tokens/logprobs/versions/policy_mask
                 (concatenated in the meta order).
  weights_begin  header: version. Pauses generation (mode "keep": in-flight sequences keep their KV).
  weights_chunk  arrays: HF-named parameters. Loaded into the model at once (engine is paused).
  weights_end    header: version. Stamps the new version and resumes generation.
  info           reply: engine/model facts (vLLM version, dtypes, logits dtype probe, ...).
  set_head_dtype header: dtype ("float32" | "bfloat16" | "model"); test hook for the parity gate.
  shutdown       stops the engine; the worker exits after replying.
The worker sends one unsolicited {"op": "ready", "id": 0, ...} once its engine is up, or
{"op": "fatal", "id": 0, "error": ...} if it cannot start.
"""
from __future__ import annotations

import json
import socket
import struct
from typing import Iterable, Iterator, Mapping

import numpy as np

MAGIC = b"SRLV"
_PREFIX = struct.Struct("<4sIQ")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER_BYTES = 64 << 20

BF16 = "bfloat16"
_ALLOWED = {"float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
            "uint32", "bool", BF16}


class ProtocolError(RuntimeError):
  """A malformed frame or an unexpected message."""


def _wire_dtype(arr: np.ndarray, dtype: str | None) -> tuple[str, np.ndarray]:
  """Returns (dtype name on the wire, little-endian contiguous array holding the bytes)."""
  name = dtype or arr.dtype.name
  if arr.dtype.name == BF16 or (name == BF16 and arr.dtype == np.uint16):  # ml_dtypes / raw bits
    return BF16, np.ascontiguousarray(arr).view(np.uint16)
  if name == BF16:                              # wire-side conversion (halves the bytes)
    return BF16, f32_to_bf16_bits(np.asarray(arr, dtype=np.float32))
  if name not in _ALLOWED:
    raise ProtocolError(f"dtype {name!r} is not supported on the wire (allowed: {sorted(_ALLOWED)})")
  arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1
                             else arr.dtype)
  return name, arr


def encode(header: Mapping, arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]] = (),
           dtypes: Mapping[str, str] | None = None) -> list[memoryview | bytes]:
  """Serializes one message; returns buffers to send in order (array bytes are not copied)."""
  items = arrays.items() if isinstance(arrays, Mapping) else arrays
  metas, bufs, offset = [], [], 0
  for name, arr in items:
    arr = np.asarray(arr)
    wname, warr = _wire_dtype(arr, (dtypes or {}).get(name))
    nbytes = warr.nbytes
    metas.append({"name": name, "dtype": wname, "shape": list(arr.shape), "offset": offset,
                  "nbytes": nbytes})
    if nbytes:
      bufs.append(memoryview(warr.reshape(-1)).cast("B"))
    offset += nbytes
  head = dict(header)
  head["arrays"] = metas
  hbytes = json.dumps(head, separators=(",", ":")).encode()
  if len(hbytes) > MAX_HEADER_BYTES:
    raise ProtocolError(f"header too large ({len(hbytes)} bytes)")
  return [_PREFIX.pack(MAGIC, len(hbytes), offset), hbytes, *bufs]


def parse_prefix(prefix: bytes) -> tuple[int, int]:
  """Returns (header_len, payload_len) from the 16-byte frame prefix."""
  magic, hlen, plen = _PREFIX.unpack(prefix)
  if magic != MAGIC:
    raise ProtocolError(f"bad magic {magic!r}: peer does not speak the scalerl vLLM protocol")
  if hlen > MAX_HEADER_BYTES:
    raise ProtocolError(f"header length {hlen} exceeds {MAX_HEADER_BYTES}")
  return hlen, plen


def decode(hbytes: bytes, payload: bytes | bytearray | memoryview) -> tuple[dict, dict[str, np.ndarray]]:
  """Parses a header and payload into (header dict, {name: array}), arrays in frame order.

  Arrays are zero-copy views of `payload`; bfloat16 arrays come back as their uint16 bit patterns
  (see `bf16_bits_to_f32`). `header["arrays"]` keeps the per-array metadata (wire dtype names)."""
  header = json.loads(hbytes)
  arrays = {}
  for m in header.get("arrays", []):
    dt = np.dtype(np.uint16 if m["dtype"] == BF16 else m["dtype"]).newbyteorder("<")
    count = int(np.prod(m["shape"], dtype=np.int64))
    if count * dt.itemsize != m["nbytes"] or m["offset"] + m["nbytes"] > len(payload):
      raise ProtocolError(f"array {m['name']!r}: inconsistent size/offset in header")
    arrays[m["name"]] = np.frombuffer(payload, dtype=dt, count=count,
                                      offset=m["offset"]).reshape(m["shape"])
  return header, arrays


# ----------------------------------------------------------------------------- blocking sockets
def _recv_exact(sock: socket.socket, n: int) -> bytearray:
  buf = bytearray(n)
  view, got = memoryview(buf), 0
  while got < n:
    k = sock.recv_into(view[got:], n - got)
    if k == 0:
      raise EOFError("connection closed by peer")
    got += k
  return buf


def send_msg(sock: socket.socket, header: Mapping, arrays=(), dtypes=None) -> int:
  """Sends one message on a blocking socket; returns the number of bytes sent."""
  total = 0
  for b in encode(header, arrays, dtypes):
    sock.sendall(b)
    total += len(b) if isinstance(b, bytes) else b.nbytes
  return total


def recv_msg(sock: socket.socket) -> tuple[dict, dict[str, np.ndarray]]:
  """Receives one message from a blocking socket."""
  hlen, plen = parse_prefix(bytes(_recv_exact(sock, PREFIX_SIZE)))
  hbytes = bytes(_recv_exact(sock, hlen))
  payload = _recv_exact(sock, plen) if plen else bytearray()
  return decode(hbytes, payload)


# ----------------------------------------------------------------------------- numeric helpers
def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
  """float32 -> bfloat16 bit patterns (uint16), round-to-nearest-even like torch's `.to(bfloat16)`."""
  u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
  rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
  nan = np.isnan(x)
  if nan.any():
    rounded = np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
  return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
  """bfloat16 bit patterns (uint16) -> float32 (exact)."""
  return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def chunk_weights(weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                  chunk_bytes: int) -> Iterator[list[tuple[str, np.ndarray]]]:
  """Groups (hf_name, array) pairs into chunks of at most ~chunk_bytes (one big tensor may exceed it)."""
  items = weights.items() if isinstance(weights, Mapping) else weights
  chunk, size = [], 0
  for name, arr in items:
    arr = np.asarray(arr)
    if chunk and size + arr.nbytes > chunk_bytes:
      yield chunk
      chunk, size = [], 0
    chunk.append((str(name), arr))
    size += arr.nbytes
  if chunk:
    yield chunk
