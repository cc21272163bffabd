"""The machine checks of a resolved run config (`validate`: what depends on this machine, not on
the config alone) and the recipes' names, re-exported from the config layer.

The recipes themselves are named override sets in `scalerl_jax/config/_recipes.py`, applied by the
one resolver (`scalerl_jax.config.resolve`).
"""
from __future__ import annotations

import dataclasses
import difflib
import os

from scalerl_jax import config as common
from scalerl_jax.config import RECIPES as RECIPES, SWITCHES as SWITCHES   # re-exported names
from scalerl_jax.config import WIRE_DTYPES as WIRE_DTYPES   # re-exported (weights.wire_dtype values)
from scalerl_jax.config import ConfigError as ConfigError   # re-exported: callers catch recipes.ConfigError
from scalerl_jax.config import RunConfig
from scalerl_jax.config import recipe_overrides as recipe_overrides
from scalerl_jax import rl, storage
from scalerl_jax.generation import backends
from scalerl_jax.models import attention
from scalerl_jax.models import sections as model_sections
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.protocol.rpc import TLS


def vllm_model_dir(generator) -> str:
  """`generator.vllm_model_dir` ("" = export the learner's weights) of the generator section,
  checked to be an HF checkpoint directory on this machine; checked by `validate` for local
  generators and by each generator process at start (an external fleet's pods hold their own
  copy)."""
  vdir = str(generator.vllm_model_dir or "")
  if vdir and not os.path.isfile(os.path.join(vdir, "config.json")):
    raise ConfigError(f"generator.vllm_model_dir={vdir!r} is not an HF checkpoint directory on "
                      "this machine (no config.json); leave it empty to start vLLM on the "
                      "learner's weights")
  return vdir


def validate(config, workdir: str | None = None) -> RunConfig:
  """Fails fast, before any process starts, with one clear line per problem (the first found).

  Builds the typed run config (scalerl_jax.config.RunConfig: each value's type, each section's
  checks, the checks across sections), then checks what depends on this machine: the start
  checkpoint of local vLLM generators, the TLS files, the buffer token, the attention backend's
  platform, and `workdir` when given. Returns the typed config; resolves `rollout.batch_size`
  (when set) into `config.rollout.prompts_per_step` in place."""
  run = RunConfig.from_config(config)
  config.rollout.prompts_per_step = run.rollout.prompts_per_step
  if backends.get(run.generator.backend).local_checkpoint and not run.buffer.external:
    vllm_model_dir(run.generator)     # local generators: their start checkpoint is on this machine
  try:
    tls = TLS.from_config(run)
    tls.check(server=tls.enabled)    # the learner serves weights (and runs the buffer) over TLS too
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if run.buffer.external and not os.environ.get(run.buffer.auth_token_env):
    raise ConfigError(f"buffer.external=True: set ${run.buffer.auth_token_env} to the buffer "
                      f"service's auth token")
  check_attention(run.model)
  check_model_fields(run.model)
  check_objective(run.rl)
  if workdir is not None:
    check_workdir(workdir)
  return run



def check_attention(model, platform: str | None = None) -> None:
  """ConfigError when the model section's `attention_impl` is unknown or needs a platform this
  process lacks (cudnn without a GPU, splash without a TPU), instead of a wrong answer or a late
  crash.

  The platform is read without initialising a JAX backend (validate runs before
  jax.distributed.initialize): $JAX_PLATFORMS, else the installed plugins."""
  try:
    attention.check_available(model.attention_impl, platform or attention.installed_platform())
  except ValueError as e:
    raise ConfigError(f"model.{e}") from None


def check_objective(rl_section) -> None:
  """ConfigError unless the rl section's loss is registered, its aggregation and advantage
  normalization are known and its rollout-correction bounds are valid (the rl library's checks,
  which load JAX: run here, at resolve time in main, not in every process)."""
  try:
    rl.check_objective(rl_section.loss, rl_section.aggregation, rl_section.adv_norm)
    rl.Correction.from_config(rl_section)
  except ValueError as e:
    raise ConfigError(f"rl: {e}") from None


def check_model_fields(model) -> None:
  """ConfigError naming the keys set on `config.model` besides the section's own that are not
  ModelConfig fields (the config layer takes them free-form: ModelConfig is the models
  package's, which loads JAX), with the nearest field name."""
  fields = sorted(f.name for f in dataclasses.fields(ModelConfig))
  unknown = [k for k in model.arch if k not in fields]
  if unknown:
    near = difflib.get_close_matches(unknown[0], fields, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"config.model has unknown fields {unknown}{hint} (ModelConfig fields: "
                      f"{', '.join(fields)})")


def check_data(data) -> None:
  """The data section's checks (scalerl_jax.config.Data: mixture, kinds, templates, rewards)."""
  common.Data.from_config(data)


def check_workdir(workdir: str) -> None:
  """Creates `workdir` if needed and proves it is writable: a 4 KiB probe written and fsync'd, so a
  read-only or full disk fails here, at start-up, with a clear ConfigError (the one workdir probe)."""
  if not workdir:
    raise ConfigError("--workdir is required")
  if "://" in workdir and not storage.is_remote(workdir):
    raise ConfigError(f"workdir {workdir!r}: only local paths and gs://BUCKET/PATH are supported")
  if storage.is_remote(workdir):   # the same probe as one object; nothing is written locally
    try:
      storage.check_remote_writable(workdir, f".write_test.{os.uname().nodename}.{os.getpid()}")
    except storage.RemoteStorageError as e:
      raise ConfigError(f"workdir {workdir}: {e}") from None
    return
  try:
    os.makedirs(workdir, exist_ok=True)
    probe = os.path.join(workdir, f".write_test.{os.uname().nodename}.{os.getpid()}")  # per process:
    # the hosts of a multi-host learner validate the same shared workdir at the same time
    with open(probe, "wb") as f:
      f.write(b"x" * 4096)
      f.flush()
      os.fsync(f.fileno())
    os.remove(probe)
  except OSError as e:
    raise ConfigError(f"workdir {workdir!r} is not writable: {e.strerror or e}; checkpoints, "
                      "metrics and the buffer WAL go there: fix it and rerun the same command "
                      "(a run with a checkpoint there resumes from it)") from None


def resolve_routing_replay(config, run: RunConfig) -> RunConfig:
  """R3 at the start of a run whose generators run here (main and compare call it after
  recipes.validate): refused (one line) where they cannot record routes; on by default
  (rl.routing_replay_auto) for an MoE model where they can. Sets
  `config.rl.routing_replay` in place (the generators read it from config.json). A fleet (launch
  renders, buffer.external) keeps R3 as configured; its vLLM workers refuse at start where their
  engine cannot return routes. R3 set on a dense model is refused too (nothing to replay)."""
  if run.buffer.external:
    return run
  rl = run.rl
  auto = rl.routing_replay_auto and not rl.routing_replay
  if not (rl.routing_replay or auto):
    return run
  moe = model_sections.model_config(run).is_moe
  if rl.routing_replay and not moe:
    raise ConfigError(f"rl.routing_replay=True on a dense model (model.preset="
                      f"{run.model.preset!r} has no routed experts): routing replay needs an MoE "
                      f"model; allowed here: False")
  if auto and not moe:
    return run
  ok, why = backends.records_routes(run.generator.backend)
  if rl.routing_replay and not ok:
    raise ConfigError(f"rl.routing_replay=True but the {run.generator.backend} generators "
                      f"cannot record routed experts: {why} (docs/VLLM.md 'Routing replay')")
  if auto and ok:
    config.rl.routing_replay = True
    return RunConfig.from_config(config)
  return run
