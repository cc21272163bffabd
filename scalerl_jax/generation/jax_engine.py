"""The "jax" generator backend (generation/backends.py): the embedded JAX sampler
(generation/sampler.py) and its continuous decoder (generation/continuous.py)."""
from __future__ import annotations

import logging
import os
from typing import cast

from scalerl_jax import config as common
from scalerl_jax import xla_env
from scalerl_jax.generation.continuous import ContinuousDecoder
from scalerl_jax.generation.generator import Engine
from scalerl_jax.generation.sampler import JaxSampler

log = logging.getLogger("scalerl.worker")


def cpu_decode_devices(generator: common.Generator, pinned) -> int:
  """`generator.jax_devices` = N > 1 (default 1) of the generator section: the JAX sampler decodes
  data-parallel over N XLA:CPU devices (bench.sampler --devices 2 on 2 cores: ~1.2-1.3x one
  device). Sets --xla_force_host_platform_device_count before JAX starts; a generator pinned to
  one CPU (`pin_cpus`) keeps one device. Returns the device count used."""
  n = generator.jax_devices
  if n > 1 and pinned:
    log.warning("generator.jax_devices=%d ignored: this generator is pinned to CPU %s", n, pinned)
    n = 1
  if n > 1:
    os.environ["XLA_FLAGS"] = xla_env.with_device_count(os.environ.get("XLA_FLAGS"), n)
  return n


class JaxEngine(Engine):
  """JaxSampler generators (`generator.jax_devices`, `generator.chunk_steps`, route recording when
  `rl.routing_replay` or `rl.record_routes`); an evaluation samples in a second sampler on the pinned params (the
  jitted decode functions are module-level: no recompile)."""

  separate_eval = True

  def __init__(self, config: common.RunConfig):
    super().__init__(config)
    self.n_dev = config.generator.jax_devices   # decode devices (prepare_process may lower it)

  def prepare_process(self, pinned) -> None:
    self.n_dev = cpu_decode_devices(self.config.generator, pinned)

  def _sampler(self, model_cfg, params, version: int, record_routes: bool) -> JaxSampler:
    return JaxSampler(model_cfg, params, version=version,
                      chunk_steps=self.config.generator.chunk_steps,
                      devices=self.n_dev if self.n_dev > 1 else None, record_routes=record_routes)

  def make(self, model_cfg, params, version, workdir, dataset) -> JaxSampler:
    rl = self.config.rl            # routes for replay (R3) or only for router_disagree
    return self._sampler(model_cfg, params, version, rl.routing_replay or rl.record_routes)

  def eval_generator(self, model_cfg, params, version) -> JaxSampler:
    return self._sampler(model_cfg, params, version, False)   # evaluation: no routes

  def continuous(self, gen, spec, capacity=None) -> ContinuousDecoder:
    # `gen` is a JaxSampler this engine built (`make` or `eval_generator`; Engine's contract).
    return ContinuousDecoder(cast(JaxSampler, gen), capacity or self.config.generator.decode_batch, spec,
                             max_prompt_len=self.config.rollout.max_prompt_len)

  def refuses_continuous(self, gen, model_cfg) -> str:
    gen = cast(JaxSampler, gen)          # this engine's own generator (Engine's contract)
    if gen.record_routes or gen.num_devices != 1 or model_cfg.scan_layers:
      return "routing replay, several decode devices or a scanned model"
    return ""

  def devices(self) -> int:
    return self.n_dev

  def drain_chunk(self) -> int:
    return self.config.generator.chunk_steps
