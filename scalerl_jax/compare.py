r"""Runs several recipes on the same config and compares their Eq. 1 fits on one compute axis.

  python -m scalerl_jax.compare --config=configs/tiny.py --recipes=scalerl,qwen_dapo \
      --workdir=runs/compare [--config.total_steps=100]

Each recipe runs in WORKDIR/<recipe>/ (all start from the same SFT base policy, trained once in
WORKDIR/base_policy and copied in). A name may add switches to a recipe, e.g.
`--recipes=scalerl,scalerl+token_band` (recipes.SWITCHES: rollout correction, freshness, R3). The comparison (analysis.fit_runs: per-run fits, the ±0.02
shared-A rule, a markdown table and a figure) goes to WORKDIR/compare/; for a task mixture
(config.data.mixture) each task is compared too (compare-<task>.md / .png, per-task panels in
curves.png). WORKDIR may be gs://BUCKET/PATH (scalerl_jax/storage.py), like each run's.
"""
import logging
import sys

from absl import app
from absl import flags

from scalerl_jax.models import sections as model_sections
from analysis.fit import fit_runs
from scalerl_jax.training import job as run_main
from scalerl_jax import config as run_config
from scalerl_jax import recipes
from scalerl_jax.training import sft
from scalerl_jax import storage
from scalerl_jax.data import build_dataset
from scalerl_jax.data import mixture

_CONFIG = flags.DEFINE_string("config", "configs/tiny.py", "Base run config (a preset "
                              "configs/X.py[:ARG]; --config.a.b=value overrides a knob).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory.")
_RECIPES = flags.DEFINE_list("recipes", ["scalerl", "qwen_dapo"], "Recipes to compare.")


def compare(preset, workdir: str, names, progress: bool = True, overrides=()) -> list[dict]:
  """Runs each recipe of `names` on `preset` (a preset path or its ConfigDict) + `overrides`
  (`--config.a.b=value`) under `workdir`; returns analysis.fit_runs' list."""
  recipes.check_workdir(workdir)
  overrides = [o for o in overrides if not o.startswith("--config.recipe=")]
  config = run_config.resolve(preset, overrides)     # the typed base (the shared warm start)
  runs = []
  for name in names:
    c = run_config.resolve_config(preset, [*overrides, f"--config.recipe={name}"])
    recipes.resolve_routing_replay(c, recipes.validate(c, storage.join(workdir, name)))
    runs.append((name, c))
  base = storage.join(workdir, sft.BASE_DIR)
  if not storage.exists(storage.join(base, "config.json")):   # one warm start shared by all
    dataset = build_dataset(config.data, config.rollout.max_prompt_len)
    sft.warm_start(config, model_sections.model_config(config), dataset, workdir, progress=progress)
  dirs = []
  for name, c in runs:
    d = storage.join(workdir, name)
    if not storage.exists(storage.join(d, sft.BASE_DIR, "config.json")):   # config.json last
      storage.copy_tree(base, storage.join(d, sft.BASE_DIR), last=("config.json",))
    if storage.exists(storage.join(d, "metrics.jsonl")):
      logging.info("%s: metrics.jsonl exists, reusing the finished run", name)
    else:
      logging.info("running recipe %s in %s", name, d)
      run_main.run(c, d, progress=progress)
    dirs.append(d)
  out = storage.join(workdir, "compare")
  per_task = bool(mixture.parse_mixture(config.data))   # a mixture: also compare per task
  res = fit_runs(dirs, out, n_boot=200, progress=progress, names=list(names),
                 metrics="per_task" if per_task else None)
  md = storage.join(out, "compare.md")
  print(storage.read_text(md) if storage.exists(md) else res)
  return res


def main(argv) -> None:
  del argv
  try:
    if not _WORKDIR.value:
      raise recipes.ConfigError("--workdir is required (the runs and the comparison go there)")
    for name in _RECIPES.value:
      recipes.recipe_overrides(name)   # ConfigError for an unknown recipe or switch
    compare(_CONFIG.value, _WORKDIR.value, _RECIPES.value, overrides=_OVERRIDES)
  except recipes.ConfigError as e:
    sys.exit(f"config error: {e}")


_OVERRIDES: list[str] = []


def _parse_flags(argv) -> list[str]:
  """absl's flags; the `--config.a.b=value` overrides set aside for the resolver."""
  rest, _OVERRIDES[:] = run_config.split_overrides(argv[1:])
  return flags.FLAGS([argv[0], *rest])


if __name__ == "__main__":
  app.run(main, flags_parser=_parse_flags)
