"""HF export of a (multi-host) sharded policy where each process writes its own share.

`save_hf_sharded(cfg, params, path)` is called by every process of a multi-host learner with the
learner's sharded params (jax.Arrays; numpy leaves count as held by every process). It writes the
same HF checkpoint `hf_io.save_hf` writes from gathered params (tensors in cfg.param_dtype, bit for
bit), without a full gather anywhere:

* Every HF tensor (one layer's q_proj, the fused gate_up_proj of a layer's experts, ...) gets one
  owner process, decided identically on every process from the global shardings: a process whose
  own devices hold the whole tensor when there is one (no transfer), else the least loaded;
  owners are balanced by bytes.
* Each owner writes one safetensors file of its tensors, streamed one tensor at a time. A tensor
  its owner holds is assembled from the owner's `addressable_shards` (only the needed layer of a
  scanned stack). A tensor split across processes is replicated one layer-slice at a time (a
  collective every process joins, in the same order) and dropped at once by the non-owners.
* Process 0 writes config.json, generation_config.json and model.safetensors.index.json, after a
  barrier, so config.json (the completeness marker of a gs:// upload) lands last.

So no process holds more than one tensor (+ one source slice) of the model at a time, and each
writes about 1/P of the bytes. `ExportStats` counts what each process wrote, assembled, received
and held at its peak (tests/models/test_hf_export.py checks them).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from scalerl_jax import storage
from scalerl_jax.models import hf_io
from scalerl_jax.models import safetensors_format as st_format
from scalerl_jax.models.config import ModelConfig


@dataclasses.dataclass
class Part:
  """One HF tensor: its name, HF shape and where its pieces come from: (leaf index, block of a
  scanned leaf or None, hf_io.Source)."""
  name: str
  hf_shape: tuple[int, ...]
  view: tuple[int, ...]
  srcs: list = dataclasses.field(default_factory=list)
  owner: int = 0


@dataclasses.dataclass
class ExportStats:
  """What one process did: bytes it wrote (its tensors), assembled from its own shards, received
  through the replicating collective, and the most host bytes it held at once."""
  written_bytes: int = 0
  local_bytes: int = 0
  gathered_bytes: int = 0
  peak_bytes: int = 0
  tensors: int = 0
  files: list = dataclasses.field(default_factory=list)


def plan(cfg: ModelConfig, leaves: list) -> list[Part]:
  """The HF tensors of `cfg`'s params (`leaves`: jax.tree.leaves of the params), in a fixed order,
  each with its sources."""
  srcs = jax.tree.leaves(hf_io.param_sources(cfg),
                         is_leaf=lambda x: isinstance(x, (hf_io.Source, hf_io.Stacked)))
  if len(srcs) != len(leaves):
    raise ValueError(f"params have {len(leaves)} leaves, the model config {len(srcs)}")
  parts: dict[str, Part] = {}
  for i, (src, leaf) in enumerate(zip(srcs, leaves)):
    if tuple(leaf.shape) != tuple(src.shape):
      raise ValueError(f"param {i} ({getattr(src, 'name', '')}): shape {tuple(leaf.shape)} != "
                       f"the model config's {tuple(src.shape)}")
    pieces = [(b, s) for b, s in enumerate(src.sources)] if isinstance(src, hf_io.Stacked) \
        else [(None, src)]
    for b, s in pieces:
      part = parts.setdefault(s.name, Part(s.name, s.hf_shape, s.view))
      part.srcs.append((i, b, s))
  return list(parts.values())


def _boxes(leaf) -> dict[int, set]:
  """process index -> the distinct index boxes ((start, stop) per axis) its devices hold."""
  if not isinstance(leaf, jax.Array):
    return {p: {tuple((0, d) for d in leaf.shape)} for p in range(jax.process_count())}
  out: dict[int, set] = {}
  for dev, idx in leaf.sharding.devices_indices_map(tuple(leaf.shape)).items():
    box = tuple(sl.indices(d)[:2] for sl, d in zip(idx, leaf.shape))
    out.setdefault(dev.process_index, set()).add(box)
  return out


def _covers(boxes, shape, block) -> bool:
  """Do the (disjoint) `boxes` cover the whole leaf (block None) or its block `block`?"""
  want = math.prod(shape[1:]) if block is not None else math.prod(shape)
  got = 0
  for box in boxes:
    if block is not None:
      a, b = box[0]
      if not a <= block < b:
        continue
      got += math.prod(e - s for s, e in box[1:])
    else:
      got += math.prod(e - s for s, e in box)
  return got == want


def assign(parts: list[Part], leaves: list, nprocs: int, itemsize: int) -> None:
  """Sets each part's owner: among the processes holding all its sources, else among all, the
  one with the fewest bytes so far (largest parts first; ties to the lower index)."""
  boxes = [_boxes(leaf) for leaf in leaves]
  load = [0] * nprocs
  for part in sorted(parts, key=lambda p: -math.prod(p.hf_shape)):
    holders = [p for p in range(nprocs)
               if all(_covers(boxes[i].get(p, ()), leaves[i].shape, b) for i, b, _ in part.srcs)]
    part.owner = min(holders or range(nprocs), key=lambda p: (load[p], p))
    load[part.owner] += math.prod(part.hf_shape) * itemsize


def _local(leaf, block) -> np.ndarray:
  """The leaf (or its block `block` of the leading axis) from this process's own shards."""
  if not isinstance(leaf, jax.Array):
    return np.asarray(leaf if block is None else leaf[block])
  shape = tuple(leaf.shape[1:]) if block is not None else tuple(leaf.shape)
  out = np.empty(shape, leaf.dtype)
  for sh in leaf.addressable_shards:
    idx = list(sh.index) + [slice(None)] * (leaf.ndim - len(sh.index))
    if block is None:
      out[tuple(idx)] = np.asarray(sh.data)
      continue
    a, b, _ = idx[0].indices(leaf.shape[0])
    if a <= block < b:
      out[tuple(idx[1:])] = np.asarray(sh.data[block - a])
  return out


_REPLICATE: dict = {}


def _replicated(leaf, block) -> jax.Array:
  """`leaf` (or leaf[block]) replicated on every device of its mesh: a collective."""
  if not isinstance(leaf.sharding, NamedSharding):
    raise ValueError(f"a multi-host leaf with a {type(leaf.sharding).__name__}: NamedSharding only")
  rep = NamedSharding(leaf.sharding.mesh, PartitionSpec())
  key = (rep, block is None)
  if key not in _REPLICATE:
    if block is None:
      _REPLICATE[key] = jax.jit(lambda x: x, out_shardings=rep)
    else:
      _REPLICATE[key] = jax.jit(lambda x, b: jax.lax.dynamic_index_in_dim(x, b, 0, False),
                                out_shardings=rep)
  fn = _REPLICATE[key]
  return fn(leaf) if block is None else fn(leaf, np.int32(block))


def to_hf(part: Part, blocks: list, dtype) -> np.ndarray:
  """Part `part`'s HF tensor in `dtype` from its sources' blocks (our layout, `part.srcs` order):
  the inverse of `Source.to_ours` (transpose back, fill the fixed slots, reshape)."""
  view = np.empty(part.view, dtype)
  filled = 0
  for (_, _, s), x in zip(part.srcs, blocks):
    fixed = dict(s.fixed)
    idx = tuple(fixed[a] if a in fixed else slice(None) for a in range(len(s.view)))
    view[idx] = np.asarray(x).transpose(np.argsort(s.perm))
    filled += x.size
  if filled != view.size:
    raise ValueError(f"tensor {part.name!r}: sources fill {filled} of {view.size} elements")
  return view.reshape(part.hf_shape)


def _file_names(parts: list[Part]) -> dict[int, str]:
  """owner -> its file name (model.safetensors when one process owns everything)."""
  owners = sorted({p.owner for p in parts})
  if len(owners) == 1:
    return {owners[0]: hf_io.SINGLE_FILE}
  return {o: f"model-{k + 1:05d}-of-{len(owners):05d}.safetensors" for k, o in enumerate(owners)}


def _write_own(parts, leaves, me, dtype, local_path, fname, stats: ExportStats) -> None:
  """Streams this process's tensors into `fname`; joins every other owner's collectives."""
  mine = [p for p in parts if p.owner == me]
  f = open(os.path.join(local_path, fname), "wb") if mine else None
  try:
    if f is not None:
      f.write(st_format.header_bytes([(p.name, dtype, p.hf_shape) for p in mine]))
    boxes = [_boxes(leaf) for leaf in leaves]
    for part in parts:
      blocks, held = [], 0
      for i, b, _ in part.srcs:
        leaf = leaves[i]
        if _covers(boxes[i].get(part.owner, ()), leaf.shape, b):
          x = _local(leaf, b) if part.owner == me else None
          stats.local_bytes += x.nbytes if x is not None else 0
        else:
          y = _replicated(leaf, b)          # every process joins, in the same order
          x = np.asarray(y.addressable_data(0)) if part.owner == me else None
          n = y.addressable_data(0).nbytes
          stats.gathered_bytes += n
          stats.peak_bytes = max(stats.peak_bytes, held + n)
          del y
        if x is not None:
          blocks.append(x)
          held += x.nbytes
      if f is None or part.owner != me:
        continue
      arr = np.ascontiguousarray(to_hf(part, blocks, dtype))
      stats.peak_bytes = max(stats.peak_bytes, held + arr.nbytes)
      f.write(arr.data)
      stats.written_bytes += arr.nbytes
      stats.tensors += 1
  finally:
    if f is not None:
      f.close()


def save_hf_sharded(cfg: ModelConfig, params: Any, path: str) -> ExportStats:
  """Writes `params` (sharded jax.Arrays, possibly over several processes; every process calls
  this) as an HF checkpoint in directory `path` (local or gs://), each process writing its own
  tensors (module docstring). Bit-identical to hf_io.save_hf of the gathered params."""
  leaves = jax.tree.leaves(params)
  me, nprocs = jax.process_index(), jax.process_count()
  dtype = hf_io.param_dtype(cfg)
  parts = plan(cfg, leaves)
  assign(parts, leaves, nprocs, dtype.itemsize)
  names = _file_names(parts)
  stats = ExportStats(files=[names[me]] if me in names else [])
  with storage.staged_dir(path, last=()) as local:      # gs://: uploaded when the block ends
    _write_own(parts, leaves, me, dtype, local, names.get(me, ""), stats)
  if nprocs > 1:
    multihost_utils.sync_global_devices("hf_export: every tensor file written")
  if me == 0:
    with storage.staged_dir(path) as local:            # config.json last
      hf_io.write_config(cfg, local)
      stale = storage.join(path, hf_io.INDEX_FILE)     # an earlier export's, now one file
      if len(names) == 1 and storage.exists(stale):
        storage.remove(stale)
      if len(names) > 1:
        index = {"metadata": {"total_size": sum(math.prod(p.hf_shape) for p in parts) *
                              dtype.itemsize},
                 "weight_map": {p.name: names[p.owner] for p in parts}}
        with open(os.path.join(local, hf_io.INDEX_FILE), "w") as f:
          json.dump(index, f, indent=2)
  if nprocs > 1:
    multihost_utils.sync_global_devices("hf_export: done")
  return stats
