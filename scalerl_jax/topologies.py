"""Named hardware targets (device count + per-device memory) and per-model layouts on them.

A *topology* is hardware: how many accelerators the learner gets and how much memory each has.
A *layout* is a model's choice on that hardware: mesh shape over (data, fsdp, tensor, expert),
micro-batches, remat / scan. A layout is named after its topology, or names it in a `topology`
field (e.g. `h100_16_fsdp` on `h100_16`). Layouts live in the config files (`configs/8b.py`, `configs/scout.py`,
`LAYOUTS`), are copied into `config.layouts`, and `apply_layout(config)` makes `config.topology`
take effect (so `--config.topology=NAME` works for any tool that calls it; `get_config("NAME")`
applies it directly).

Memory figures (bytes per device, decimal GB as vendors state them):

| name | devices | HBM / device | source |
|---|---|---|---|
| tpu_v5p_16, tpu_v5p_64 | 16, 64 | 95 GB HBM2e | cloud.google.com/tpu/docs/v5p ("95 GiB HBM2e" per chip; we use the smaller 95e9) |
| h100_16 | 16 (2 nodes × 8) | 80 GB HBM3 | NVIDIA H100 SXM datasheet |
| gb200_16 | 16 (4 trays × 4) | 186 GB HBM3e | NVIDIA GB200 NVL72 spec: 13.4 TB HBM3e / 72 GPUs = 186 GB |
| gb200_32, h100_64 | 32, 64 | as above | larger targets for Scout |

Peak dense bf16 FLOP/s per device (the plan tool's step-time estimate): TPU v5p 459e12
(cloud.google.com/tpu/docs/v5p), H100 SXM 989e12 (NVIDIA H100 datasheet, dense), GB200 2.5e15
(NVIDIA GB200 NVL72 spec: 180 PFLOPS dense FP16/BF16 / 72 GPUs).

`usable_bytes` is what a JAX process may really use: 90 % of HBM on GPUs (run with
XLA_PYTHON_CLIENT_MEM_FRACTION=0.9; the default is 0.75) and 95 % on TPU (runtime reservations).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import ml_collections
import numpy as np

GB = 10 ** 9


@dataclasses.dataclass(frozen=True)
class Topology:
  """A learner's hardware: `num_devices` accelerators with `hbm_bytes` each."""
  name: str
  platform: str          # tpu | gpu
  num_devices: int
  hbm_bytes: int
  usable_fraction: float
  source: str
  peak_flops: float = 0.0  # dense bf16 FLOP/s per device (vendor figure, no sparsity)

  @property
  def usable_bytes(self) -> int:
    return int(self.hbm_bytes * self.usable_fraction)


@dataclasses.dataclass(frozen=True)
class Accelerator:
  """One accelerator family: a launch target. `prefix` names its topologies
  (`{prefix}_{devices}`); `kind` is tpu | gpu; `cluster`: what a cluster needs to know of one
  host (pod) of it (launch/spec.py PLATFORMS: chips_per_host, the Kubernetes resource, the
  XManager resource, GKE node selector, TPU slice topologies by chip count, machine type, pod
  cpu / memory, arch)."""
  name: str
  kind: str
  prefix: str
  hbm_bytes: int
  usable_fraction: float
  peak_flops: float
  source: str
  sizes: tuple[int, ...]    # learner device counts with a named topology
  cluster: Mapping[str, Any] = dataclasses.field(default_factory=dict)


#: The accelerator families, one entry each: a new launch target is one entry here (each model
#: config's LAYOUTS then lays the model out on its topologies).
ACCELERATORS: dict[str, Accelerator] = {
    a.name: a for a in (
        Accelerator("tpu-v5p", "tpu", "tpu_v5p", 95 * GB, 0.95, 459e12,
                    "cloud.google.com/tpu/docs/v5p: 95 GB HBM2e/chip", (16, 64), dict(
                        chips_per_host=4, resource="google.com/tpu", xm_resource="tpu_v5p",
                        node_selector={"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice"},
                        topology={4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
                        machine_type="ct5p-hightpu-4t", cpu="200", memory="400Gi", arch="amd64")),
        Accelerator("gpu-h100", "gpu", "h100", 80 * GB, 0.90, 989e12,
                    "NVIDIA H100 SXM5 datasheet: 80 GB HBM3", (16, 64), dict(
                        chips_per_host=8, resource="nvidia.com/gpu", xm_resource="h100",
                        node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                        machine_type="a3-highgpu-8g", cpu="200", memory="1600Gi", arch="amd64")),
        # Larger targets (gb200_32, h100_64), for models that do not fit the 16-device ones.
        Accelerator("gpu-gb200", "gpu", "gb200", 186 * GB, 0.90, 2.5e15,
                    "NVIDIA GB200 NVL72 spec: 13.4 TB HBM3e / 72 GPUs = 186 GB/GPU", (16, 32), dict(
                        chips_per_host=4, resource="nvidia.com/gpu", xm_resource="gb200",
                        node_selector={"cloud.google.com/gke-accelerator": "nvidia-gb200"},
                        machine_type="a4x-highgpu-4g", cpu="128", memory="800Gi", arch="arm64")),
    )
}

TOPOLOGIES: dict[str, Topology] = {
    f"{a.prefix}_{n}": Topology(f"{a.prefix}_{n}", a.kind, n, a.hbm_bytes, a.usable_fraction,
                                a.source, a.peak_flops)
    for a in ACCELERATORS.values() for n in a.sizes
}


def accelerator_of(topology: str) -> Accelerator | None:
  """The accelerator family a topology name runs on (gb200_16 -> gpu-gb200), or None."""
  prefix = topology.rsplit("_", 1)[0]
  return next((a for a in ACCELERATORS.values() if a.prefix == prefix), None)


# Sequence (context) parallelism through the rules table: micro-batch rows over `data` only and
# the sequence dimension of activations (q/k/v, MLP, residual, logits) over `fsdp`, so each fsdp
# shard holds T/fsdp query positions of ONE sequence (GSPMD gathers k/v for the scores).
SEQUENCE_PARALLEL = {"batch": "data", "seq": ("fsdp", "expert"), "act_seq": ("fsdp", "expert")}
# Data-parallel layouts shard the residual stream's sequence over `tensor` between layers (Megatron
# sequence parallelism): the saved layer inputs of full remat shrink `tensor`-fold.
DATA_PARALLEL = {"batch": ("data", "fsdp", "expert"), "seq": None, "act_seq": "tensor"}


def batch_split(config) -> int:
  """How many ways the rules split micro-batch rows (product of the `batch` mesh axes)."""
  mesh = dict(config.mesh.shape)
  for name, axes in config.mesh.rules:
    if name == "batch":
      axes = axes if isinstance(axes, (tuple, list)) else (axes,)
      n = 1
      for a in axes:
        if a is not None:
          n *= int(mesh[a])
      return n
  return 1


def get_topology(name: str) -> Topology:
  """The Topology called `name`; ValueError listing the known names otherwise."""
  if name not in TOPOLOGIES:
    raise ValueError(f"unknown topology {name!r}; known: {sorted(TOPOLOGIES)}")
  return TOPOLOGIES[name]


def mesh_size(shape) -> int:
  """Number of devices a fully specified mesh shape ((axis, size), ...) needs."""
  n = 1
  for _, s in shape:
    if int(s) < 1:
      raise ValueError(f"layout mesh shapes must be fully specified (no -1): {shape}")
    n *= int(s)
  return n


def layout_topology(name: str, layout: Mapping[str, Any]) -> str:
  """The topology a layout runs on: its `topology` field, else its own name."""
  return str(layout.get("topology") or name)


def check_layout(name: str, layout: Mapping[str, Any]) -> None:
  """A layout must name a known topology and use exactly its device count."""
  topo = get_topology(layout_topology(name, layout))
  n = mesh_size(layout["mesh"])
  if n != topo.num_devices:
    raise ValueError(f"layout {name!r}: mesh {tuple(layout['mesh'])} uses {n} devices, "
                     f"topology has {topo.num_devices}")


def apply_layout(config, name: str | None = None):
  """Sets config.mesh.shape / optim.microbatches / model.{remat,scan_layers,moe_capacity_factor if
  the layout names one} (and the batch / seq rules for sequence-parallel layouts) from
  `config.layouts[name or config.topology]`; config.topology becomes the layout's topology,
  config.layout its name. Returns config (modified in place)."""
  name = name or config.topology
  layouts = config.layouts
  if name not in layouts:
    raise ValueError(f"config has no layout for topology {name!r}; has {sorted(layouts)}")
  layout = layouts[name]
  check_layout(name, layout)
  config.topology = layout_topology(name, layout)
  config.layout = name
  config.mesh.shape = tuple((str(a), int(s)) for a, s in layout["mesh"])
  config.optim.microbatches = int(layout["microbatches"])
  config.model.remat = str(layout["remat"])
  config.model.scan_layers = bool(layout["scan_layers"])
  if "moe_capacity_factor" in layout:
    config.model.moe_capacity_factor = float(layout["moe_capacity_factor"])
  sp = bool(layout.get("sequence_parallel", False))
  over = SEQUENCE_PARALLEL if sp else DATA_PARALLEL
  config.mesh.rules = tuple((k, over.get(k, v)) for k, v in config.mesh.rules)
  return config


def layouts_to_config(layouts: Mapping[str, Mapping[str, Any]]):
  """`LAYOUTS` dict -> ml_collections.ConfigDict (validated) for `config.layouts`."""
  out = ml_collections.ConfigDict()
  for name, layout in layouts.items():
    check_layout(name, layout)
    out[name] = ml_collections.ConfigDict(dict(
        mesh=tuple(tuple(x) for x in layout["mesh"]), microbatches=int(layout["microbatches"]),
        remat=str(layout["remat"]), scan_layers=bool(layout["scan_layers"]),
        sequence_parallel=bool(layout.get("sequence_parallel", False)),
        topology=layout_topology(name, layout), note=str(layout.get("note", ""))))
    if "moe_capacity_factor" in layout:
      out[name].moe_capacity_factor = float(layout["moe_capacity_factor"])
  return out


def rows_per_microbatch(config) -> int:
  """Sequences per micro-batch = train batch / microbatches."""
  r = config.rollout
  batch = r.batch_size or r.prompts_per_step * r.generations_per_prompt
  m = int(config.optim.microbatches)
  if batch % m:
    raise ValueError(f"train batch {batch} not divisible by microbatches {m}")
  return batch // m


def batch_axes_of(rules) -> tuple:
  """The mesh axes the `batch` rule splits micro-batch rows over (major first)."""
  for name, axes in rules:
    if name == "batch":
      axes = axes if isinstance(axes, (tuple, list)) else (axes,)
      return tuple(a for a in axes if a is not None)
  return ()


def process_row_spans(mesh_shape, rules, num_processes: int, rows: int) -> list[tuple[int, int]]:
  """[start, stop) of the batch rows each of `num_processes` processes feeds, from arithmetic
  alone: the mesh's devices are laid out process-major in mesh order (`sharding.make_mesh` over
  `jax.devices()`, equal devices per process), rows are split over the `batch` rule's axes.
  Raises ValueError if the devices do not divide over the processes, the rows do not split
  evenly over the batch shards, or a process's rows are not contiguous."""
  names = [str(a) for a, _ in mesh_shape]
  sizes = [int(s) for _, s in mesh_shape]
  devices = math.prod(sizes)
  if num_processes < 1 or devices % num_processes:
    raise ValueError(f"mesh {dict(zip(names, sizes))} has {devices} devices, not a multiple of "
                     f"{num_processes} processes")
  axes = batch_axes_of(rules)
  shards = math.prod(sizes[names.index(a)] for a in axes)
  if rows % shards:
    raise ValueError(f"{rows} rows do not split over {shards} batch shards {axes}")
  per = rows // shards
  coords = np.indices(sizes).reshape(len(sizes), devices)        # device d's mesh coordinates
  shard = np.zeros(devices, np.int64)
  for a in axes:                                                 # major first, as the rules say
    shard = shard * sizes[names.index(a)] + coords[names.index(a)]
  spans = []
  for p, ids in enumerate(np.split(shard, num_processes)):
    u = np.unique(ids)
    if u[-1] - u[0] + 1 != u.size:
      raise ValueError(f"process {p}'s batch rows are not contiguous (shards {u.tolist()})")
    spans.append((int(u[0]) * per, (int(u[-1]) + 1) * per))
  return spans


def even_process_split(rows_here: int, rows: int, num_processes: int) -> bool:
  """A process feeding `rows_here` of `rows` rows is an even split over `num_processes` processes:
  the batch is cut into rows / rows_here distinct slices, each fed by the same number of processes
  (rows_here == rows: every process feeds the whole batch, a layout whose batch axes stay inside
  one process, e.g. the sequence-parallel ones)."""
  return (rows_here > 0 and rows % rows_here == 0
          and num_processes % (rows // rows_here) == 0)


def run_shape_failures(config, num_processes: int, num_devices: int) -> list[str]:
  """The learner's shape arithmetic against the processes and devices it runs on (the preflight's
  layout / batch-split / micro-batch checks, launch/preflight.py, at job start): one line each,
  naming the knob. [] when the shape fits."""
  out = []
  shape = tuple((str(a), int(s)) for a, s in config.mesh.shape)
  sizes = [s for _, s in shape]
  if all(s > 0 for s in sizes):
    if math.prod(sizes) != num_devices:
      out.append(f"mesh {dict(shape)} needs {math.prod(sizes)} devices, the job has "
                 f"{num_processes} processes x {num_devices // max(1, num_processes)} = "
                 f"{num_devices} (knob: mesh.shape / the layout)")
      return out
  elif num_devices % math.prod(s for s in sizes if s > 0):
    out.append(f"mesh {dict(shape)}: {num_devices} devices not divisible by the fixed axes "
               "(knob: mesh.shape)")
    return out
  layout = str(config.get("layout", "") or "")
  if layout and layout in config.get("layouts", {}):
    same = tuple((str(a), int(s)) for a, s in config.layouts[layout].mesh) == shape
    topo = get_topology(str(config.topology)) if same and config.get("topology") else None
    if topo is not None and topo.num_devices != num_devices:
      out.append(f"layout {layout} is for {topo.num_devices} devices, the job has "
                 f"{num_devices} (knob: the learner's --config=...:LAYOUT)")
  if not all(s > 0 for s in sizes):
    return out
  rows = int(config.rollout.batch_size or
             config.rollout.prompts_per_step * config.rollout.generations_per_prompt)
  try:
    spans = process_row_spans(shape, config.mesh.rules, num_processes, rows)
    n = spans[0][1] - spans[0][0]
    if any(b - a != n for a, b in spans) or not even_process_split(n, rows, num_processes):
      out.append(f"uneven batch split: {rows} rows over {num_processes} processes as {spans} "
                 "(knob: the layout's mesh)")
  except ValueError as e:
    out.append(f"batch split over {num_processes} processes: {e} (knob: the layout's mesh)")
  m = int(config.optim.microbatches)
  shards = batch_split(config)
  if rows % m or (rows // m) % shards:
    out.append(f"{rows} rows / {m} micro-batches do not split over {shards} batch shards "
               "(knob: optim.microbatches)")
  return out
