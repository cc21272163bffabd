"""The one safetensors parser/writer of the project (no torch, no `safetensors` package needed).

Format: u64 little-endian header length N, N bytes of JSON {name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}} (offsets relative to the end of the header),
then the raw little-endian tensor data.

* `parse_header(read)` reads and validates a header through `read(offset, n) -> bytes` (a local
  file, a ranged gs:// reader, or in-memory bytes) -> {name: TensorInfo} with absolute offsets.
* `write_file(path, tensors)` writes a file `transformers` loads; `header_bytes(specs)` is its
  header, for writers that stream the tensors one at a time (models/hf_export.py).
* `read_box(reader, info, shape, box)` reads one rectangular slice of a tensor (viewed row-major as
  `shape`) by byte ranges: only the runs the slice covers (gaps up to `max_gap` bytes are read
  through to save requests), in pieces of at most `piece_bytes`.

Used by models/hf_io.py (checkpoint directories), models/hf_slices.py (sharded start-checkpoint
loading) and generation/sampler.py (weight payloads).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import struct
from typing import Callable, Mapping

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20     # the reference implementation's limit
PIECE_BYTES = 16 << 20           # read_box: at most this much read per request (bounded temp)


@dataclasses.dataclass(frozen=True)
class TensorInfo:
  """Where one tensor lives: dtype, shape, absolute byte offset of its data and its size."""
  name: str
  dtype: np.dtype
  shape: tuple[int, ...]
  offset: int
  nbytes: int


def parse_header(read: Callable[[int, int], bytes | memoryview], size: int | None = None,
                 where: str = "safetensors data") -> tuple[dict[str, TensorInfo], dict]:
  """Reads the header through `read(offset, n)`; returns ({name: TensorInfo}, metadata).

  `size` (total bytes, when known) bounds the data offsets. Raises ValueError naming `where` on a
  malformed header, an unsupported dtype or offsets that do not match a tensor's shape."""
  head = bytes(read(0, 8))
  if len(head) < 8:
    raise ValueError(f"{where}: shorter than its 8-byte header length")
  (n,) = struct.unpack("<Q", head)
  if n > MAX_HEADER_BYTES or (size is not None and 8 + n > size):
    raise ValueError(f"{where}: header length {n} exceeds the data"
                     f"{f' ({size} bytes)' if size is not None else ''}")
  try:
    header = json.loads(bytes(read(8, n)))
  except ValueError as e:
    raise ValueError(f"{where}: header is not valid JSON ({e})") from None
  meta = header.pop("__metadata__", None) or {}
  base = 8 + n
  out = {}
  for name, m in header.items():
    if m.get("dtype") not in DTYPES:
      raise ValueError(f"{where}: tensor {name!r} has unsupported dtype {m.get('dtype')!r}")
    dt = np.dtype(DTYPES[m["dtype"]])
    shape = tuple(int(d) for d in m["shape"])
    begin, end = (int(x) for x in m["data_offsets"])
    if end - begin != math.prod(shape) * dt.itemsize or begin < 0 or \
        (size is not None and base + end > size):
      raise ValueError(f"{where}: tensor {name!r}: data_offsets {begin, end} do not match shape "
                       f"{shape} ({m['dtype']})")
    out[name] = TensorInfo(name, dt, shape, base + begin, end - begin)
  return out, meta


def header_bytes(specs) -> bytes:
  """The 8-byte length + JSON header (padded to 8 bytes) of a file holding `specs`
  [(name, numpy dtype, shape), ...] in that order, data back to back."""
  header, offset = {}, 0
  for name, dtype, shape in specs:
    dtype = np.dtype(dtype)
    if dtype not in NAMES:
      raise ValueError(f"cannot write {name!r} of dtype {dtype}")
    n = math.prod(shape) * dtype.itemsize
    header[name] = {"dtype": NAMES[dtype], "shape": [int(d) for d in shape],
                    "data_offsets": [offset, offset + n]}
    offset += n
  header["__metadata__"] = {"format": "pt"}
  hb = json.dumps(header, separators=(",", ":")).encode()
  hb += b" " * (-len(hb) % 8)
  return struct.pack("<Q", len(hb)) + hb


def write_file(path: str, tensors: Mapping[str, np.ndarray]) -> None:
  """Writes a safetensors file (header padded to 8 bytes, tensors in the given order)."""
  arrays = {name: np.ascontiguousarray(arr) for name, arr in tensors.items()}
  with open(path, "wb") as f:
    f.write(header_bytes([(n, a.dtype, a.shape) for n, a in arrays.items()]))
    for arr in arrays.values():
      f.write(arr.tobytes())


def read_box(read_many: Callable[[list[tuple[int, int]]], list], info: TensorInfo,
             shape: tuple[int, ...], box: list[tuple[int, int]], *, max_gap: int = 0,
             piece_bytes: int = PIECE_BYTES, mapper=None) -> np.ndarray:
  """Reads `tensor[box]` of the tensor `info`, viewed row-major as `shape` (a reshape of its
  stored shape), as a new array in the stored dtype.

  `read_many([(offset, n), ...]) -> [bytes-like, ...]` does the I/O (one call per batch of about
  `piece_bytes`). Contiguous runs are read exactly; where the gap between consecutive runs along
  an axis is at most `max_gap` bytes, that axis is read whole (fewer, larger requests: the gap
  bytes are read and dropped).

  `mapper(offset, n) -> uint8 array` (a local file's memory map): instead of one read per run,
  windows of about `piece_bytes` along the first axis are mapped in turn and only the box's
  elements copied out (a vectorised copy; only the pages holding them are touched, and at most
  one window is mapped at a time)."""
  if math.prod(shape) * info.dtype.itemsize != info.nbytes:
    raise ValueError(f"tensor {info.name!r}: view {shape} does not match stored {info.shape}")
  it = info.dtype.itemsize
  nd = len(shape)
  box = [(int(a), int(b)) for a, b in box]
  if any(not 0 <= a <= b <= s for (a, b), s in zip(box, shape)) or len(box) != nd:
    raise ValueError(f"tensor {info.name!r}: box {box} outside shape {shape}")
  out = np.empty([b - a for a, b in box], info.dtype)
  if out.size == 0:
    return out
  if mapper is not None:
    row = math.prod(shape[1:]) * it
    per = max(1, piece_bytes // max(row, 1))
    rest = tuple(slice(a, b) for a, b in box[1:])
    for r0 in range(box[0][0], box[0][1], per):
      r1 = min(r0 + per, box[0][1])
      window = mapper(info.offset + r0 * row, (r1 - r0) * row)
      out[r0 - box[0][0]:r1 - box[0][0]] = \
          window.view(info.dtype).reshape((r1 - r0,) + tuple(shape[1:]))[(slice(None),) + rest]
      del window
    return out
  strides = [math.prod(shape[j + 1:]) for j in range(nd)]
  # Axes k+1.. are read whole (full in the box, or widened over a small gap); axis k is the run.
  wide = list(box)
  k, inner = nd - 1, 1
  while k >= 0:
    a, b = wide[k]
    outer_runs = math.prod(bb - aa for aa, bb in box[:k])
    full = (a, b) == (0, shape[k])
    if not full and (outer_runs == 1 or (shape[k] - (b - a)) * inner * it > max_gap):
      break
    wide[k] = (0, shape[k])
    inner *= shape[k]
    k -= 1
  if k < 0:        # the whole tensor in one run
    k, wide = 0, [(0, shape[0])] + wide[1:]
    inner //= shape[0]
  row = inner * it                                   # one index of axis k, axes > k whole
  rows_per_piece = max(1, piece_bytes // row)
  trim = tuple(slice(b[0] - w[0], b[1] - w[0]) for b, w in zip(box[k + 1:], wide[k + 1:]))
  inner_shape = [w[1] - w[0] for w in wide[k + 1:]]
  pieces = []     # (byte offset, nbytes, out index)
  for outer in itertools.product(*[range(a, b) for a, b in box[:k]]):
    base = sum(i * s for i, s in zip(outer, strides))
    rel = tuple(i - a for i, (a, _) in zip(outer, box[:k]))
    for r0 in range(box[k][0], box[k][1], rows_per_piece):
      r1 = min(r0 + rows_per_piece, box[k][1])
      pieces.append(((base + r0 * strides[k]) * it + info.offset, (r1 - r0) * row,
                     rel + (slice(r0 - box[k][0], r1 - box[k][0]),)))
  batch, size = [], 0
  for p in pieces + [None]:
    if p is not None:
      batch.append(p)
      size += p[1]
    if batch and (p is None or size >= piece_bytes):
      for (_, n, where), data in zip(batch, read_many([(o, n) for o, n, _ in batch])):
        if len(data) != n:
          raise ValueError(f"tensor {info.name!r}: short read ({len(data)} of {n} bytes)")
        block = np.frombuffer(data, info.dtype).reshape([-1] + inner_shape)
        out[where] = block[(slice(None),) + trim]
      batch, size = [], 0
  return out
