r"""Runs one ScaleRL training job: buffer + generators + learner + evaluator, then the Eq. 1 fit.

  python -m scalerl_jax.main --config=configs/tiny.py --workdir=/tmp/scalerl_tiny \
      [--config.recipe=qwen_dapo] [--config.generator.backend=vllm] [--config.rollout.max_lag=0]

Outputs in WORKDIR: metrics.jsonl, config.json, tb/ (TensorBoard), checkpoints/, logs/,
base_policy/ (the SFT warm start, reused when present) and fit/{fit.json,curves.png}.
WORKDIR may be gs://BUCKET/PATH (docs/STORAGE.md; $STORAGE_EMULATOR_HOST for an emulator).
Rerunning the same command resumes from the newest valid checkpoint (`--config.resume=never`
starts over; docs/RELIABILITY.md).

Scale-out configs pick a learner layout per topology (`--config=configs/8b.py:tpu_v5p_64`, or
`--config.topology=NAME`, which re-applies that layout). Multi-host: one process per host, all
running this same command; `config.distributed` or $SCALERL_COORDINATOR / $SCALERL_NUM_PROCESSES /
$SCALERL_PROCESS_ID set up `jax.distributed` before any JAX work (scalerl_jax/distributed.py).
Process 0 runs the buffer, generators, evaluation and logs; every process runs the learner step.
"""
import sys

import jax
from absl import app, flags
from ml_collections import config_flags

from scalerl_jax import distributed, recipes, runtime, topologies
from scalerl_jax.training import job
from scalerl_jax.training.health import NoRewardSignal, ParityError, RunUnhealthy

_CONFIG = config_flags.DEFINE_config_file("config", None, "Run config file (required).")
_WORKDIR = flags.DEFINE_string("workdir", None, "Output directory (required; created if missing).")
USAGE_ERROR = 2        # exit status of a bad command line (missing flag, malformed value)


def _usage_error(message: str):
  """One line on stderr and exit status 2: never a traceback for a bad command line."""
  print(f"error: {message} (python -m scalerl_jax.main --config=FILE --workdir=DIR "
        f"[--config.a.b=value ...]; --helpshort for the flags)", file=sys.stderr)
  sys.exit(USAGE_ERROR)


def _one_line(e: BaseException | str) -> str:
  return " ".join(str(e).split()) or type(e).__name__


def _config_error(e: BaseException, argv) -> str:
  """One line for an exception raised while loading the config file or applying overrides."""
  if isinstance(e, (KeyError, AttributeError)):     # ml_collections: an unknown field
    while e.args and isinstance(e.args[0], BaseException):   # AttributeError(KeyError(...))
      e = e.args[0]
    first, *hint = str(e.args[0] if e.args else e).split("\n")
    key = first.strip("\"'")
    bad = [a.split("=")[0] for a in argv if a.startswith("--config.") and
           a.split("=")[0].rsplit(".", 1)[-1] == key]
    where = f" ({bad[0]})" if bad else ""
    hint = " ".join(hint).strip()                        # ml_collections' "Did you mean ..."
    hint = f"; {hint[:1].lower()}{hint[1:]}" if hint else ""
    return (f"unknown config field {key!r}{where}: not declared in the config file / "
            f"base_config{hint}")
  return f"bad --config: {_one_line(e)}"


def _flag_value(argv, name: str) -> str:
  vals = [a.split("=", 1)[1] for a in argv if a.startswith(f"--{name}=")]
  return vals[-1] if vals else ""


def parse_flags(argv) -> list[str]:
  """absl's flag parsing + the config file load and overrides, each failure one clear line.

  Runs before any JAX work: a missing `--workdir`/`--config`, a nonexistent config file, an
  unknown `--config.x` key or a malformed value (`--config.rollout.max_lag=abc`) exit with status 2."""
  for name in ("config", "workdir"):
    if not any(a == f"--{name}" or a.startswith(f"--{name}=") for a in argv[1:]):
      _usage_error(f"--{name} is required")
  errors = (OSError, KeyError, AttributeError, TypeError, ValueError, SyntaxError)
  try:
    rest = flags.FLAGS(argv)
  except flags.Error as e:
    lines = [l for l in str(e).splitlines() if l.strip()]
    if any(l.startswith("Traceback") for l in lines):   # an exception inside the config file
      lines = [lines[0].split("Traceback")[0].strip() + " " + lines[-1].strip()]
    _usage_error(_one_line(" ".join(lines)))
  except errors as e:
    _usage_error(_config_error(e, argv))
  try:
    config = _CONFIG.value              # a failed file load is reported on first use
    if config is not None:
      config.keys()
  except errors as e:
    cause = e.__cause__ or e
    if isinstance(cause, OSError) and cause.__cause__ is not None:
      cause = cause.__cause__
    last = [l.strip() for l in str(cause).splitlines() if l.strip()][-1:] or [_one_line(cause)]
    _usage_error(f"cannot load --config={_flag_value(argv, 'config')}: {last[0]}")
  if config is None:
    _usage_error("--config is required")
  if not _WORKDIR.value:
    _usage_error("--workdir must not be empty")
  if len(rest) > 1:
    _usage_error(f"unexpected positional arguments {rest[1:]}")
  return rest


def main(argv) -> None:
  del argv
  try:
    locked = recipes.locked_keys(sys.argv)
    config = recipes.apply_recipe(_CONFIG.value, locked)
    if "topology" in locked:          # the layout of the chosen hardware target takes effect
      topologies.apply_layout(config)
    runtime.resolve_routing_replay(config, recipes.validate(config, _WORKDIR.value))
    spec = distributed.initialize(config)   # multi-host: before any JAX computation
  except (recipes.ConfigError, ValueError) as e:
    sys.exit(f"config error: {e}")
  print(runtime.knob_line(config, "learner"), file=sys.stderr, flush=True)
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
