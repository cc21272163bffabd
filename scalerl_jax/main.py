r"""Runs one ScaleRL training job: buffer + generators + learner + evaluator, then the Eq. 1 fit.

  python -m scalerl_jax.main --config=configs/tiny.py --workdir=/tmp/scalerl_tiny \
      [--config.recipe=qwen_dapo] [--config.generator.backend=vllm] [--config.rollout.max_lag=0]

Outputs in WORKDIR: metrics.jsonl, config.json, tb/ (TensorBoard), checkpoints/, logs/,
base_policy/ (the SFT warm start, reused when present) and fit/{fit.json,curves.png}.
Rerunning the same command resumes from the newest valid checkpoint (`--config.resume=never`
starts over; docs/RELIABILITY.md).

Scale-out configs pick a learner layout per topology (`--config=configs/8b.py:tpu_v5p_64`, or
`--config.topology=NAME`, which re-applies that layout). Multi-host: one process per host, all
running this same command; `config.distributed` or $SCALERL_COORDINATOR / $SCALERL_NUM_PROCESSES /
$SCALERL_PROCESS_ID set up `jax.distributed` before any JAX work (scalerl_jax/distributed.py).
Process 0 runs the buffer, generators, evaluation and logs; every process runs the learner step.
"""
import sys

from absl import app, flags
from ml_collections import config_flags

from scalerl_jax import distributed, job, recipes, topologies

_CONFIG = config_flags.DEFINE_config_file("config", "configs/tiny.py", "Run config file.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (created if missing).")


def main(argv):
  del argv
  try:
    locked = recipes.locked_keys(sys.argv)
    config = recipes.apply_recipe(_CONFIG.value, locked)
    if "topology" in locked:          # the layout of the chosen hardware target takes effect
      topologies.apply_layout(config)
    recipes.validate(config, _WORKDIR.value)
    distributed.initialize(config)    # multi-host: before any JAX computation (no-op for one)
  except (recipes.ConfigError, ValueError) as e:
    sys.exit(f"config error: {e}")
  from scalerl_jax.health import ParityError, RunUnhealthy
  try:
    job.run(config, _WORKDIR.value)
  except ParityError as e:    # start-up gate: nothing trained, nothing to keep
    sys.exit(f"run stopped at start-up: {e}")
  except RunUnhealthy as e:   # the trainer wrote a checkpoint; exit non-zero with the reason
    sys.exit(f"run stopped by the health check: {e.reason} (checkpoint at step {e.step} in "
             f"{_WORKDIR.value}/checkpoints; resume with the same command after fixing the cause)")


if __name__ == "__main__":
  app.run(main)
