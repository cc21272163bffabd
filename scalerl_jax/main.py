r"""Runs one ScaleRL training job: buffer + generators + learner + evaluator, then the Eq. 1 fit.

  python -m scalerl_jax.main --config=configs/tiny.py --workdir=/tmp/scalerl_tiny \
      [--config.recipe=qwen_dapo] [--config.generator.backend=vllm] [--config.rollout.max_lag=0]

Outputs in WORKDIR: metrics.jsonl, config.json, tb/ (TensorBoard), checkpoints/, logs/,
base_policy/ (the SFT warm start, reused when present) and fit/{fit.json,curves.png}.
"""
import sys

from absl import app, flags
from ml_collections import config_flags

from scalerl_jax import job, recipes

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Run config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (created if missing).")


def main(argv):
  del argv
  try:
    config = recipes.apply_recipe(_CONFIG.value, recipes.locked_keys(sys.argv))
    recipes.validate(config, _WORKDIR.value)
  except recipes.ConfigError as e:
    sys.exit(f"config error: {e}")
  job.run(config, _WORKDIR.value)


if __name__ == "__main__":
  app.run(main)
