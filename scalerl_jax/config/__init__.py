"""The run config: the bottom layer every process reads (docs/ARCHITECTURE.md "Layers").

Every knob is declared once, as a field of a typed, frozen section (its type, its default and its
one-line comment; value checks in the section's `check()`); `RunConfig` is the whole run. Preset
files (configs/*.py) start from `base_config()` (the locked ml_collections ConfigDict of these
defaults) and override.

This package imports neither JAX nor ml_collections when it is imported (the buffer runs without
JAX, the vLLM venv has neither): `base_config` and the other ConfigDict helpers load
ml_collections on first use.

  from scalerl_jax import config
  run = config.resolve("configs/tiny.py:demo", ["--config.rollout.max_lag=4"])   # a RunConfig
  # ConfigError: one line naming the knob, the value and the allowed set
"""
from typing import TYPE_CHECKING

from scalerl_jax import lazy
from scalerl_jax.config._base import (DEFAULT_RULES, FREE_FORM, HEALTH_SIGNALS, RESUME_MODES,
                                      VERIFY_MODES, WIRE_DTYPES, ConfigError, PresetError,
                                      Section)
from scalerl_jax.config._run import (SFT, Data, Distributed, Forecast, Health, Rewards, RunConfig,
                                     Task, Wandb)
from scalerl_jax.config._sections import (RL, Audit, Buffer, Checkpoint, Eval, Generator, Learner,
                                          Mesh, Model, Optim, Rollout, Tls, Weights)
from scalerl_jax.config._derived import (INTERRUPTION_ALLOWANCE, KEY_KNOBS, delta_on,
                                         generation_seed, knob_line, max_completion_len,
                                         max_sequence_len, padded_length, train_seq_len,
                                         vllm_max_model_len, wire_dtype)
from scalerl_jax.config._recipes import RECIPES, SWITCHES, recipe_overrides

if TYPE_CHECKING:   # the names loaded on first use, for the type checker
  from scalerl_jax.config._dicts import base_config, lock, scale_out_config, task_section
  from scalerl_jax.config._resolve import (apply_overrides, apply_recipe, load_preset, locked_keys,
                                           resolve, resolve_config, split_overrides)

__getattr__, _ = lazy.exports(__name__, {
    "base_config": "_dicts", "lock": "_dicts", "task_section": "_dicts",
    "scale_out_config": "_dicts", "resolve": "_resolve", "resolve_config": "_resolve",
    "load_preset": "_resolve", "apply_overrides": "_resolve", "apply_recipe": "_resolve",
    "split_overrides": "_resolve", "locked_keys": "_resolve"})

__all__ = ["DEFAULT_RULES", "FREE_FORM", "HEALTH_SIGNALS", "RESUME_MODES", "VERIFY_MODES",
           "WIRE_DTYPES", "ConfigError", "PresetError", "Section", "RunConfig", "Model", "Mesh", "RL",
           "Optim", "Learner", "Rollout", "Generator", "Buffer", "Weights", "Tls", "Eval", "Checkpoint",
           "Audit", "Health", "Forecast", "Wandb", "SFT", "Task", "Data", "Rewards",
           "Distributed", "RECIPES", "SWITCHES", "recipe_overrides",
           "INTERRUPTION_ALLOWANCE", "KEY_KNOBS", "delta_on", "generation_seed", "knob_line",
           "max_completion_len", "max_sequence_len", "padded_length", "train_seq_len",
           "vllm_max_model_len", "wire_dtype",
           # loaded on first use (ml_collections):
           "base_config", "lock", "task_section", "scale_out_config", "resolve", "resolve_config",
           "load_preset", "apply_overrides", "apply_recipe", "split_overrides", "locked_keys"]
