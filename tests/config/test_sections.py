"""The typed, frozen config sections (scalerl_jax/config/): base_config() is built from them (each
knob declared once), the run's typed config is built back from the ConfigDict with each value's
type and each section's values checked, and the ConfigDict is locked (an undeclared key raises)."""
import dataclasses
import importlib

import ml_collections
import pytest

from scalerl_jax import config as run_config
from scalerl_jax import config as common
from configs import tiny
from scalerl_jax import recipes


def _keys(section) -> list[str]:
  return [f.name for f in dataclasses.fields(section) if f.metadata.get("key", True)]


def test_base_config_round_trips_through_the_sections():
  """Every section's fields are exactly its ConfigDict's keys with equal defaults
  of the same type; the typed config built back from base_config() equals the defaults."""
  base = common.base_config()
  run = common.RunConfig()
  assert sorted(base.keys()) == sorted(_keys(common.RunConfig))
  for f in dataclasses.fields(common.RunConfig):
    if not f.metadata.get("key", True):
      continue
    default, node = getattr(run, f.name), base[f.name]
    if isinstance(default, common.Section):
      assert sorted(node.keys()) == sorted(_keys(type(default))), f.name
      for k in _keys(type(default)):
        value = getattr(default, k)
        if isinstance(value, dict):
          assert node[k].to_dict() == value, f"{f.name}.{k}"
        else:
          assert node[k] == value and type(node[k]) is type(value), f"{f.name}.{k}"
    else:
      assert node == default and type(node) is type(default), f.name
  assert common.RunConfig.from_config(base) == run
  assert base.to_dict() == {k: v for k, v in run.to_dict().items() if k in base}
  task = common.task_section("deepcoder", heldout=5)
  assert sorted(task.keys()) == sorted(f.name for f in dataclasses.fields(common.Task))
  assert common.Task.from_config(task) == common.Task(kind="deepcoder", heldout=5)


@pytest.mark.parametrize("name,arg", [("tiny", None), ("tiny", "tailed"), ("tiny", "lengths"), ("tiny", "demo"),
                                      ("8b", None),
                                      ("scout", None), ("8b_math_code", None),
                                      ("tiny_multitask", None)])
def test_shipped_configs_build_typed_and_frozen(name, arg):
  c = run_config.apply_recipe(importlib.import_module(f"configs.{name}").get_config(arg))
  run = common.RunConfig.from_config(c)
  assert run.rl.loss == c.rl.loss and run.rollout.prompts_per_step == c.rollout.prompts_per_step
  assert run.model.arch == {k: c.model[k] for k in c.model.keys() if k not in _keys(common.Model)}
  assert run.model.to_dict() == c.model.to_dict()
  with pytest.raises(dataclasses.FrozenInstanceError):
    run.rl.loss = "ppo"                                      # type: ignore[misc]
  if "layout" in c:
    assert run.layout == c.layout and run.distributed == common.Distributed()
  if c.data.mixture:
    assert isinstance(run.data.tasks["math"], common.Task)


def test_wrong_type_is_a_config_error_naming_the_key():
  c = tiny.get_config()
  with c.rl.ignore_type():
    c.rl.loss = 3
  with pytest.raises(common.ConfigError, match=r"^rl\.loss: expected str, got int 3$"):
    common.RunConfig.from_config(c)
  with pytest.raises(recipes.ConfigError, match=r"^rl\.loss: expected str, got int 3$"):
    recipes.validate(c)
  c = tiny.get_config()
  with c.rollout.ignore_type():
    c.rollout.max_lag = "8"
  with pytest.raises(common.ConfigError, match=r"rollout\.max_lag: expected int, got str '8'"):
    common.RunConfig.from_config(c)
  c = tiny.get_config()
  with c.generator.ignore_type():
    c.generator.continuous = 1                               # not a bool
  with pytest.raises(common.ConfigError, match=r"generator\.continuous: expected bool, got int 1"):
    common.RunConfig.from_config(c)
  with pytest.raises(common.ConfigError, match=r"^rl\.loss: expected str, got int 3$"):
    common.RL(loss=3)                                        # type: ignore[arg-type]
  # An int is a float; the typed value is a float.
  c = tiny.get_config()
  with c.rl.ignore_type():
    c.rl.cispo_eps_max = 4
  run = common.RunConfig.from_config(c)
  assert run.rl.cispo_eps_max == 4.0 and isinstance(run.rl.cispo_eps_max, float)
  # A wrong-typed command-line override: one line naming the override.
  with pytest.raises(recipes.ConfigError, match=r"bad value in --config\.rl\.cispo_eps_max=abc"):
    run_config.apply_overrides(tiny.get_config(), ["--config.rl.cispo_eps_max=abc"])
  # JSON round trip (load_run_config): lists come back as tuples.
  c = tiny.get_config()
  with c.mesh.ignore_type():
    c.mesh.shape = [["data", 1], ["fsdp", -1]]
  assert common.RunConfig.from_config(c).mesh.shape == (("data", 1), ("fsdp", -1))


def test_undeclared_key_is_an_error():
  c = tiny.get_config()
  with pytest.raises(AttributeError, match="decode_bach"):
    _ = c.generator.decode_bach
  with pytest.raises(AttributeError, match="decode_bach"):
    c.generator.decode_bach = 3                              # locked: no new keys
  with pytest.raises(AttributeError):
    c.new_top_level = 1
  with pytest.raises(recipes.ConfigError, match="unknown config field 'generator.decode_bach'"):
    run_config.apply_overrides(tiny.get_config(), ["--config.generator.decode_bach=3"])
  # A recipe's copy and a loaded run config are locked too.
  assert run_config.apply_recipe(tiny.get_config()).is_locked
  # The free-form parts take new keys, checked when the typed config is built.
  c = tiny.get_config()
  c.generator.vllm_args.max_model_len = 128
  c.model.vocab_bize = 3
  common.RunConfig.from_config(c)     # ModelConfig's fields are checked where it is known:
  with pytest.raises(common.ConfigError, match=r"config.model has unknown fields \['vocab_bize'\]; "
                     r"did you mean 'vocab_size'\?"):
    recipes.validate(c)                # at resolve time in main, before any process starts
  d = ml_collections.ConfigDict(tiny.get_config().to_dict())  # an unlocked dict with a stray key
  d.rl.stray = 1
  with pytest.raises(common.ConfigError, match=r"^rl\.stray: undeclared config key"):
    common.RunConfig.from_config(d)


@pytest.mark.parametrize("key,value,match", [
    ("rollout.mode", "sync", "rollout.mode='sync'; expected 'pipeline' or 'ppo_off_policy'"),
    ("rollout.batch_size", 30, "rollout.batch_size=30 is not divisible by"),
    ("generator.backend", "tgi", "generator.backend='tgi'; expected one of"),
    ("generator.temperature", 0.0, "training rollouts need T > 0"),
    ("weights.wire_dtype", "int8", "weights.wire_dtype='int8'"),
    ("weights.port", 70000, "is not a TCP port"),
    ("eval.every_steps", 0, "eval.every_steps must be >= 1"),
    ("model.logits_chunk", 0, "model.attention_block and model.logits_chunk must be >= 1"),
    ("rl.loss", "nope", "rl: "),
    ("rl.length_control", "cut", "rl.length_control='cut'"),
    ("total_steps", 0, "total_steps must be >= 1"),
    ("optim.microbatches", 3, "is not divisible by optim.microbatches=3"),
    ("data.kind", "poetry", "data.kind='poetry'"),
    ("checkpoint.verify", "quick", "checkpoint.verify must be one of"),
    ("resume", "sometimes", "config.resume must be one of"),
])
def test_section_checks_fire_on_construction(key, value, match):
  c = tiny.get_config()
  *path, field = key.split(".")
  node = c
  for p in path:
    node = node[p]
  node[field] = value
  if key != "rl.loss":     # the loss registry is rl/'s (JAX): checked by validate, at resolve in main
    with pytest.raises(common.ConfigError, match=match):
      common.RunConfig.from_config(c)
  with pytest.raises(recipes.ConfigError, match=match):
    recipes.validate(c)


def test_batch_size_resolves_into_prompts_per_step():
  c = tiny.get_config()
  c.rollout.batch_size = 32
  assert common.RunConfig.from_config(c).rollout.prompts_per_step == 4
  run = recipes.validate(c)
  assert c.rollout.prompts_per_step == 4 and run.rollout.prompts_per_step == 4


@pytest.mark.parametrize("name", ["tiny", "8b", "scout", "tiny_multitask"])
def test_typed_to_dict_is_the_config_dicts(name):
  c = run_config.apply_recipe(importlib.import_module(f"configs.{name}").get_config())
  assert common.RunConfig.from_config(c).to_dict() == c.to_dict()


def test_sft_cache_key_is_the_same_for_the_typed_config(monkeypatch, tmp_path):
  """The shared warm-start cache is keyed on the model, sft and data sections: the typed config
  (what the job passes now) finds the entries the ConfigDict made."""
  from configs import tiny_multitask
  from scalerl_jax.training import sft
  monkeypatch.setenv("SCALERL_SFT_CACHE_DIR", str(tmp_path))
  for c in (tiny.get_config(), tiny_multitask.get_config()):
    assert sft.cache_entry(c) == sft.cache_entry(common.RunConfig.from_config(c))
