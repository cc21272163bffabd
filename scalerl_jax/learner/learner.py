"""Host-side learner: builds optimizer + state, shards and jits the step, validates batches, logs.

    learner = Learner.for_run(apply_fn, params, run, mesh=mesh, params_sharding=shardings)
    metrics = learner.step(batch)        # dict of python floats; logs a warning on skipped steps
    learner.state                        # LearnerState pytree (orbax-checkpointable)
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Mapping, Self

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax

from scalerl_jax import config as common
from scalerl_jax import sharding
from scalerl_jax.learner.batch import RLSpec
from scalerl_jax.learner.batch import validate_batch
from scalerl_jax.learner.optimizer import make_optimizer
from scalerl_jax.learner.optimizer import warmup_constant_schedule
from scalerl_jax.learner.state import LearnerState
from scalerl_jax.learner.train_step import ApplyFn
from scalerl_jax.learner.train_step import make_logprob_fn
from scalerl_jax.learner.train_step import make_train_step

log = logging.getLogger(__name__)


def batch_axes(rules) -> tuple | None:
  """Mesh axes of the logical ``batch`` axis in the rules table (e.g. ("data", "fsdp"))."""
  for name, axes in rules:
    if name == "batch":
      return axes if isinstance(axes, tuple) or axes is None else (axes,)
  return None


def state_shardings(optimizer: optax.GradientTransformation, params, params_sharding, mesh
                    ) -> LearnerState:
  """LearnerState of shardings: optimizer moments follow their parameter; the rest replicated."""
  replicated = NamedSharding(mesh, P())
  abstract_opt = jax.eval_shape(optimizer.init, params)
  opt_sharding = optax.tree_map_params(
      optimizer, lambda _, s: s, abstract_opt, params_sharding,
      transform_non_params=lambda _: replicated)
  return LearnerState(params=params_sharding, opt_state=opt_sharding, step=replicated)


def jit_train_step(step_fn, *, mesh=None, state_sharding=None, batch_sharding=None,
                   donate: bool = True) -> jax.stages.Wrapped:
  """jax.jit with donated state and, when a mesh is given, explicit in/out shardings."""
  donate_argnums = (0,) if donate else ()
  if mesh is None:
    return jax.jit(step_fn, donate_argnums=donate_argnums)
  replicated = NamedSharding(mesh, P())
  return jax.jit(step_fn, in_shardings=(state_sharding, batch_sharding),
                 out_shardings=(state_sharding, replicated), donate_argnums=donate_argnums)


class Learner:
  """Owns the LearnerState and the compiled step, built from the run's typed sections
  (scalerl_jax.config): ``rl`` (the objective), ``optim``, ``learner`` (length buckets) and ``model``
  (logits_chunk, head_precision); ``rules`` (mesh.rules) when a mesh is given. `for_run` takes
  them from a typed RunConfig.

  The Learner takes ownership of ``params``: its buffers are donated to the first step, so pass a
  copy if the caller keeps using them.
  """

  def __init__(self, apply_fn: ApplyFn, params, *, rl: common.RL, optim: common.Optim,
               learner: common.Learner, model: common.Model, temperature: float,
               rules=None, mesh=None, params_sharding=None, vocab_size: int | None = None,
               with_entropy: bool = True, donate: bool = True,
               route_shape: tuple[int, int, int] | None = None):
    """`temperature`: the generators' sampling temperature (generator.temperature): learner
    log-probs are log_softmax(logits / T). `route_shape` (R, K, E): validates batch["routes"]
    (MoE routing replay)."""
    self.spec = RLSpec.from_config(rl)
    self.temperature = float(temperature)
    self.microbatches = optim.microbatches
    self.vocab_size = vocab_size
    self.route_shape = route_shape   # (R, K, E): validates batch["routes"] (MoE routing replay)
    self.optimizer = make_optimizer(optim)
    self.lr_schedule = warmup_constant_schedule(optim.lr, optim.warmup_steps)
    self.mesh = mesh
    if mesh is not None and rules is None:
      raise ValueError("a mesh needs rules (the mesh section's logical-axis rules)")
    self.rules = tuple(rules) if mesh is not None and rules is not None else None
    partition = None
    state_sh = batch_sh = None
    if mesh is not None:
      if params_sharding is None:
        raise ValueError("a mesh needs params_sharding (e.g. from scalerl_jax.sharding)")
      partition = P(batch_axes(rules))
      batch_sh = NamedSharding(mesh, partition)
      state_sh = state_shardings(self.optimizer, params, params_sharding, mesh)
      params = jax.device_put(params, params_sharding)
    self.batch_sharding = batch_sh
    lcfg = learner                   # per-micro-batch length buckets (train_step)
    step_fn = make_train_step(apply_fn, self.optimizer, self.spec, self.microbatches,
                              lr_schedule=self.lr_schedule, with_entropy=with_entropy,
                              logits_chunk=int(model.logits_chunk),
                              batch_partition=partition, mesh=mesh, temperature=self.temperature,
                              pad_multiple=int(lcfg.pad_multiple),
                              max_buckets=int(lcfg.max_buckets),
                              head_precision=str(model.head_precision))
    create = lambda p: LearnerState.create(p, self.optimizer)
    if mesh is None:
      self.state = jax.jit(create)(params)
    else:
      with self.mesh_context():
        self.state = jax.jit(create, out_shardings=state_sh)(params)
    self._step = jit_train_step(step_fn, mesh=mesh, state_sharding=state_sh,
                                batch_sharding=batch_sh, donate=donate)
    logp = make_logprob_fn(apply_fn, int(model.logits_chunk), self.temperature,
                           str(model.head_precision))
    self._logp = (jax.jit(logp) if mesh is None or state_sh is None else jax.jit(
        logp, in_shardings=(state_sh.params, batch_sh, batch_sh),
        out_shardings=NamedSharding(mesh, P())))

  @classmethod
  def for_run(cls, apply_fn: ApplyFn, params, run: common.RunConfig, **kwargs) -> Self:
    """The learner of the typed run config `run`: its rl, optim, learner and model sections,
    mesh.rules, and (unless given) generator.temperature."""
    kwargs.setdefault("temperature", run.generator.temperature)
    return cls(apply_fn, params, rl=run.rl, optim=run.optim, learner=run.learner, model=run.model,
               rules=run.mesh.rules, **kwargs)

  def _place_rows(self, arrays: Mapping[str, Any]) -> dict:
    """Global [B, ...] host arrays (the same on every process) placed like a batch."""
    arrays = {k: np.asarray(v) for k, v in arrays.items()}
    if self.batch_sharding is None:
      return jax.device_put(arrays)
    return jax.device_put(arrays, self.batch_sharding)

  def token_logprobs(self, tokens, routes=None) -> np.ndarray:
    """The learner's log-probs of `tokens` [B,T] under the current params (float32 [B,T], 0 at
    t=0), computed like its step: sharded over the batch axes, chunked over the sequence (never
    [B,T,V] logits). Multi-host: a collective; every process passes the same global `tokens`."""
    placed = self._place_rows({"tokens": np.asarray(tokens, np.int32),
                               **({"routes": np.asarray(routes, np.int32)}
                                  if routes is not None else {})})
    out = self.run_program(self._logp, self.state.params, placed["tokens"], placed.get("routes"))
    return np.asarray(jax.device_get(out))

  def run_program(self, fn, *args) -> Any:
    """Runs one of this learner's jitted programs (the step, the log-probs) under its mesh. A
    multi-host learner first compiles it and meets the other processes (see MultiHostLearner)."""
    with self.mesh_context():
      return fn(*args)

  def mesh_context(self) -> contextlib.AbstractContextManager[None]:
    """Mesh + logical-axis rules active while tracing/running (model activation constraints)."""
    if self.mesh is None:
      return contextlib.nullcontext()
    return sharding.use_mesh(self.mesh, self.rules)

  def local_rows(self, global_rows: int | None = None) -> slice:
    """The rows of the global batch this process feeds: all of them on one process (a multi-host
    learner feeds its own slice)."""
    del global_rows
    return slice(None)

  def device_batch(self, batch: Mapping[str, Any]) -> dict:
    """Validates on the host and places the batch (sharded over the batch axes if meshed)."""
    validate_batch(batch, self.microbatches, self.vocab_size, self.route_shape)
    batch = {k: np.asarray(v) for k, v in batch.items()}
    if self.batch_sharding is not None:
      return jax.device_put(batch, self.batch_sharding)
    return jax.device_put(batch)

  def step(self, batch: Mapping[str, Any]) -> dict[str, float]:
    """One optimizer step; returns metrics as python floats. Raises ValueError on a bad batch."""
    batch = self.device_batch(batch)
    self.state, metrics = self.run_program(self._step, self.state, batch)
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if metrics["skipped"]:
      reason = "empty after zero-variance filtering" if metrics["skip_reason"] == 1 else \
          "non-finite loss / gradient / update"
      log.warning("learner step skipped (%s): params unchanged; loss=%s grad_norm=%s "
                  "dropped_groups=%d", reason, metrics["loss"], metrics["grad_norm"],
                  int(metrics["dropped_groups"]))
    return metrics
