"""The fields a generator `Worker` (generation/worker.py) sets up in its constructor and its serving
bases (`EvalLane`, `ContinuousLoop`) work on: declared once here, for the type checker."""
from __future__ import annotations

from typing import Any

from scalerl_jax import config as common
from scalerl_jax.generation.generator import Engine, Generator
from scalerl_jax.protocol.client import BufferClient


class WorkerFields:
  """Declarations only (no behaviour): the Worker's shared fields."""

  config: common.RunConfig      # the run's typed config (built once by worker.main)
  id: str
  engine: Engine
  gen: Generator
  model_cfg: Any                # models.ModelConfig
  dataset: Any                  # data.Dataset
  client: BufferClient
