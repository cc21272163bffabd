r"""Runs one ScaleRL training job: buffer + generators + learner + evaluator, then the Eq. 1 fit.

  python -m scalerl_jax.main --config=configs/tiny.py --workdir=/tmp/scalerl_tiny \
      [--config.recipe=qwen_dapo] [--config.generator.backend=vllm] [--config.rollout.max_lag=0]

Outputs in WORKDIR: metrics.jsonl, config.json, tb/ (TensorBoard), checkpoints/, logs/,
base_policy/ (the SFT warm start, reused when present) and fit/{fit.json,curves.png}.
WORKDIR may be gs://BUCKET/PATH (docs/STORAGE.md; $STORAGE_EMULATOR_HOST for an emulator).
Rerunning the same command resumes from the newest valid checkpoint (`--config.resume=never`
starts over; docs/RELIABILITY.md).
`--config` is a preset file or a saved run file (e.g. an earlier run's WORKDIR/config.json), resolved
with the `--config.a.b=value` overrides by the one resolver every process of a run uses
(`scalerl_jax.config.resolve`; docs/ARCHITECTURE.md "One resolver").

Scale-out configs pick a learner layout per topology (`--config=configs/8b.py:tpu_v5p_64`, or
`--config.topology=NAME`, which re-applies that layout). Multi-host: one process per host, all
running this same command; `config.distributed` or $SCALERL_COORDINATOR / $SCALERL_NUM_PROCESSES /
$SCALERL_PROCESS_ID set up `jax.distributed` before any JAX work (scalerl_jax/distributed.py).
Process 0 runs the buffer, generators, evaluation and logs; every process runs the learner step.
"""
import sys

import jax
from absl import app, flags

from scalerl_jax import config as run_config
from scalerl_jax import distributed, recipes, topologies
from scalerl_jax.training import job
from scalerl_jax.training.health import NoRewardSignal, ParityError, RunUnhealthy

_CONFIG = flags.DEFINE_string("config", None, "Run config: a preset configs/X.py[:ARG] or a saved "
                              "run file (required); --config.a.b=value overrides a knob.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (required; created if missing).")
USAGE_ERROR = 2        # exit status of a bad command line (missing flag, malformed value)
OVERRIDES: list[str] = []    # the --config.a.b=value arguments, for the resolver


def _usage_error(message: str):
  """One line on stderr and exit status 2: never a traceback for a bad command line."""
  print(f"error: {message} (python -m scalerl_jax.main --config=FILE --workdir=DIR "
        f"[--config.a.b=value ...]; --helpshort for the flags)", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _one_line(e: BaseException | str) -> str:
  return " ".join(str(e).split()) or type(e).__name__


def parse_flags(argv) -> list[str]:
  """absl's flag parsing, the `--config.a.b=value` overrides set aside for the resolver; each
  failure one clear line (exit status 2), before any JAX work."""
  for name in ("config", "workdir"):
    if not any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv[1:]):
      _usage_error(f"--{name} is required")
  rest, OVERRIDES[:] = run_config.split_overrides(argv[1:])
  try:
    rest = flags.FLAGS([argv[0], *rest])
  except flags.Error as e:
    _usage_error(_one_line(" ".join(l for l in str(e).splitlines() if l.strip())))
  if not _CONFIG.value:
    _usage_error("--config is required")
  if not _WORKDIR.value:
    _usage_error("--workdir must not be empty")
  if len(rest) > 1:
    _usage_error(f"unexpected positional arguments {rest[1:]}")
  return rest


def main(argv) -> None:
  del argv
  assert _CONFIG.value is not None      # parse_flags refused a run without --config
  try:
    config = run_config.resolve_config(_CONFIG.value, OVERRIDES)
  except run_config.PresetError as e:
    _usage_error(_one_line(e))
  except (run_config.ConfigError, ValueError) as e:
    sys.exit(f"config error: {e}")
  try:
    recipes.resolve_routing_replay(config, recipes.validate(config, _WORKDIR.value))
    spec = distributed.initialize(config)   # multi-host: before any JAX computation
  except (recipes.ConfigError, ValueError) as e:
    sys.exit(f"config error: {e}")
  print(run_config.knob_line(config, "learner"), file=sys.stderr, flush=True)
  print(f"learner devices: {jax.local_device_count()} local of {jax.device_count()} in "
        f"{jax.process_count()} processes", file=sys.stderr, flush=True)
  if config.recipe_applied:   # a resolved run config (launch.gke.render): its preflight
    failures = topologies.run_shape_failures(config, jax.process_count(), jax.device_count())
    if failures:
      sys.exit(f"preflight at job start: {failures[0]}")
  try:
    _run(config)
  except BaseException as e:  # multi-host: a failed process exits now (no shutdown barrier)
    distributed.exit_on_error(spec, e)
    raise


def _run(config) -> None:
  """job.run with the expected stops as one-line exits (SystemExit with the reason)."""
  assert _WORKDIR.value is not None      # main refused a run without --workdir
  try:
    job.run(config, _WORKDIR.value)
  except ParityError as e:    # start-up gate: nothing trained, nothing to keep
    sys.exit(f"run stopped at start-up: {e}")
  except NoRewardSignal as e:  # step-0 reward check: nothing trained; e says why and the knob
    sys.exit(f"run stopped at {e}")
  except RunUnhealthy as e:   # the trainer wrote a checkpoint; exit non-zero with the reason
    sys.exit(f"run stopped by the health check: {e.reason} (checkpoint at step {e.step} in "
             f"{_WORKDIR.value}/checkpoints; resume with the same command after fixing the cause)")


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
