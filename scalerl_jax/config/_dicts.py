"""The ml_collections side of the config layer: `base_config()` (the locked ConfigDict of the
sections' defaults that preset files override), `lock`, `task_section`, `scale_out_config`.
Loaded on first use of one of these names (the package's `__init__`), never by a process that
only reads a resolved run file."""
from __future__ import annotations

import dataclasses

import ml_collections

from scalerl_jax import topologies
from scalerl_jax.config._base import FREE_FORM, field_hints, is_section
from scalerl_jax.config._run import Distributed, RunConfig, Task


def _defaults(cls) -> ml_collections.ConfigDict:
  """A section class's defaults as a ConfigDict (nested sections and mappings as ConfigDicts),
  read from its fields without constructing it (no checks run, nothing imported: config files
  load without JAX)."""
  out = ml_collections.ConfigDict()
  hints = field_hints(cls)
  for f in dataclasses.fields(cls):
    if not f.metadata.get("key", True):
      continue
    if is_section(hints[f.name]):
      out[f.name] = _defaults(hints[f.name])
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = ml_collections.ConfigDict(f.default_factory())   # an empty mapping
    else:
      out[f.name] = f.default
  return out


def lock(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks `c` (in place; returned): setting an undeclared key raises, except in the FREE_FORM
  parts (ModelConfig overrides, vLLM kwargs, named tasks), whose keys RunConfig checks."""
  c.lock()
  for path in FREE_FORM:
    node = c
    for k in path.split("."):
      node = node[k] if node is not None and k in node else None
    if isinstance(node, ml_collections.ConfigDict):
      node.unlock()
  return c


def base_config() -> ml_collections.ConfigDict:
  """Paper (ScaleRL) defaults (RunConfig's fields; small configs override sizes, never
  semantics), locked: setting or reading an undeclared key raises."""
  return lock(_defaults(RunConfig))


_TASK_KEYS = tuple(f.name for f in dataclasses.fields(Task))


def task_section(kind: str, **overrides) -> ml_collections.ConfigDict:
  """One task of a mixture (config.data.tasks.NAME): the data keys of base_config (Task's fields:
  kind, path, tokenizer_path, heldout, split_seed, ...) with `overrides`; unknown keys raise."""
  for k in overrides:
    if k not in _TASK_KEYS:
      raise KeyError(f"task_section: unknown data key {k!r}; known: {_TASK_KEYS}")
  d = base_config().data
  sec = ml_collections.ConfigDict({k: d[k] for k in _TASK_KEYS})
  sec.kind = kind
  for k, v in overrides.items():
    sec[k] = v
  return sec


def scale_out_config(preset: str, layouts: dict, topology: str) -> ml_collections.ConfigDict:
  """Paper settings for a real-size model with a learner layout per hardware target
  (configs/8b.py, configs/scout.py): fp32 master weights and moments, bf16 compute."""
  c = base_config()
  c.model.preset = preset
  c.model.param_dtype = "float32"   # fp32 master weights + fp32 Adam moments
  c.model.dtype = "bfloat16"
  # Generator-side layout the plan tool compiles: bf16 weights, tensor-parallel over 8 devices,
  # a KV cache of 64 sequences x 16,384 tokens.
  c.generator.tensor_parallel = 8
  c.generator.decode_batch = 64
  c.unlock()                        # the scale-out keys (RunConfig's fields marked SCALE_OUT)
  c.distributed = _defaults(Distributed)
  c.layouts = topologies.layouts_to_config(layouts)
  c.topology = topology   # hardware target (scalerl_jax.topologies)
  c.layout = topology     # key of config.layouts applied (a layout may name its topology)
  lock(c)
  return topologies.apply_layout(c)
