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
  weights_shm    header: path (a file in /dev/shm written by the client) + `arrays` metadata as in
                 a frame, no payload: vLLM's worker maps the file and loads the tensors from it
                 (no socket or RPC copy of the bytes; `ShmSlots`). Same semantics as weights_chunk.
  weights_end    header: version. Stamps the new version and resumes generation.
  info           reply: engine/model facts (vLLM version, dtypes, logits dtype probe, ...).
  set_head_dtype header: dtype ("float32" | "bfloat16" | "model"); test hook for the parity gate.
  param_digest   reply: digest, a sha256 over the served model's parameters and buffers.
  shutdown       stops the engine; the worker exits after replying.
The worker sends one unsolicited {"op": "ready", "id": 0, ...} once its engine is up, or
{"op": "fatal", "id": 0, "error": ...} if it cannot start.
"""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import tempfile
from typing import Iterable, Iterator, Mapping, cast

import numpy as np

try:
  import ml_dtypes
except ImportError:   # the vLLM venv has none: f32_to_bf16_bits falls back to NumPy
  ml_dtypes = None

MAGIC = b"SRLV"
_PREFIX = struct.Struct("<4sIQ")
PREFIX_SIZE = _PREFIX.size
MAX_HEADER_BYTES = 64 << 20

BF16 = "bfloat16"
_ALLOWED = {"float32", "float16", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16",
            "uint32", "bool", BF16}


class ProtocolError(RuntimeError):
  """A malformed frame or an unexpected message."""


def _wire_name(arr: np.ndarray, dtype: str | None) -> str:
  """The dtype name `arr` travels as (`dtype` requested, e.g. "bfloat16" for a float32 array)."""
  name = dtype or arr.dtype.name
  if arr.dtype.name == BF16 or (name == BF16 and arr.dtype == np.uint16):  # ml_dtypes / raw bits
    return BF16
  if name != BF16 and name not in _ALLOWED:
    raise ProtocolError(f"dtype {name!r} is not supported on the wire (allowed: {sorted(_ALLOWED)})")
  return name


def _wire_dtype(arr: np.ndarray, dtype: str | None) -> tuple[str, np.ndarray]:
  """Returns (dtype name on the wire, little-endian contiguous array holding the bytes)."""
  name = _wire_name(arr, dtype)
  if name == BF16:
    if arr.dtype.name == BF16 or arr.dtype == np.uint16:
      return BF16, np.ascontiguousarray(arr).view(np.uint16)
    return BF16, f32_to_bf16_bits(np.asarray(arr, dtype=np.float32))   # halves the bytes
  arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<") if arr.dtype.itemsize > 1
                             else arr.dtype)
  return name, arr


def _views(metas: list[dict], buf, where: str) -> dict[str, np.ndarray]:
  """{name: zero-copy view} of the arrays `metas` describe in `buf` (frame payload or mapped
  file); bf16 as uint16 bit patterns; "transposed" arrays are stored in their transpose's order."""
  out = {}
  for m in metas:
    dt = np.dtype(np.uint16 if m["dtype"] == BF16 else m["dtype"]).newbyteorder("<")
    count = int(np.prod(m["shape"], dtype=np.int64))
    if count * dt.itemsize != m["nbytes"] or m["offset"] + m["nbytes"] > len(buf):
      raise ProtocolError(f"array {m['name']!r}: inconsistent size/offset in {where}")
    shape = list(m["shape"])
    if m.get("transposed") and len(shape) != 2:
      raise ProtocolError(f"array {m['name']!r}: only 2-D arrays can be transposed")
    flat = np.frombuffer(buf, dtype=dt, count=count, offset=m["offset"])
    out[m["name"]] = flat.reshape(shape[::-1]).T if m.get("transposed") else flat.reshape(shape)
  return out


def encode(header: Mapping, arrays: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]] = (),
           dtypes: Mapping[str, str] | None = None) -> list[memoryview | bytes]:
  """Serializes one message; returns buffers to send in order (array bytes are not copied)."""
  # cast: to a type checker the pairs could also be a Mapping (of pairs), which they never are
  items = cast(Iterable[tuple[str, np.ndarray]],
               arrays.items() if isinstance(arrays, Mapping) else arrays)
  metas, bufs, offset = [], [], 0
  for name, arr in items:
    arr = np.asarray(arr)
    wname, warr = _wire_dtype(arr, (dtypes or {}).get(name))
    nbytes = warr.nbytes
    metas.append({"name": name, "dtype": wname, "shape": list(arr.shape), "offset": offset,
                  "nbytes": nbytes})
    if nbytes:
      bufs.append(warr.reshape(-1).data.cast("B"))     # .data: the array's memoryview
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
  return header, _views(header.get("arrays", []), payload, "header")


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
def f32_to_bf16_bits(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
  """float32 -> bfloat16 bit patterns (uint16), round-to-nearest-even like torch's `.to(bfloat16)`.

  Uses ml_dtypes' cast (one pass, ~9 GB/s) where it is importable (the JAX venv), else NumPy
  integer arithmetic (~0.5 GB/s); NaNs keep their sign and payload bits (quieted) either way.
  `out`: an existing uint16 array of x's shape to write into."""
  x = np.asarray(x, dtype=np.float32)
  if ml_dtypes is not None:
    if out is None:
      out = np.empty(x.shape, np.uint16)
    np.copyto(out.view(ml_dtypes.bfloat16), x, casting="unsafe")
    nan = np.isnan(x)
    if nan.any():
      out[nan] = ((x[nan].view(np.uint32) >> 16) | 0x40).astype(np.uint16)
    return out
  bits = _f32_to_bf16_bits_np(x)
  if out is not None:
    out[...] = bits
    return out
  return bits


def _f32_to_bf16_bits_np(x: np.ndarray) -> np.ndarray:
  u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
  rounded = ((u + (((u >> 16) & 1) + 0x7FFF)) >> 16).astype(np.uint16)
  nan = np.isnan(x)
  if nan.any():
    rounded = np.where(nan, ((u >> 16) | 0x40).astype(np.uint16), rounded)
  return rounded


def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
  """bfloat16 bit patterns (uint16) -> float32 (exact)."""
  return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def checkpoint_shapes(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
  """{HF name: shape} of every tensor in an HF safetensors checkpoint directory, read from the
  files' JSON headers only (no tensor bytes)."""
  out: dict[str, tuple[int, ...]] = {}
  for name in sorted(os.listdir(path)) if os.path.isdir(path) else ():
    if not name.endswith(".safetensors"):
      continue
    with open(os.path.join(path, name), "rb") as f:
      (n,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(n))
    out.update({k: tuple(int(d) for d in v["shape"]) for k, v in header.items()
                if k != "__metadata__"})
  return out


def served_names(pushed: Iterable[str], known: set[str]) -> tuple[dict[str, str], list[str]]:
  """How pushed HF names map onto the names the served model accepts (`known`, derived from the
  model vLLM loaded): ({pushed: served} for the names the model holds under a prefix, e.g. a
  Llama-4 ForConditionalGeneration's `language_model.` in front of the text model's
  `model.layers...` and `lm_head.weight`; names it accepts as they are are not listed), and the
  names it does not accept at all. One prefix for the whole update: the one that maps the most
  names (the shortest among equals), taken from the model's own names, never fixed here."""
  missing = [n for n in pushed if n not in known]
  if not missing:
    return {}, []
  want = set(missing)
  counts: dict[str, int] = {}
  for k in known:
    parts = k.split(".")
    for i in range(1, len(parts)):
      if ".".join(parts[i:]) in want:
        p = ".".join(parts[:i]) + "."
        counts[p] = counts.get(p, 0) + 1
  if not counts:
    return {}, missing
  prefix = min(counts, key=lambda p: (-counts[p], len(p)))
  mapping = {n: prefix + n for n in missing if prefix + n in known}
  return mapping, [n for n in missing if n not in mapping]


def hf_layer_key(name: str) -> str:
  """The module a HF tensor name belongs to for chunking: "model.layers.7" for layer tensors, else
  the name itself."""
  parts = name.split(".")
  if "layers" in parts:
    i = parts.index("layers")
    return ".".join(parts[:i + 2])
  return name


def chunk_weights(weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                  chunk_bytes: int, group=None) -> Iterator[list[tuple[str, np.ndarray]]]:
  """Groups (hf_name, array) pairs into chunks of at most ~chunk_bytes (one big tensor may exceed
  it). `group(name)`: consecutive tensors with the same key never straddle two chunks (a chunk then
  holds whole layers: vLLM's layerwise reload finishes each layer within one load call)."""
  items = weights.items() if isinstance(weights, Mapping) else weights
  chunk, size, pending, psize, key = [], 0, [], 0, object()
  for name, arr in items:
    arr, k = np.asarray(arr), (group(str(name)) if group else object())
    if pending and k != key:      # a group is complete: it goes into the current chunk or the next
      if chunk and size + psize > chunk_bytes:
        yield chunk
        chunk, size = [], 0
      chunk += pending
      size += psize
      pending, psize = [], 0
    key = k
    pending.append((str(name), arr))
    psize += arr.nbytes
  if pending:
    if chunk and size + psize > chunk_bytes:
      yield chunk
      chunk, size = [], 0
    chunk += pending
  if chunk:
    yield chunk


# ----------------------------------------------------------------------------- shared memory
class ShmSlots:
  """Weight chunks handed to the vLLM worker through files in /dev/shm instead of the socket.

  `nslots` files are mapped once and reused (no page faults after the first update); the client
  writes chunk i into slot i % nslots (the bf16 cast fused into that one copy) and sends only the
  path and metadata; it must wait for chunk i's reply before reusing its slot. The worker side maps
  the file read-only (`read_shm`). Files are 0600, removed on `close`."""

  def __init__(self, nslots: int = 2, directory: str = "/dev/shm"):
    self._mmap, self.dir = mmap, directory
    self.slots = []
    for _ in range(nslots):
      fd, path = tempfile.mkstemp(prefix="scalerl-weights-", dir=directory)
      self.slots.append({"path": path, "fd": fd, "size": 0, "map": None})

  def write(self, i: int, chunk, dtypes=None) -> tuple[str, list[dict]]:
    """Writes chunk i's arrays into its slot; returns (path, array metadata as in a frame)."""
    slot = self.slots[i % len(self.slots)]
    plan, off = [], 0
    for name, arr in chunk:
      arr = np.asarray(arr)
      wname = _wire_name(arr, (dtypes or {}).get(name))
      item = 2 if wname == BF16 else np.dtype(wname).itemsize
      off = -(-off // 64) * 64                  # 64-byte aligned tensors
      plan.append((name, arr, wname, off, arr.size * item))
      off += arr.size * item
    if off > slot["size"]:
      if slot["map"] is not None:
        slot["map"].close()
      os.ftruncate(slot["fd"], off)
      slot["map"] = self._mmap.mmap(slot["fd"], off)
      slot["size"] = off
    metas = []
    for name, arr, wname, o, n in plan:
      meta = {"name": name, "dtype": wname, "shape": list(arr.shape), "offset": o, "nbytes": n}
      # A transposed view (our [in, out] params as HF's [out, in]) is stored in its contiguous
      # order and flagged: a memcpy here, and vLLM's loader reads it through a transposed view.
      if arr.ndim == 2 and not arr.flags.c_contiguous and arr.T.flags.c_contiguous:
        arr, meta["transposed"] = arr.T, True
      wdt = np.dtype(np.uint16 if wname == BF16 else wname).newbyteorder("<")
      dst = np.frombuffer(slot["map"], dtype=wdt, count=arr.size, offset=o).reshape(arr.shape)
      if wname == BF16 and arr.dtype.name != BF16 and arr.dtype != np.uint16:
        f32_to_bf16_bits(arr, out=dst)
      elif wname == BF16:
        dst[...] = arr.view(np.uint16)
      else:
        np.copyto(dst, arr, casting="same_kind")
      metas.append(meta)
    return slot["path"], metas

  def close(self) -> None:
    """Unmaps and removes the files (idempotent)."""
    for slot in self.slots:
      if slot["map"] is not None:
        slot["map"].close()
        slot["map"] = None
      if slot["fd"] is not None:
        os.close(slot["fd"])
        slot["fd"] = None
        try:
          os.unlink(slot["path"])
        except FileNotFoundError:
          pass


def read_shm(path: str, metas: list[dict], cache: dict | None = None) -> dict[str, np.ndarray]:
  """The worker side of `ShmSlots`: {name: read-only view} of the arrays in `path` (bf16 as uint16
  bit patterns). `cache` (path -> mapping) keeps files mapped across calls."""
  if not path.startswith("/dev/shm/") or ".." in path:
    raise ProtocolError(f"weights_shm path {path!r} is not a file in /dev/shm")
  cache = {} if cache is None else cache
  size = os.path.getsize(path)
  m = cache.get(path)
  if m is None or len(m) != size:
    with open(path, "rb") as f:
      m = cache[path] = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
  return _views(metas, m, path)
