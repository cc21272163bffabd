"""The allowed values that belong to libraries above this layer, looked up by name when a section
is checked (as generation/backends.py names its engines): the data kinds, templates, rewards and
mixtures (`data`), the generator backends (`backends`). Neither imports JAX (every process, the
buffer included, checks them); this package imports neither, so that it stays the bottom layer
(docs/ARCHITECTURE.md "Layers"; tests/config/test_resolve.py loads it with JAX and ml_collections
blocked). The rl section's loss / aggregation / correction checks need rl/, which loads JAX: they
run in `recipes.validate` (main, at resolve time) and the learner."""
from __future__ import annotations

import importlib
from types import ModuleType

OWNERS = {"data": "scalerl_jax.data",
          "backends": "scalerl_jax.generation.backends"}


def owner(name: str) -> ModuleType:
  """The library module that owns the allowed values `name` (one of OWNERS), imported now."""
  return importlib.import_module(OWNERS[name])
