"""Start checkpoint -> sharded params: each process reads only the slices its devices hold.

`load_sharded(path, cfg, shardings)` builds every param with `jax.make_array_from_callback`
straight from a save_pretrained directory (local or gs://; one model.safetensors or an index +
shards; Llama-3 / Llama-4 text, or a Llama4ForConditionalGeneration checkpoint whose text weights
sit under `language_model.`, vision tower and projector skipped). Per param:

1. `hf_io.param_sources(cfg)` says which HF tensor it is and how it is laid out (transposes, the
   N*H split of q/k/v/o, the gate / up halves of a fused `gate_up_proj`; for scanned layers, which
   layer each block is);
2. the boxes (index slices) of this process's addressable devices are mapped into the HF tensor's
   row-major view, and only those bytes are read (`safetensors_format.read_box`, through
   `storage.RangedFile`: locally a memory map of a bounded window at a time, copying out only the
   box; on gs:// ranged GETs). When the devices' boxes tile one rectangle (any NamedSharding's
   do) it is read once, one layer at a time;
3. each device's slice is converted to the param dtype into its own array (bf16 -> f32 exact; f32
   -> bf16 round-to-nearest-even, as torch does).

Nothing is gathered; nothing is written locally. Peak host memory is this process's share of the
params plus about one param's share (docs/MODELS.md "Start from a checkpoint" has measurements).

Reads from gs:// go through a gap up to `REMOTE_MAX_GAP` bytes instead of issuing another request
(a column slice of a row-major tensor is many short runs: e.g. the fsdp-sharded d_model axis of q);
local reads are exact.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any

import jax
import numpy as np

from scalerl_jax import storage
from scalerl_jax.models import hf_io
from scalerl_jax.models import safetensors_format as st_format
from scalerl_jax.models.config import ModelConfig, from_hf_config

MULTIMODAL_PREFIX = "language_model."
LOCAL_MAX_GAP = 0
REMOTE_MAX_GAP = 256 << 10


class HFCheckpoint:
  """A save_pretrained directory (local or gs://): config.json, the tensor headers of every shard,
  and byte-range reads of tensor slices. Only headers are read at construction."""

  def __init__(self, path: str, max_gap: int | None = None):
    self.path = str(path).rstrip("/")
    remote = storage.is_remote(self.path)
    self.max_gap = (REMOTE_MAX_GAP if remote else LOCAL_MAX_GAP) if max_gap is None else max_gap
    cfg_path = storage.join(self.path, "config.json")
    if not storage.exists(cfg_path):
      raise FileNotFoundError(f"model.hf_checkpoint={path!r}: no config.json there (expected a "
                              "save_pretrained directory, local or gs://)")
    self.hf_config = json.loads(storage.read_text(cfg_path))
    index = storage.join(self.path, hf_io.INDEX_FILE)
    if storage.exists(index):
      files = sorted(set(json.loads(storage.read_text(index))["weight_map"].values()))
    elif storage.exists(storage.join(self.path, hf_io.SINGLE_FILE)):
      files = [hf_io.SINGLE_FILE]
    else:
      raise FileNotFoundError(f"model.hf_checkpoint={path!r}: no {hf_io.SINGLE_FILE} or "
                              f"{hf_io.INDEX_FILE}")
    self._files: dict[str, storage.RangedFile] = {}
    self._tensors: dict[str, tuple[str, st_format.TensorInfo]] = {}
    for fn in files:
      fp = storage.join(self.path, fn)
      try:
        f = storage.RangedFile(fp)
      except FileNotFoundError:
        raise FileNotFoundError(f"model.hf_checkpoint={path!r}: shard {fn} listed in "
                                f"{hf_io.INDEX_FILE} is missing") from None
      self._files[fn] = f
      infos, _ = st_format.parse_header(f.read, size=f.size, where=fp)
      for name, info in infos.items():
        self._tensors[name] = (fn, info)
    self.prefix = (MULTIMODAL_PREFIX
                   if MULTIMODAL_PREFIX + "model.embed_tokens.weight" in self._tensors else "")

  def model_config(self, **overrides: Any) -> ModelConfig:
    """ModelConfig from config.json (`overrides`: numerics fields, e.g. param_dtype)."""
    return from_hf_config(self.hf_config, **overrides)

  def keys(self) -> list[str]:
    return list(self._tensors)

  def info(self, name: str) -> tuple[str, st_format.TensorInfo]:
    """(file, TensorInfo) of the text-model tensor `name` (the multimodal prefix added)."""
    full = self.prefix + name
    if full not in self._tensors:
      raise ValueError(f"tensor {full!r} missing from checkpoint {self.path}")
    return self._tensors[full]

  def read_source_box(self, src: hf_io.Source, box) -> np.ndarray:
    """`box` (our axes) of param source `src` in our layout and the stored dtype (a view of a
    block holding only the needed bytes)."""
    fn, info = self.info(src.name)
    if info.shape != src.hf_shape:
      raise ValueError(f"tensor {src.name!r}: shape {info.shape} != expected {src.hf_shape} "
                       f"(checkpoint {self.path})")
    f = self._files[fn]
    exact = self.max_gap == 0 and not f.remote     # local: vectorised copies from a memory map
    raw = st_format.read_box(f.read_many, info, src.view, src.view_box(box),
                             max_gap=self.max_gap, mapper=f.map if exact else None)
    if exact:
      f.bytes_read += raw.nbytes
    return src.to_ours(raw)

  @property
  def bytes_read(self) -> int:
    return sum(f.bytes_read for f in self._files.values())

  @property
  def requests(self) -> int:
    return sum(f.requests for f in self._files.values())

  def close(self) -> None:
    for f in self._files.values():
      f.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _box(index, shape) -> tuple[tuple[int, int], ...]:
  """A device's index (tuple of slices) -> ((start, stop), ...) per axis."""
  index = tuple(index) + (slice(None),) * (len(shape) - len(index))
  out = []
  for s, n in zip(index, shape):
    a, b, step = s.indices(n)
    if step != 1:
      raise ValueError(f"strided shard index {s} is not supported")
    out.append((a, b))
  return tuple(out)


def _volume(box) -> int:
  return math.prod(b - a for a, b in box)


def _read_and_fill(ckpt, src, need: dict, fill) -> None:
  """Reads the boxes in `need` ({box: out array}) of `src` and calls fill(out, box, ours, obox)
  with `ours` the read block in our layout covering box `obox`. One read of the bounding box
  when the boxes tile it, else one read per box."""
  boxes = list(need)
  bbox = tuple((min(b[j][0] for b in boxes), max(b[j][1] for b in boxes))
               for j in range(len(boxes[0])))
  if sum(_volume(b) for b in boxes) == _volume(bbox):
    ours = ckpt.read_source_box(src, bbox)
    for b in boxes:
      fill(need[b], b, ours, bbox)
  else:
    for b in boxes:
      fill(need[b], b, ckpt.read_source_box(src, b), b)


def _load_leaf(ckpt: HFCheckpoint, src, sh, dt) -> jax.Array:
  shape = src.shape
  boxes = {_box(idx, shape) for idx in sh.addressable_devices_indices_map(shape).values()}
  outs = {b: np.empty([e - s for s, e in b], dt) for b in boxes}   # one per distinct slice

  def put(out, b, ours, obox, lead=()) -> None:
    rel = tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(b, obox))
    out[lead] = ours[rel]      # converts to the param dtype (setitem casts)

  if isinstance(src, hf_io.Stacked):   # scanned: one layer (block) at a time
    for blk, layer_src in enumerate(src.sources):
      need = {b[1:]: (outs[b], blk - b[0][0]) for b in boxes if b[0][0] <= blk < b[0][1]}
      if need:
        _read_and_fill(ckpt, layer_src, need,
                       lambda o, b, ours, obox: put(o[0], b, ours, obox, (o[1],)))
  elif boxes:
    _read_and_fill(ckpt, src, {b: outs[b] for b in boxes}, put)
  return jax.make_array_from_callback(shape, sh, lambda idx: outs[_box(idx, shape)], dtype=dt)


def load_sharded(path_or_ckpt, cfg: ModelConfig, shardings) -> tuple[dict, dict]:
  """Params of `cfg` from an HF checkpoint (path or HFCheckpoint), placed in `shardings` (a tree
  of jax Shardings matching the params), each process reading only its devices' slices.

  Returns (params, stats): stats = {"bytes_read", "requests" (this process's reads),
  "seconds", "local_param_bytes" (bytes this process's devices hold)}."""
  t0 = time.time()
  own = not isinstance(path_or_ckpt, HFCheckpoint)
  ckpt = HFCheckpoint(path_or_ckpt) if own else path_or_ckpt
  try:
    sources = hf_io.param_sources(cfg)
    is_src = lambda x: isinstance(x, (hf_io.Source, hf_io.Stacked))
    if jax.tree.structure(sources, is_leaf=is_src) != jax.tree.structure(shardings):
      raise ValueError("shardings do not match the params of the checkpoint's model config")
    dt = hf_io.param_dtype(cfg)
    before = ckpt.bytes_read, ckpt.requests
    params = jax.tree.map(lambda s, sh: _load_leaf(ckpt, s, sh, dt), sources, shardings,
                          is_leaf=is_src)
    local = sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)
    stats = dict(bytes_read=ckpt.bytes_read - before[0], requests=ckpt.requests - before[1],
                 seconds=time.time() - t0, local_param_bytes=int(local))
    return params, stats
  finally:
    if own:
      ckpt.close()
