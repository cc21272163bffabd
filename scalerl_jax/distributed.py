"""Multi-host (multi-process) JAX: initialization, per-host batch feeding, per-host metrics.

One JAX process per host; all processes run the same program (SPMD, multi-controller). Typical
learner use on every host:

  from scalerl_jax import distributed
  distributed.initialize(config)                 # no-op for a single process
  mesh = sharding.make_mesh(config.mesh.shape)   # over jax.devices(): ALL hosts' devices
  params, shardings = sharding.sharded_init(cfg, rng, mesh, rules)
  learner = distributed.MultiHostLearner.for_run(apply_fn, params, run, mesh=mesh,
                                         params_sharding=shardings, vocab_size=cfg.vocab_size)
  rows = learner.local_rows()                    # slice of the global batch THIS host feeds
  metrics = learner.step({k: v[rows] for k, v in global_batch.items()})   # or a loader's shard
  if distributed.is_main_process(): write(metrics)

Settings come from `config.distributed` (coordinator_address, num_processes, process_id,
cpu_collectives) or, when a field is unset, from the environment: SCALERL_COORDINATOR,
SCALERL_NUM_PROCESSES, SCALERL_PROCESS_ID (launchers set these; on Cloud TPU / SLURM
jax.distributed.initialize() with no arguments auto-detects, use `auto=True`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import traceback
from typing import Any, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from orbax.checkpoint import multihost

from scalerl_jax import hosts
from scalerl_jax import topologies
from scalerl_jax.learner import Learner
from scalerl_jax.learner.batch import validate_batch

ENV_COORDINATOR = "SCALERL_COORDINATOR"
ENV_NUM_PROCESSES = "SCALERL_NUM_PROCESSES"
ENV_PROCESS_ID = "SCALERL_PROCESS_ID"


@dataclasses.dataclass(frozen=True)
class DistributedSpec:
  """Where the coordinator is and who we are. num_processes == 1 means "not distributed"."""
  coordinator_address: str = ""
  num_processes: int = 1
  process_id: int = 0
  cpu_collectives: str = "gloo"     # CPU cross-process collectives (tests, CPU-only clusters)
  auto: bool = False                 # let jax auto-detect (Cloud TPU, SLURM, ...)

  def __post_init__(self):
    if self.num_processes < 1:
      raise ValueError(f"num_processes must be >= 1, got {self.num_processes}")
    if not 0 <= self.process_id < self.num_processes:
      raise ValueError(f"process_id {self.process_id} not in [0, {self.num_processes})")
    if self.num_processes > 1 and not self.auto and not self.coordinator_address:
      raise ValueError(f"{self.num_processes} processes need a coordinator address "
                       f"(config.distributed.coordinator_address or ${ENV_COORDINATOR})")

  @classmethod
  def from_config(cls, config=None, env: Mapping[str, str] | None = None) -> "DistributedSpec":
    """config.distributed fields win; unset ones (empty / None / absent) fall back to env."""
    env = os.environ if env is None else env
    section = {}
    if config is not None and "distributed" in config:
      section = dict(config.distributed)

    def pick(field, env_key, cast, default) -> Any:
      v = section.get(field)
      if v not in (None, "", -1):
        return cast(v)
      return cast(env[env_key]) if env.get(env_key) else default
    return cls(coordinator_address=pick("coordinator_address", ENV_COORDINATOR, str, ""),
               num_processes=pick("num_processes", ENV_NUM_PROCESSES, int, 1),
               process_id=pick("process_id", ENV_PROCESS_ID, int, 0),
               cpu_collectives=str(section.get("cpu_collectives") or "gloo"),
               auto=bool(section.get("auto", False)))


def initialize(config=None, env: Mapping[str, str] | None = None) -> DistributedSpec:
  """jax.distributed.initialize from config/env. Must run before any JAX computation.

  A single process (num_processes == 1, not auto) is a no-op. On CPU the cross-process collectives
  are switched to `cpu_collectives` (gloo) first; without this CPU all-reduces across processes fail.
  """
  spec = DistributedSpec.from_config(config, env)
  if spec.num_processes == 1 and not spec.auto:
    return spec
  if spec.cpu_collectives and os.environ.get("JAX_PLATFORMS", "cpu").startswith("cpu"):
    jax.config.update("jax_cpu_collectives_implementation", spec.cpu_collectives)
  if spec.auto:
    jax.distributed.initialize()
  else:
    # $SCALERL_HOSTS (scalerl_jax/hosts.py) may map the coordinator's name, and the wildcard
    # process 0's coordinator service binds (default: all interfaces) to one address.
    address = hosts.resolve(spec.coordinator_address)
    bind = None
    if hosts.resolve_host("0.0.0.0") != "0.0.0.0":
      bind = hosts.resolve(f"0.0.0.0:{hosts.split(address)[1]}")
    jax.distributed.initialize(coordinator_address=address, num_processes=spec.num_processes,
                               process_id=spec.process_id, coordinator_bind_address=bind)
  # initialize returned: every process joined (launch.rehearse reads this line)
  print(f"jax.distributed: process {spec.process_id} of {spec.num_processes} joined"
        + (f" (coordinator {spec.coordinator_address})" if not spec.auto else ""),
        file=sys.stderr, flush=True)
  return spec


def exit_on_error(spec: DistributedSpec, error: BaseException) -> None:
  """Ends this process of a multi-process job now, after a one-line error, when it failed.

  Python's normal exit runs jax.distributed's shutdown barrier (atexit), which waits up to
  `shutdown_timeout_seconds` (5 min) for every process, while the others wait for this one in a
  collective that never completes: a failed process 0 kept process 1 hanging 5 min before the
  JobSet could restart the pods. Exiting with os._exit skips that barrier; the others then fail
  at once: their next gloo collective reports the closed connection and they exit here too, or
  jax's coordination agent aborts them when process 0's coordination service goes away (a
  key-value wait). A single process, a clean exit (SystemExit 0 / None) and KeyboardInterrupt
  return (the caller re-raises)."""
  if spec.num_processes <= 1 or isinstance(error, KeyboardInterrupt):
    return
  if isinstance(error, SystemExit) and error.code in (0, None):
    return
  if not isinstance(error, SystemExit):
    traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
  reason = " ".join(str(error.code if isinstance(error, SystemExit) else
                        f"{type(error).__name__}: {error}").split())
  if len(reason) > 400:
    reason = reason[:400] + "..."
  print(f"learner process {spec.process_id} of {spec.num_processes} failed: {reason} "
        "(exiting now, without jax.distributed's shutdown barrier)", file=sys.stderr, flush=True)
  logging.shutdown()
  sys.stdout.flush()
  os._exit(error.code if isinstance(error, SystemExit) and isinstance(error.code, int) else 1)


def is_main_process() -> bool:
  """Process 0 writes metrics, checkpoints metadata and talks to the rollout buffer."""
  return jax.process_index() == 0


def process_row_slice(sharding, global_rows: int) -> slice:
  """Rows of a [global_rows, ...] batch (sharded by `sharding` on dim 0) that THIS process's
  devices hold, as one contiguous slice. Raises if the mesh interleaves processes along the batch."""
  idx = sharding.addressable_devices_indices_map((global_rows,))
  spans = sorted({(s[0].start or 0, global_rows if s[0].stop is None else s[0].stop)
                  for s in idx.values()})
  start, stop = spans[0][0], spans[-1][1]
  covered = sum(b - a for a, b in spans)
  if covered != stop - start:
    raise ValueError(f"this process's batch rows are not contiguous: {spans}; order the mesh "
                     "devices process-major along the batch axes")
  return slice(start, stop)


def host_to_global(local_batch: Mapping[str, Any], sharding, global_rows: int) -> dict:
  """{name: local numpy [rows_local, ...]} -> {name: global jax.Array [global_rows, ...]} with
  `jax.make_array_from_process_local_data` (each host contributes only its own rows)."""
  out = {}
  for k, v in local_batch.items():
    v = np.asarray(v)
    out[k] = jax.make_array_from_process_local_data(sharding, v, (global_rows,) + v.shape[1:])
  return out


def gather_to_host(tree) -> Any:
  """Every process gets the full numpy value of a (possibly multi-host sharded) pytree."""
  if jax.process_count() == 1:
    return jax.tree.map(np.asarray, jax.device_get(tree))
  return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def allgather_strings(value: str, max_bytes: int = 512) -> list[str]:
  """Every process's `value` (UTF-8, at most `max_bytes`), in process order (a collective)."""
  if jax.process_count() == 1:
    return [value]
  raw = value.encode()
  if len(raw) > max_bytes:
    raise ValueError(f"{value[:40]!r}...: more than {max_bytes} bytes")
  buf = np.zeros(max_bytes + 4, np.uint8)
  buf[:4] = np.frombuffer(np.array([len(raw)], "<u4").tobytes(), np.uint8)
  buf[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
  rows = np.asarray(multihost_utils.process_allgather(buf)).reshape(-1, max_bytes + 4)
  return [bytes(r[4:4 + int(np.frombuffer(r[:4].tobytes(), "<u4")[0])]).decode() for r in rows]


def broadcast_from_main(arrays: Mapping[str, Any] | None) -> dict[str, np.ndarray]:
  """Process 0's {name: numpy array} on every process (others pass None).

  Only the main process talks to the rollout buffer; this hands its batch to the other hosts with
  two collectives: a fixed-size header length, then one uint8 buffer holding a JSON header
  (names, dtypes, shapes) followed by every array's raw bytes. Dtypes survive exactly (bool, int64
  included: bytes are moved, never cast). A single process returns its input unchanged.
  """
  if jax.process_count() == 1:
    assert arrays is not None            # the only process is the main one
    return dict(arrays)

  if jax.process_index() == 0:
    assert arrays is not None, "the main process passes its batch"
    arrs = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
    header = json.dumps([[k, v.dtype.str, list(v.shape)] for k, v in arrs.items()]).encode()
    payload = np.frombuffer(header + b"".join(v.tobytes() for v in arrs.values()), np.uint8)
    sizes = np.array([len(header), payload.size], np.int32)
  else:
    sizes = np.zeros(2, np.int32)
  sizes = np.asarray(multihost_utils.broadcast_one_to_all(sizes))
  if jax.process_index() != 0:
    payload = np.zeros(int(sizes[1]), np.uint8)
  payload = np.asarray(multihost_utils.broadcast_one_to_all(payload)).tobytes()
  out, off = {}, int(sizes[0])
  for name, dtype, shape in json.loads(payload[:off]):
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    out[name] = np.frombuffer(payload, dt, count=n // dt.itemsize if dt.itemsize else 0,
                              offset=off).reshape(shape)
    off += n
  return out


def meet(name: str, timeout_s: float = 3600.0) -> None:
  """Every process waits here until all have arrived (the coordination service's barrier, not a
  device collective, so it has its own timeout). `name` must be the same on every process and
  new for each meeting. A single process returns at once."""
  if jax.process_count() == 1:
    return
  multihost.get_barrier_sync_fn()(key=f"scalerl/{name}", timeout_ms=int(timeout_s * 1000))


def _make_learner_class():

  class MultiHostLearner(Learner):
    """Learner whose `step` takes THIS host's rows of the batch (see `local_rows`).

    Each host validates its own rows, then the global batch is assembled with
    make_array_from_process_local_data; the step and metrics are identical on every host.
    """

    def __init__(self, *args, **kwargs):
      self._global_rows: int | None = None   # set by the first batch or set_global_rows
      super().__init__(*args, **kwargs)
      self._met = set()      # (program, argument shapes) already compiled and met on

    def run_program(self, fn, *args) -> Any:
      """The first run of each program (per argument shapes) compiles it ahead, then meets the
      other processes before running. gloo connects a program's collectives when it first runs
      and gives up after 30 s: a process that compiled much slower (a loaded host, a colder
      compilation cache) failed the faster one's first step with "Connect timeout"."""
      key = (id(fn),) + tuple((getattr(x, "shape", None), str(getattr(x, "dtype", type(x))))
                              for x in jax.tree.leaves(args))
      if key not in self._met:
        with self.mesh_context():
          fn.lower(*args).compile()
        meet(f"compiled-{len(self._met)}")
        self._met.add(key)
      return super().run_program(fn, *args)

    def global_rows(self) -> int:
      assert self._global_rows is not None, "no batch placed yet (set_global_rows)"
      return int(self._global_rows)

    def set_global_rows(self, rows: int) -> None:
      if rows % self.microbatches:
        raise ValueError(f"global batch {rows} not divisible by microbatches {self.microbatches}")
      if self.batch_sharding is None:
        raise ValueError("MultiHostLearner needs a mesh")
      self._global_rows = int(rows)
      rows_here = process_row_slice(self.batch_sharding, rows)
      if not topologies.even_process_split(rows_here.stop - rows_here.start, rows,
                                           jax.process_count()):
        raise ValueError(f"uneven batch split across {jax.process_count()} processes: {rows_here}")

    def local_rows(self, global_rows: int | None = None) -> slice:
      if global_rows is not None:
        self.set_global_rows(global_rows)
      return process_row_slice(self.batch_sharding, self.global_rows())

    def _place_rows(self, arrays: Mapping[str, Any]) -> dict:
      """Global host arrays (the same on every process): each process contributes its rows."""
      arrays = {k: np.asarray(v) for k, v in arrays.items()}
      rows = len(next(iter(arrays.values())))
      sl = process_row_slice(self.batch_sharding, rows)
      return host_to_global({k: v[sl] for k, v in arrays.items()}, self.batch_sharding, rows)

    def device_batch(self, batch: Mapping[str, Any]) -> dict:
      batch = {k: np.asarray(v) for k, v in batch.items()}
      validate_batch(batch, 1, self.vocab_size, self.route_shape)
      local = batch["tokens"].shape[0]
      if self._global_rows is None:
        self.set_global_rows(local * jax.process_count())
      want = self.local_rows()
      if local != want.stop - want.start:
        raise ValueError(f"process {jax.process_index()} fed {local} rows, expected "
                         f"{want.stop - want.start} (rows {want.start}:{want.stop})")
      return host_to_global(batch, self.batch_sharding, self.global_rows())

  return MultiHostLearner


def __getattr__(name):  # lazy: importing this module must not import jax (initialize first)
  if name == "MultiHostLearner":
    cls = _make_learner_class()
    globals()[name] = cls
    return cls
  raise AttributeError(name)
