"""The paper's five recipes (PAPER_NOTES §4) as overrides of the ScaleRL config, plus validation.

`config.recipe` names one of RECIPES; `apply_recipe(config)` returns a copy with the recipe's
settings applied. Explicit `--config.x=y` overrides given on the command line win over the recipe
(pass their keys as `locked`). Leave-one-out ablations need no recipe: flip one switch of the
`scalerl` recipe, e.g. `--config.rl.loss=dapo`, `--config.rl.aggregation=sample`,
`--config.rl.adv_norm=prompt`, `--config.rl.zero_variance_filter=False`,
`--config.rl.no_positive_resampling=False`, `--config.rl.length_control=penalty`,
`--config.model.fp32_lm_head=False`, `--config.rollout.mode=ppo_off_policy`; rollout correction and
freshness are named SWITCHES (`--config.recipe=scalerl+token_band`).
"""
from __future__ import annotations

import ast
import os

import ml_collections

from configs import common
from configs.common import WIRE_DTYPES as WIRE_DTYPES   # re-exported (weights.wire_dtype values)
from configs.common import ConfigError as ConfigError   # re-exported: callers catch recipes.ConfigError
from configs.common import RunConfig
from scalerl_jax import storage
from scalerl_jax.generation import backends
from scalerl_jax.models import attention
from scalerl_jax.protocol.rpc import TLS


# Batch 80 x 16 (Qwen2.5 / MiniMax) relative to ScaleRL's 48 x 16.
_BIG_BATCH = 80 / 48

# Sources (issue #28): "P §n" = /work/shared/PAPER_NOTES.md section n (the ScaleRL paper, arXiv
# 2510.13786: §4 "Recipes compared" lists each recipe; §3 defines the switches). Where the ScaleRL
# paper is silent the recipe's own paper is cited; a value neither gives is marked "our choice"
# with the reason. Keys a recipe does not set keep base_config's (ScaleRL's) value, e.g.
# rollout.max_lag = 8 (the "-8" of PPO-off-policy-8, P §4), generations_per_prompt = 16 (P §4),
# optimizer and length budgets (P §4: shared by every recipe compared). tests/test_recipes.py
# checks every resolved value below.
RECIPES = {
    "scalerl": {},   # base_config is ScaleRL (P §3, §4)
    "deepseek_grpo": {
        "rl.loss": "ppo",                   # GRPO's clipped surrogate (P §4 "GRPO")
        "rl.clip_eps_low": 0.2,             # P §4 "ε 0.2/0.2"
        "rl.clip_eps_high": 0.2,            # P §4
        "rl.aggregation": "sample",         # P §4 "sample avg" (P §3: sample-level = GRPO)
        "rl.adv_norm": "prompt",            # P §3: per-prompt std "as in GRPO"
        "rl.zero_variance_filter": False,   # our choice: GRPO (DeepSeekMath, arXiv 2402.03300)
                                            # keeps every group; P lists filtering only for
                                            # Qwen2.5 and ScaleRL
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3), not GRPO's
        "model.fp32_lm_head": False,        # P §4 names the FP32 head only for MiniMax/ScaleRL
        "rollout.mode": "ppo_off_policy"},  # P §4 "PPO-off-policy-8" (k = max_lag = 8)
    "qwen_dapo": {
        "rl.loss": "dapo",                  # P §4 "DAPO"
        "rl.clip_eps_low": 0.2,             # P §4 "ε 0.2/0.26"
        "rl.clip_eps_high": 0.26,           # P §4
        "rl.aggregation": "prompt",         # P §4 "prompt avg"
        "rl.adv_norm": "prompt",            # DAPO (arXiv 2503.14476) keeps GRPO's group
                                            # (r - mean) / std advantage (P §3 "per-prompt std")
        "rl.zero_variance_filter": True,    # P §4 "zero-variance dropped"
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3)
        "model.fp32_lm_head": False,        # P §4 (FP32 head: MiniMax/ScaleRL only)
        "rollout.mode": "ppo_off_policy",   # P §4 "PPO-off-policy-8"
        "rollout.prompts_per_step": _BIG_BATCH},   # P §4 "80×16 batch"
    "magistral": {
        "rl.loss": "dapo",                  # P §4 "DAPO"
        "rl.clip_eps_low": 0.2,             # Magistral (arXiv 2506.10910) §2.1: clip-higher with
        "rl.clip_eps_high": 0.28,           # ε_low ~0.2 and ε_high tuned in [0.26, 0.28]; we take
                                            # 0.28, the top of that range (= base_config's DAPO
                                            # ε_high), since P gives no value
        "rl.aggregation": "prompt",         # P §4 "prompt avg" (Magistral §2.1 divides by the
                                            # group's total length Σ|o_i|)
        "rl.adv_norm": "batch",             # Magistral §2.1: r - group mean, then normalised by
                                            # the minibatch's mean/std (P §3 "batch-level")
        "rl.zero_variance_filter": True,    # Magistral §2.1 "eliminating non-diverse groups"
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3)
        "model.fp32_lm_head": False,        # P §4 (FP32 head: MiniMax/ScaleRL only)
        "rollout.mode": "pipeline"},        # P §4 "PipelineRL"; k = 8 and 48×16 are our choice:
                                            # P gives neither for Magistral, so ScaleRL's
    "minimax": {
        "rl.loss": "cispo",                 # P §4 "CISPO"; ε_max = 5 is ScaleRL's (P §3: 4/5/8
                                            # equal), our choice: P gives none for MiniMax
        "rl.aggregation": "prompt",         # P §4 "prompt avg" (MiniMax-M1, arXiv 2506.13585,
                                            # §3.1: 1/Σ|o_i| over the group)
        "rl.adv_norm": "prompt",            # MiniMax-M1 §3.1: Â is GRPO's group-relative
                                            # advantage (r - mean) / std within the group
        "rl.zero_variance_filter": False,   # our choice: P lists filtering only for Qwen2.5 and
                                            # ScaleRL (zero-variance groups have Â = 0 anyway;
                                            # kept, they still count in the prompt average)
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3)
        "model.fp32_lm_head": True,         # P §4 "CISPO + FP32 head"
        "rollout.mode": "ppo_off_policy",   # P §4 "PPO-off-policy" (k = 8: our choice, as the
                                            # other PPO-off-policy recipes; P gives no k)
        "rollout.prompts_per_step": _BIG_BATCH},   # P §4 "80×16"
}


# Switches (issue #45): each is ONE named override set that composes with any recipe as
# `RECIPE+SWITCH[+SWITCH...]`, e.g. `--config.recipe=scalerl+token_band` or
# `python -m scalerl_jax.compare --recipes=scalerl,scalerl+token_band` (the leave-one-out /
# add-one-in runs of the fitted-curve comparison). Values are our choice where noted.
SWITCHES = {
    "tis": {"rl.rc_token_tis_cap": 2.0},            # token TIS, cap 2 (verl's default threshold)
    "token_band": {"rl.rc_token_mask_low": 0.5,     # IcePop's band [α, β] = [0.5, 5]
                   "rl.rc_token_mask_high": 5.0},   # (Ring-1T, arXiv 2510.18855)
    "seq_band": {"rl.rc_seq_mask_low": 0.9,         # geometric-mean sequence mask: our choice
                 "rl.rc_seq_mask_high": 1.1},       # (±10 % per-token average ratio)
    "seq_tis": {"rl.rc_seq_tis_cap": 2.0},          # sequence TIS, cap 2: our choice
    "fresh": {"rollout.max_ahead": 1},              # freshness bound: 1 batch ahead (lag <= 1)
    "r3": {"rl.routing_replay": True},              # MoE routing replay on
    "no_r3": {"rl.routing_replay": False,           # ... and off (MoE configs where it defaults
              "rl.routing_replay_auto": False},     # on: the auto switch would turn it back on)
}


def recipe_overrides(name: str) -> dict:
  """The overrides of `name` = RECIPE or RECIPE+SWITCH+...: the recipe's, then each switch's in
  order (ConfigError for an unknown part)."""
  base, *switches = name.split("+")
  if base not in RECIPES:
    raise ConfigError(f"unknown recipe {base!r}; choose one of {sorted(RECIPES)} "
                      f"(optionally +SWITCH, one of {sorted(SWITCHES)})")
  out = dict(RECIPES[base])
  for sw in switches:
    if sw not in SWITCHES:
      raise ConfigError(f"unknown switch {sw!r} in recipe {name!r}; choose from {sorted(SWITCHES)}")
    out.update(SWITCHES[sw])
  return out


def locked_keys(argv) -> frozenset[str]:
  """Config keys set explicitly on the command line (`--config.a.b=...`): they win over recipes."""
  return frozenset(a.split("=")[0][len("--config."):] for a in argv if a.startswith("--config."))


def split_overrides(argv) -> tuple[list[str], list[str]]:
  """(other args, `--config.a.b=value` overrides): how the generator worker and the prompt export
  take the same config overrides `main` takes (launch.rehearse appends them to every pod)."""
  rest, over = [], []
  for a in argv:
    (over if a.startswith("--config.") else rest).append(a)
  return rest, over


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """Sets each `--config.a.b=value` on `config` (in place), the value parsed as the field's
  current type, as absl's config flags do (bool: true/false; tuple / None: a Python literal).
  An undeclared field raises ConfigError."""
  for o in overrides:
    key, sep, raw = o[len("--config."):].partition("=")
    if not o.startswith("--config.") or not sep:
      raise ConfigError(f"bad config override {o!r}; expected --config.a.b=value")
    *path, field = key.split(".")
    node = config
    for p in path:
      if p not in node or not isinstance(node[p], ml_collections.ConfigDict):
        raise ConfigError(f"unknown config field {key!r} ({o})")
      node = node[p]
    if field not in node:
      raise ConfigError(f"unknown config field {key!r} ({o})")
    old = node[field]
    try:
      if isinstance(old, bool):
        if raw.lower() not in ("true", "false", "1", "0"):
          raise ValueError(raw)
        value = raw.lower() in ("true", "1")
      elif isinstance(old, (int, float, str)) and not isinstance(old, bool):
        value = type(old)(raw)
      else:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError) as e:
      raise ConfigError(f"bad value in {o}: {e}") from None
    with node.ignore_type():
      node[field] = value
  return config


def apply_recipe(config: ml_collections.ConfigDict, locked: frozenset[str] = frozenset()
                 ) -> ml_collections.ConfigDict:
  """Returns a copy of `config` with `config.recipe`'s settings (keys in `locked` are kept).

  A config whose `recipe_applied` names its recipe (a resolved run config: launch/gke's
  run-config ConfigMap) is returned unchanged: applying a recipe twice would undo the overrides
  it was resolved with and scale `rollout.prompts_per_step` again."""
  overrides = recipe_overrides(config.recipe)
  c = common.lock(ml_collections.ConfigDict(config.to_dict()))
  if config.recipe_applied == config.recipe:
    return c
  for key, value in overrides.items():
    if key in locked:
      continue
    section, field = key.split(".")
    if key == "rollout.prompts_per_step":
      value = max(1, round(c.rollout.prompts_per_step * value))
    c[section][field] = value
  return c


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


def validate(config: ml_collections.ConfigDict, workdir: str | None = None) -> RunConfig:
  """Fails fast, before any process starts, with one clear line per problem (the first found).

  Builds the typed run config (configs.common.RunConfig: each value's type, each section's
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


def check_data(data) -> None:
  """The data section's checks (configs.common.Data: mixture, kinds, templates, rewards)."""
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
