"""The one small interface every generator backend implements (JAX sampler, vLLM worker).

A generator turns prompts into groups of completions, stamping every generated token with the policy
version that produced it, and accepts new weights while generation is in flight.
"""
from __future__ import annotations

import abc
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from scalerl_jax import lazy
from scalerl_jax.types import Completion, PromptSpec, SamplingSpec

# JAX stays out of this module's import (vLLM client side): loaded at first use.
models = lazy.module("scalerl_jax.models")

class Generator(abc.ABC):
  """Generates groups of completions and takes weight updates in flight.

  The worker (generation/worker.py) calls exactly this surface: `generate`, the two loaders
  (`load_weights` for HF-named arrays, `load_params` for our layout: a fetched streamed version),
  `apply_pending`, `max_version`, `version` and `close`. Backends override what they can
  do faster; the defaults convert to HF names and call `load_weights`.
  """

  # Cap on the policy version applied to new tokens (PPO-off-policy leases pin one version);
  # None = the newest. The worker sets it before waiting for a lease's minimum version.
  max_version: int | None = None

  @abc.abstractmethod
  def generate(self, prompts: Sequence[PromptSpec], n: int,
               spec: SamplingSpec) -> list[list[Completion]]:
    """Returns, for each prompt, `n` completions (one group)."""

  @abc.abstractmethod
  def load_weights(self, weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                   version: int) -> None:
    """Installs new weights (HF parameter names) as policy `version`; in-flight sequences continue."""

  @property
  @abc.abstractmethod
  def version(self) -> int:
    """The policy version currently used for new tokens."""

  def close(self) -> None:  # noqa: B027 (an optional hook: by default nothing to release)
    """Releases processes and memory."""

  def load_params(self, params: Any, version: int, model_cfg: Any) -> None:
    """Installs our-layout params (a streamed version) as policy `version`.

    Default: HF names via `models.hf_named_arrays`, then `load_weights`."""
    self.load_weights(models.hf_named_arrays(model_cfg, params), version)

  def apply_pending(self) -> None:  # noqa: B027 (an optional hook: by default nothing queued)
    """Applies a queued weight update now if the backend queues them (default: nothing queued)."""


class Engine:
  """How a generator worker runs one backend (generation/backends.py registers them by name):
  built once per worker process with the typed run config (scalerl_jax.config.RunConfig: its
  generator, rollout, rl, model sections). The worker calls only this surface.

  `separate_eval`: an evaluation of a pinned version samples in a second generator
  (`eval_generator`) and the training generator keeps its state; False: the one engine switches to
  the pinned version (the worker lets its samples in flight finish first, then loads it)."""

  separate_eval = False
  needs_params = True      # False: `make` gets params=None (no weights are converted)
  generator_id = "gen"     # the worker's id (Worker sets it): names this engine's workdir files

  def __init__(self, config: Any):
    self.config = config

  def prepare_process(self, pinned: Sequence[int] | None) -> None:  # noqa: B027 (optional hook)
    """Runs before JAX starts in the worker process (`pinned`: the CPUs it is pinned to)."""

  @abc.abstractmethod
  def make(self, model_cfg: Any, params: Any, version: int, workdir: str, dataset: Any) -> Generator:
    """The worker's generator, on `params` (our layout) as policy `version`."""

  def eval_generator(self, model_cfg: Any, params: Any, version: int) -> Generator:
    """A second generator on `params` for one evaluation lease (`separate_eval` engines)."""
    raise NotImplementedError(f"{type(self).__name__} switches its one engine for evaluations")

  def continuous(self, gen: Generator, spec: SamplingSpec, capacity: int | None = None) -> Any:
    """The continuous decoder over `gen` (`capacity` slots, default `generator.decode_batch`;
    generation/slots.py interface), or None when this backend has none."""
    return None

  def refuses_continuous(self, gen: Generator, model_cfg: Any) -> str:
    """Why `gen` cannot decode continuously ("" when it can)."""
    return "" if type(self).continuous is not Engine.continuous else "no continuous decoder"


  def devices(self) -> int:
    """Devices one generator of this backend holds (its evaluation device-seconds)."""
    return 1

  def drain_chunk(self) -> int:
    """Decode steps per chunk of the drain loop (its occupancy booking; 1 = per token)."""
    return 1
