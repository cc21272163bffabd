"""The one resolver (scalerl_jax/config/_resolve.py, issue #47): no other place assembles a run
config (a grep of the source tree that fails on a planted one), and bad input is one line naming
the knob, the value and the allowed set, in main and in every child process given a bad run file.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from scalerl_jax import config

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ("scalerl_jax", "launch", "analysis", "harness", "bench")
# Where a run config may be assembled: the config layer (the resolver) and the presets.
RESOLVER = ("scalerl_jax/config/", "configs/")
# Calls that assemble a run config: a preset's get_config called by hand, the defaults, overrides
# or a recipe applied outside the resolver, a typed RunConfig built from a ConfigDict. (The
# resolver's own loader, `config.load_preset`, may be called: launch's render reads a preset with
# it and hands it to `resolve_config`.)
ASSEMBLY = {"get_config", "base_config", "scale_out_config", "apply_overrides", "apply_recipe"}
# Sites that type a ConfigDict the resolver returned (not assembling one), each with why.
TYPED_FROM_RESOLVED = {
    # job.run's `config` is what main / compare / a bench resolved (resolve_config)
    "scalerl_jax/training/job.py",
    # validate(config): the machine checks of a resolved ConfigDict; resolve_routing_replay
    # writes rl.routing_replay back into it and retypes it
    "scalerl_jax/recipes.py",
}


def assembly_calls(rel: str, source: str) -> list[str]:
  """`rel:line: name(` for each call in `source` that assembles a run config outside the
  resolver (ASSEMBLY names; `RunConfig.from_config` outside TYPED_FROM_RESOLVED)."""
  out = []
  for node in ast.walk(ast.parse(source)):
    if not isinstance(node, ast.Call):
      continue
    f = node.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    if name in ASSEMBLY:
      out.append(f"{rel}:{node.lineno}: {name}(")
    elif (name == "from_config" and isinstance(f, ast.Attribute)
          and isinstance(f.value, (ast.Name, ast.Attribute))
          and (f.value.attr if isinstance(f.value, ast.Attribute) else f.value.id) == "RunConfig"
          and rel not in TYPED_FROM_RESOLVED):
      out.append(f"{rel}:{node.lineno}: RunConfig.from_config(")
  return out


def all_assembly_calls() -> list[str]:
  found = []
  for pkg in SOURCE:
    for p in sorted((ROOT / pkg).rglob("*.py")):
      rel = p.relative_to(ROOT).as_posix()
      if not rel.startswith(RESOLVER):
        found += assembly_calls(rel, p.read_text())
  return found


def test_no_other_place_assembles_a_run_config():
  assert all_assembly_calls() == []


def test_the_grep_finds_a_planted_assembly():
  src = ("from configs import tiny\nfrom scalerl_jax import config as common\n"
         "def f():\n  c = tiny.get_config('demo')\n  common.apply_overrides(c, [])\n"
         "  return common.RunConfig.from_config(c)\n"
         "def g(run):\n  return run.rl.loss, Correction.from_config(run.rl)\n")
  assert assembly_calls("scalerl_jax/planted.py", src) == [
      "scalerl_jax/planted.py:4: get_config(", "scalerl_jax/planted.py:5: apply_overrides(",
      "scalerl_jax/planted.py:6: RunConfig.from_config("]
  assert assembly_calls("scalerl_jax/training/job.py", src)[-1:] == [
      "scalerl_jax/training/job.py:5: apply_overrides("]


# --- bad input: one line naming the knob, the value and the allowed set -------------------------
@pytest.mark.parametrize("override,line", [
    # an unknown knob: the nearest declared name
    ("--config.rollout.max_lagg=3", "unknown config field 'rollout.max_lagg' "
     "(--config.rollout.max_lagg=3); did you mean 'rollout.max_lag'?"),
    # a wrong type: the knob, the value, the type it takes
    ("--config.rollout.max_lag=eight", "bad value in --config.rollout.max_lag=eight: "
     "rollout.max_lag expects int, got 'eight'"),
    ("--config.generator.continuous=maybe", "generator.continuous is a bool (true/false), "
     "got 'maybe'"),
    # an enum value not in the set: the allowed set
    ("--config.rollout.mode=sync", "rollout.mode='sync'; expected 'pipeline' or 'ppo_off_policy'"),
    ("--config.generator.backend=tgi", "generator.backend='tgi'; expected one of ('jax', "
     "'scripted', 'vllm')"),
    ("--config.weights.wire_dtype=int8", "weights.wire_dtype='int8'; expected one of "
     "('bfloat16', 'float32')"),
    ("--config.recipe=grpo", "unknown recipe 'grpo'; choose one of"),
    # contradictory settings: routing replay on generators that cannot record routes
    ("--config.rl.routing_replay=True", "rl.routing_replay / rl.record_routes need a "
     "generator.backend that records routed experts (jax, vllm): the scripted generators do not"),
])
def test_bad_input_is_one_line_naming_knob_value_and_set(override, line):
  overrides = [override]
  if "routing_replay" in override:
    overrides.append("--config.generator.backend=scripted")
  with pytest.raises(config.ConfigError) as e:
    config.resolve(str(ROOT / "configs" / "tiny.py"), overrides)
  msg = str(e.value)
  assert "\n" not in msg and line in msg, msg


def test_routing_replay_on_a_dense_model_is_refused_at_start(tmp_path):
  """Contradictory settings across sections: R3 on a dense model (tiny: no routed experts) is one
  line at start (main and compare: recipes.resolve_routing_replay), naming the knob and the set."""
  from scalerl_jax import recipes
  c = config.resolve_config(str(ROOT / "configs" / "tiny.py"), ["--config.rl.routing_replay=True"])
  with pytest.raises(config.ConfigError) as e:
    recipes.resolve_routing_replay(c, recipes.validate(c, str(tmp_path / "w")))
  assert str(e.value) == ("rl.routing_replay=True on a dense model (model.preset='tiny_llama3' "
                          "has no routed experts): routing replay needs an MoE model; allowed "
                          "here: False")


def test_a_saved_run_file_resolves_to_the_same_config(tmp_path):
  c = config.resolve_config(str(ROOT / "configs" / "tiny.py"), ["--config.recipe=qwen_dapo"])
  path = tmp_path / "config.json"
  path.write_text(json.dumps({**c.to_dict(), "_meta": {"argv": []}}))
  again = config.resolve(str(path))            # a saved run file: the recipe is not applied again
  assert again == config.RunConfig.from_config(c)
  assert again.rollout.prompts_per_step == round(8 * 80 / 48)
  assert config.resolve(str(path), ["--config.rollout.max_lag=2"]).rollout.max_lag == 2


def test_config_layer_imports_without_jax_and_ml_collections():
  code = ("import sys\n"
          "class Block:\n"
          "  def find_spec(self, name, path=None, target=None):\n"
          "    if name.split('.')[0] in ('jax', 'jaxlib', 'flax', 'optax', 'ml_collections'):\n"
          "      raise ImportError(name + ' is blocked')\n"
          "sys.meta_path.insert(0, Block())\n"
          "from scalerl_jax import config\n"
          "run = config.RunConfig()\n"
          "print(run.buffer.lease_ttl_s, sorted(k for k in sys.modules if k.startswith('scalerl_jax.config')))\n")
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.startswith("120.0 ") and "_dicts" not in r.stdout and "_resolve" not in r.stdout


def test_every_process_given_a_bad_run_file_stops_with_the_same_line(tmp_path):
  """main, the buffer, a generator worker and the prompt export each resolve the run file with the
  same checks: a value outside its set is the same one line in each, before any work."""
  run = config.resolve_config(str(ROOT / "configs" / "tiny.py")).to_dict()
  run["rollout"]["mode"] = "sync"
  bad = tmp_path / "config.json"
  bad.write_text(json.dumps({**run, "_meta": {"argv": []}}))
  line = "config error: rollout.mode='sync'; expected 'pipeline' or 'ppo_off_policy'"
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt_id": 0, "tokens": [1, 2], "answer": "x"}) + "\n")
  commands = {
      "main": ["scalerl_jax.main", f"--config={bad}", f"--workdir={tmp_path / 'w'}"],
      "buffer": ["scalerl_jax.buffer.server", f"--run-config={bad}", f"--prompts={prompts}"],
      "generator": ["scalerl_jax.generation.worker", f"--run_config={bad}", "--buffer=127.0.0.1:1"],
      "export": ["scalerl_jax.data.export", f"--config={bad}", f"--out={tmp_path / 'p.jsonl'}"],
  }
  env = {**os.environ, "PYTHONPATH": str(ROOT), "SCALERL_BUFFER_TOKEN": "t"}
  procs = {k: subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
           for k, argv in commands.items()}
  for who, p in procs.items():
    _, err = p.communicate(timeout=180)
    lines = [l for l in err.splitlines() if l.startswith("config error")]
    assert p.returncode == 1 and lines == [line], (who, err[-2000:])
  assert not (tmp_path / "w").exists() and not (tmp_path / "p.jsonl").exists()
