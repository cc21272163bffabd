"""Generator backends by name: the one place a generator worker's engine is chosen.

`generator.backend` (or a worker's `--backend`) names a registered `Backend`. An entry holds the
facts the config checks read without importing the engine (`recipes.validate`: does it record MoE
routes for routing replay, does a local generator start from `generator.vllm_model_dir`), and the
engine class as "module:Class", imported only by a worker that runs it. The worker never names a
backend: it asks the engine (generation/generator.py `Engine`) to build its generator, its
evaluation sampler and its continuous decoder.

A new backend: its engine module (a `generator.Engine` subclass) and one `register(Backend(...))`
line below. This module imports only the project's `registry` helper (recipes reads it; no cycle,
no JAX).
"""
from __future__ import annotations

import dataclasses
import importlib

from scalerl_jax.registry import Registry


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
  # "module:function" -> (bool, why not): whether its engines can record routes, asked at start
  # (recipes.validate) when that depends on the engine installed (vLLM: Model Runner V2).
  routes_probe: str = ""
  # The health.parity_gate value that turns the learner's log-prob parity gate on for this
  # backend (besides "always"): an engine whose numerics differ from the learner's names itself.
  parity_gate: str = ""
  # "module:function(config, workdir) -> None": the pod self-test's check of this backend's
  # engine (scalerl_jax/selftest.py), raising with one line when it cannot start; "" = none.
  selftest: str = ""


def records_routes(name: str) -> tuple[bool, str]:
  """(do backend `name`'s generators record MoE routes, why not): its static answer, else its
  probe's (imported and run now: may be slow, call at start-up only)."""
  b = get(name)
  if b.records_routes:
    return True, ""
  if not b.routes_probe:
    return False, f"the {name} generators do not record routed experts"
  module, _, fn = b.routes_probe.partition(":")
  return getattr(importlib.import_module(module), fn)()


BACKENDS: Registry[Backend] = Registry("generator backend")
names = BACKENDS.names     # the registered backend names, sorted
get = BACKENDS.get         # the entry of a backend; ValueError naming the registered ones


def register(backend: Backend) -> Backend:
  """Adds `backend` under its name (a name registered twice is an error)."""
  return BACKENDS.register(backend.name)(backend)


def parity_gate_on(mode: str, name: str) -> bool:
  """Whether the learner's parity gate runs: health.parity_gate `mode` is "always", or the mode
  backend `name` registered as its own (e.g. the vLLM entry's)."""
  return mode == "always" or (mode not in ("", "off") and get(name).parity_gate == mode)


def engine_class(name: str) -> type:
  """The engine class of backend `name` (its module is imported now)."""
  module, _, cls = get(name).engine.partition(":")
  return getattr(importlib.import_module(module), cls)


register(Backend("vllm", "scalerl_jax.generation.vllm.engine:VLLMEngine", local_checkpoint=True,
                 about="vLLM engines (own venv), one request per sample",
                 routes_probe="scalerl_jax.generation.vllm.generator:routes_capability",
                 parity_gate="vllm", selftest="scalerl_jax.selftest:check_vllm_backend"))
register(Backend("jax", "scalerl_jax.generation.jax_engine:JaxEngine", records_routes=True,
                 about="the embedded JAX sampler and its continuous decoder"))
register(Backend("scripted", "scalerl_jax.generation.fake:ScriptedEngine",
                 about="a scripted stand-in instruct model (tests and demos; no weights)"))
