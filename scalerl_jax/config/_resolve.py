"""The one resolver: a preset and overrides in, the checked run config out.

  run = config.resolve("configs/tiny.py:demo", ["--config.rollout.max_lag=4",
                                                "--config.recipe=scalerl+tis"])

A preset is a config file `configs/X.py[:ARG]` (its `get_config(ARG)`) or a saved run file (the
WORKDIR/config.json `main` writes, or launch's rendered run config): a saved run file is already
resolved, so its recipe is not applied again. Overrides are `--config.a.b=value` strings (the value
read as the knob's type); `--config.recipe=NAME[+SWITCH...]` picks a recipe, a named override set
(`_recipes.py`) that explicit overrides win over; `--config.topology=NAME` re-applies that
hardware target's layout. Every process resolves the same way (main, the buffer, generator workers,
the learner, the prompt export, launch's render and preflight, compare): an unknown knob, a wrong
type, a value outside its set or contradictory settings stop each of them with the same one line.
"""
from __future__ import annotations

import ast
import difflib
import importlib.util
import json
import os

import ml_collections

from scalerl_jax import topologies
from scalerl_jax.config._base import ConfigError, PresetError
from scalerl_jax.config._dicts import base_config, lock
from scalerl_jax.config._recipes import recipe_overrides
from scalerl_jax.config._run import RunConfig

PREFIX = "--config."


def split_overrides(argv) -> tuple[list[str], list[str]]:
  """(other args, `--config.a.b=value` overrides) of a process's command line."""
  rest, over = [], []
  for a in argv:
    (over if a.startswith(PREFIX) else rest).append(a)
  return rest, over


def locked_keys(argv) -> frozenset[str]:
  """Config keys set explicitly (`--config.a.b=...`): they win over recipes."""
  return frozenset(a.split("=")[0][len(PREFIX):] for a in argv if a.startswith(PREFIX))


def load_preset(preset: str) -> tuple[ml_collections.ConfigDict, bool]:
  """(the ConfigDict of `preset`, whether it is a saved run file): `FILE.py[:ARG]` runs the file's
  `get_config(ARG)`; any other path is read as a saved run file (JSON)."""
  file, _, arg = preset.partition(":") if ".py:" in preset else (preset, "", "")
  if not os.path.isfile(file):
    raise PresetError(f"cannot load --config={preset}: no such file {file!r} (a configs/X.py[:ARG] "
                      f"preset or a saved run file WORKDIR/config.json)")
  if file.endswith(".py"):
    spec = importlib.util.spec_from_file_location("scalerl_run_config", file)
    assert spec is not None and spec.loader is not None    # a .py file: the source loader
    mod = importlib.util.module_from_spec(spec)
    try:
      spec.loader.exec_module(mod)
      return (mod.get_config(arg) if arg else mod.get_config()), False
    except ConfigError:
      raise
    except Exception as e:   # the preset file's own error (a bad ARG, a syntax error): one line
      last = [l.strip() for l in str(e).splitlines() if l.strip()][-1:] or [type(e).__name__]
      raise PresetError(f"cannot load --config={preset}: {last[0]}") from None
  try:
    with open(file) as f:
      d = json.load(f)
  except ValueError as e:
    raise PresetError(f"run file {file}: not JSON ({e})") from None
  d.pop("_meta", None)
  return lock(ml_collections.ConfigDict(_tuplify(d))), True


def _tuplify(x):
  if isinstance(x, dict):
    return {k: _tuplify(v) for k, v in x.items()}
  if isinstance(x, list):
    return tuple(_tuplify(v) for v in x)
  return x


def _unknown(key: str, node, field: str, o: str) -> PresetError:
  """The unknown-knob line: the key, the override, and the nearest declared name."""
  names = [k for k in node.keys()] if hasattr(node, "keys") else []
  near = difflib.get_close_matches(field, names, n=1)
  parent = key.rpartition(".")[0]
  hint = (f"; did you mean {(parent + '.' if parent else '') + near[0]!r}?" if near
          else f"; declared in {parent or 'the top level'}: {', '.join(sorted(names))}")
  return PresetError(f"unknown config field {key!r} ({o}){hint}")


def _parse(o: str, key: str, old, raw: str):
  """`raw` read as the type of the knob's current value `old` (absl's config flags' rules)."""
  try:
    if isinstance(old, bool):
      if raw.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"{key} is a bool (true/false), got {raw!r}")
      return raw.lower() in ("true", "1")
    if isinstance(old, (int, float, str)):
      return type(old)(raw)
    return ast.literal_eval(raw)
  except (ValueError, SyntaxError) as e:
    kind = type(old).__name__ if isinstance(old, (bool, int, float, str)) else "Python literal"
    raise PresetError(f"bad value in {o}: {key} expects {kind}, got {raw!r} ({e})") from None


def apply_overrides(config: ml_collections.ConfigDict, overrides) -> ml_collections.ConfigDict:
  """Sets each `--config.a.b=value` on `config` (in place). An undeclared knob, or a value that
  does not read as the knob's type, is a ConfigError naming it."""
  for o in overrides:
    key, sep, raw = o[len(PREFIX):].partition("=")
    if not o.startswith(PREFIX) or not sep:
      raise PresetError(f"bad config override {o!r}; expected --config.a.b=value")
    *path, field = key.split(".")
    node = config
    for i, p in enumerate(path):
      if p not in node or not isinstance(node[p], ml_collections.ConfigDict):
        raise _unknown(".".join(path[:i + 1]), node, p, o)
      node = node[p]
    if field not in node:
      raise _unknown(key, node, field, o)
    value = _parse(o, key, node[field], raw)
    with node.ignore_type():
      node[field] = value
  return config


def apply_recipe(config: ml_collections.ConfigDict, locked: frozenset[str] = frozenset()
                 ) -> ml_collections.ConfigDict:
  """A copy of `config` with `config.recipe`'s settings (keys in `locked` are kept). A config
  whose `recipe_applied` names its recipe (launch's rendered run config) is returned unchanged:
  applying a recipe twice would scale `rollout.prompts_per_step` again."""
  overrides = recipe_overrides(config.recipe)
  c = lock(ml_collections.ConfigDict(config.to_dict()))
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


def resolve_config(preset, overrides=()) -> ml_collections.ConfigDict:
  """The resolved run config as a locked ConfigDict (what the processes that still read a
  ConfigDict hold), checked as `resolve` checks it. `preset`: a path (see the module docstring),
  a preset's ConfigDict already loaded (not modified), or None for the declared defaults."""
  overrides = list(overrides)
  if preset is None:                   # the declared defaults (a buffer started by hand, tests)
    config, saved = base_config(), False
  elif isinstance(preset, str):
    config, saved = load_preset(preset)
  else:
    config, saved = lock(ml_collections.ConfigDict(preset.to_dict())), False
  apply_overrides(config, overrides)
  locked = locked_keys(overrides)
  if not saved:                        # a saved run file's recipe is applied already
    config = apply_recipe(config, locked)
  if "topology" in locked:             # the layout of the chosen hardware target takes effect
    topologies.apply_layout(config)
  run = RunConfig.from_config(config)
  config.rollout.prompts_per_step = run.rollout.prompts_per_step   # rollout.batch_size, resolved
  return config


def resolve(preset, overrides=()) -> RunConfig:
  """The typed, checked run config of `preset` + `overrides` (see the module docstring)."""
  return RunConfig.from_config(resolve_config(preset, overrides))
