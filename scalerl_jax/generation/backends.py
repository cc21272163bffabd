"""Generator backends by name: the one place a generator worker's engine is chosen.

`generator.backend` (or a worker's `--backend`) names a registered `Backend`. An entry holds the
facts the config checks read without importing the engine (`recipes.validate`: does it record MoE
routes for routing replay, does a local generator start from `generator.vllm_model_dir`), and the
engine class as "module:Class", imported only by a worker that runs it. The worker never names a
backend: it asks the engine (generation/generator.py `Engine`) to build its generator, its
evaluation sampler and its continuous decoder.

A new backend: its engine module (a `generator.Engine` subclass) and one `register(Backend(...))`
line below. This module imports nothing of the project (recipes reads it; no cycle, no JAX).
"""
from __future__ import annotations

import dataclasses
import importlib


@dataclasses.dataclass(frozen=True)
class Backend:
  """One generator backend: `engine` = "package.module:Class" (a generator.Engine subclass);
  `records_routes`: its generators can record MoE routes (routing replay, rl.routing_replay);
  `local_checkpoint`: a generator on the learner's machine may start from
  `generator.vllm_model_dir`, which validate then checks exists."""
  name: str
  engine: str
  records_routes: bool = False
  local_checkpoint: bool = False
  about: str = ""


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
  """Adds `backend` (a name registered twice is an error)."""
  if backend.name in _REGISTRY:
    raise ValueError(f"generator backend {backend.name!r} is registered twice")
  _REGISTRY[backend.name] = backend
  return backend


def names() -> tuple[str, ...]:
  """The registered backend names, in registration order."""
  return tuple(_REGISTRY)


def get(name: str) -> Backend:
  """The entry of backend `name`; an unknown name is a ValueError naming the known ones."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(f"generator.backend={name!r}; expected one of {names()}") from None


def engine_class(name: str) -> type:
  """The engine class of backend `name` (its module is imported now)."""
  module, _, cls = get(name).engine.partition(":")
  return getattr(importlib.import_module(module), cls)


register(Backend("vllm", "scalerl_jax.generation.vllm.engine:VLLMEngine", local_checkpoint=True,
                 about="vLLM engines (own venv), one request per sample"))
register(Backend("jax", "scalerl_jax.generation.jax_engine:JaxEngine", records_routes=True,
                 about="the embedded JAX sampler and its continuous decoder"))
register(Backend("scripted", "scalerl_jax.generation.fake:ScriptedEngine",
                 about="a scripted stand-in instruct model (tests and demos; no weights)"))
