"""Mesh construction and logical-axis -> NamedSharding via THE rules table (config.mesh.rules).

Model code names only logical axes (docs/ARCHITECTURE.md); this module maps them to the mesh axes
`data, fsdp, tensor, expert`. Typical use:

  mesh = make_mesh(config.mesh.shape)
  rules = config.mesh.rules
  params, specs = sharded_init(cfg, rng, mesh, rules)          # no full host copy
  with use_mesh(mesh, rules):
    logits = jax.jit(models.forward, static_argnums=1)(params, cfg, tokens)
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from scalerl_jax.models import transformer
from scalerl_jax.models.config import ModelConfig

MESH_AXES = ("data", "fsdp", "tensor", "expert")
LOGICAL_AXES = ("batch", "seq", "embed", "act_embed", "vocab", "act_vocab", "heads", "act_heads",
                "kv_heads", "act_kv_heads", "head_dim", "mlp", "act_mlp", "expert", "act_expert",
                "expert_embed", "expert_mlp", "layers", "norm", "cache_batch", "cache_seq", "act_seq")


def make_mesh(shape: Sequence[tuple[str, int]], devices: Sequence[Any] | None = None) -> Mesh:
  """Mesh from ((axis, size), ...); one size may be -1 meaning "all remaining devices"."""
  devices = list(devices if devices is not None else jax.devices())
  names = tuple(a for a, _ in shape)
  sizes = [int(s) for _, s in shape]
  if len(set(names)) != len(names):
    raise ValueError(f"duplicate mesh axis names in {names}")
  unknown = [s for s in sizes if s == -1]
  if len(unknown) > 1:
    raise ValueError(f"at most one mesh axis may be -1, got {shape}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes must be positive or -1, got {shape}")
  known = math.prod(s for s in sizes if s != -1)
  if unknown:
    if len(devices) % known:
      raise ValueError(f"{len(devices)} devices not divisible by the fixed mesh sizes {known}")
    sizes[sizes.index(-1)] = len(devices) // known
  if math.prod(sizes) != len(devices):
    raise ValueError(f"mesh {dict(zip(names, sizes))} needs {math.prod(sizes)} devices, "
                     f"have {len(devices)}")
  try:
    arr = mesh_utils.create_device_mesh(sizes, devices)
  except Exception:  # pylint: disable=broad-except  # odd topologies: plain reshape
    arr = np.array(devices, dtype=object).reshape(sizes)
  return Mesh(arr, names)


def _check_rules(rules) -> None:
  for name, target in rules:
    if name not in LOGICAL_AXES:
      raise ValueError(f"rules name unknown logical axis {name!r}")
    for t in (target if isinstance(target, (tuple, list)) else (target,)):
      if t is not None and t not in MESH_AXES:
        raise ValueError(f"rule {name!r} -> {target!r}: unknown mesh axis {t!r}")


def logical_sharding(specs: Any, mesh: Mesh, rules) -> Any:
  """Tree of logical PartitionSpecs (or tuples of logical names) -> tree of NamedSharding."""
  rules = tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in rules)
  _check_rules(rules)

  def one(spec):
    names = tuple(spec)                  # a PartitionSpec's or a tuple's logical names, one per dim
    # nn.spmd's: flax.linen re-exports it without `as` (not public to a type checker)
    axes = nn.spmd.logical_to_mesh_axes(names, rules)
    assert axes is not None              # None only for array_dim_names=None
    return NamedSharding(mesh, axes)
  return jax.tree.map(one, specs,
                      is_leaf=lambda x: isinstance(x, PartitionSpec) or isinstance(x, tuple))


def param_logical_specs(cfg: ModelConfig) -> Any:
  """Tree of logical PartitionSpecs of the params, via jax.eval_shape (nothing allocated)."""
  boxed = jax.eval_shape(lambda r: transformer.init_params(cfg, r, boxed=True),
                         jax.random.PRNGKey(0))
  return nn.get_partition_spec(boxed)


def abstract_params(cfg: ModelConfig) -> Any:
  """Tree of jax.ShapeDtypeStruct of the params (nothing allocated)."""
  return jax.eval_shape(lambda r: transformer.init_params(cfg, r), jax.random.PRNGKey(0))


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules) -> Any:
  """NamedSharding of every parameter under `rules`."""
  return logical_sharding(param_logical_specs(cfg), mesh, rules)


def sharded_init(cfg: ModelConfig, rng: jax.Array, mesh: Mesh, rules) -> tuple[Any, Any]:
  """Initializes params directly into their shardings (jit out_shardings; no host copy).

  Returns (params, shardings).
  """
  shardings = param_shardings(cfg, mesh, rules)

  def init(r):
    with nn.logical_axis_rules(()):  # dummy init batch: no activation constraints
      return transformer.init_params(cfg, r)
  params = jax.jit(init, out_shardings=shardings)(rng)
  return params, shardings


@contextlib.contextmanager
def use_mesh(mesh: Mesh, rules):
  """Context for running the model sharded: jax.set_mesh(mesh) + nn.logical_axis_rules(rules).
  The one way in: the legacy `with mesh:` block (deprecated since JAX 0.8.2) is not supported."""
  _check_rules(rules)
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    yield


def cache_shardings(cache: Any, mesh: Mesh, rules) -> Any:
  """NamedSharding of every KV-cache entry (models.CACHE_LOGICAL_AXES) under `rules`."""
  return {k: logical_sharding(PartitionSpec(*transformer.CACHE_LOGICAL_AXES[k]), mesh, rules)
          for k in cache}


def shard_params(params: Any, cfg: ModelConfig, mesh: Mesh, rules) -> Any:
  """Places params into their shardings. Host params (e.g. from models.load_hf; the same on every
  process): each process materialises only the slices its own devices hold (multi-host safe).
  jax.Arrays already in their sharding (models.hf_slices.load_sharded) are kept as they are; other
  fully addressable ones are treated as host params."""
  shardings = param_shardings(cfg, mesh, rules)

  def place(x, sh):
    if isinstance(x, jax.Array):
      if x.sharding.is_equivalent_to(sh, x.ndim):
        return x
      if not x.is_fully_addressable:
        raise ValueError(f"a param of shape {x.shape} is sharded as {x.sharding}, not {sh}")
    return jax.make_array_from_callback(np.shape(x), sh, lambda idx: np.asarray(x)[idx])
  return jax.tree.map(place, params, shardings)
