"""Bad configs fail at start with one clear line, before any process is spawned."""
import os
import subprocess
import sys

import pytest

from scalerl_jax import config as run_config
from configs import tiny
from scalerl_jax import recipes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _main(tmp_path, *overrides, workdir=None):
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
         f"--workdir={workdir or tmp_path / 'w'}", *overrides]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("override, needle", [
    ("--config.recipe=nope", "unknown recipe 'nope'"),
    ("--config.rollout.max_lag=-1", "max_lag (k) must be >= 0"),
    ("--config.rollout.batch_size=60", "batch_size=60 is not divisible by"),
    ("--config.generator.backend=tpu", "generator.backend='tpu'"),
    ("--config.rl.loss=nope", "rl: "),
    ("--config.weights.serve_from=disk", "weights.serve_from='disk'"),
    ("--config.weights.port=70000", "weights.port=70000 is not a TCP port"),
])
def test_bad_config_fails_fast_with_one_line(tmp_path, override, needle):
  r = _main(tmp_path, override)
  assert r.returncode != 0
  err_lines = [l for l in r.stderr.splitlines() if l.startswith("config error:")]
  assert len(err_lines) == 1 and needle in err_lines[0], r.stderr[-2000:]
  # Nothing was spawned or written: no logs/ (children log there), no config.json.
  assert not (tmp_path / "w" / "logs").exists() and not (tmp_path / "w" / "config.json").exists()


def test_unwritable_workdir(tmp_path):
  """A workdir that cannot be created (a file sits where a directory must be) fails at start;
  permission bits are not used because CI runs as root, which ignores them."""
  blocker = tmp_path / "file"
  blocker.write_text("x")
  r = _main(tmp_path, workdir=blocker / "run")
  err = [l for l in r.stderr.splitlines() if l.startswith("config error:")]
  assert r.returncode != 0 and len(err) == 1 and "is not writable" in err[0], r.stderr[-2000:]


def test_unwritable_workdir_in_process(tmp_path):
  """Root ignores permission bits, so also check the path through a file where a dir must be."""
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(recipes.ConfigError, match="is not writable"):
    recipes.check_workdir(str(blocker / "run"))


def test_recipes_apply_paper_definitions():
  c = tiny.get_config()
  c.recipe = "qwen_dapo"
  q = run_config.apply_recipe(c)
  assert (q.rl.loss, q.rl.clip_eps_low, q.rl.clip_eps_high) == ("dapo", 0.2, 0.26)
  assert q.rollout.mode == "ppo_off_policy" and q.rl.aggregation == "prompt"
  assert q.rollout.prompts_per_step == round(c.rollout.prompts_per_step * 80 / 48)
  c.recipe = "deepseek_grpo"
  d = run_config.apply_recipe(c, locked=frozenset({"rl.aggregation"}))
  assert d.rl.loss == "ppo" and d.rl.aggregation == "prompt"   # the explicit override wins
  c.recipe = "scalerl"
  s = run_config.apply_recipe(c)
  assert (s.rl.loss, s.rl.aggregation, s.rl.adv_norm, s.rollout.mode, s.rollout.max_lag) == \
      ("cispo", "prompt", "batch", "pipeline", 8)
  assert s.rl.zero_variance_filter and s.rl.no_positive_resampling and s.model.fp32_lm_head


def test_undeclared_knob_is_a_clear_error(tmp_path):
  """A knob is declared once (scalerl_jax/config/); reading or overriding one that is not declared
  fails with its name and ml_collections' nearest declared name, never a silent default."""
  c = tiny.get_config()
  with pytest.raises(AttributeError, match='decode_bach.*Did you mean "decode_batch"'):
    _ = c.generator.decode_bach
  r = _main(tmp_path, "--config.generator.decode_bach=3")
  assert r.returncode == 2
  (line,) = [l for l in r.stderr.splitlines() if l.startswith("error:")]
  assert ("unknown config field 'generator.decode_bach' (--config.generator.decode_bach=3)" in line
          and "did you mean 'generator.decode_batch'?" in line), r.stderr[-2000:]


def test_declared_knobs_are_read_without_a_second_default():
  """`config....get("knob", default)` repeats (and can contradict) scalerl_jax/config/'s default:
  no production read of a DECLARED knob may use .get (undeclared ones, e.g. `layout` outside the
  scale-out configs, still may)."""
  import re
  from scalerl_jax import config as common
  base = common.base_config()

  def declared(path: list[str]) -> bool:
    node = base
    for k in path:
      if not hasattr(node, "keys") or k not in node.keys():
        return False
      node = node[k]
    return True

  pat = re.compile(r"\b(?:self\.)?config((?:\.\w+)*)\.get\(\s*\"(\w+)\"")
  found = []
  for top in ("scalerl_jax", "launch", "analysis"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          for n, line in enumerate(open(path), 1):
            for m in pat.finditer(line):
              keys = [k for k in m.group(1).split(".") if k] + [m.group(2)]
              if declared(keys):
                found.append(f"{os.path.relpath(path, ROOT)}:{n}: config.{'.'.join(keys)}")
  assert not found, "\n".join(found)
  assert declared(["generator", "decode_batch"]) and not declared(["layout"])
