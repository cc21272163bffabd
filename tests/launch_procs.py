"""Subprocess body for tests/test_launch.py: parses each learner pod command with the real absl
flags of `scalerl_jax.main` (config file + `--config.*` overrides, `--workdir`) and runs
`recipes.validate` on it, as `main` does. Reads a JSON list of argv lists on stdin, prints one JSON
list of {"distributed", "weights", "buffer", "workdir"} (the config sections a pod reads)."""
import json
import os
import sys
import tempfile

from absl import flags

from scalerl_jax import main as main_mod  # noqa: F401 - defines --config and --workdir
from scalerl_jax import recipes


def parse(argv: list[str]) -> dict:
  sys.argv = ["scalerl_jax.main", *argv]      # config_flags reads its overrides from sys.argv
  for name in [n for n in flags.FLAGS if n.startswith("config.")]:   # the previous argv's overrides
    delattr(flags.FLAGS, name)
  flags.FLAGS.unparse_flags()
  flags.FLAGS(sys.argv)
  config = recipes.apply_recipe(flags.FLAGS["config"].value, recipes.locked_keys(argv))
  for name in ("cert", "key", "ca"):   # the TLS Secret's files exist only in the pod: stand-ins
    if config.tls.get(name):
      stand_in = os.path.join(tempfile.mkdtemp(), os.path.basename(config.tls[name]))
      with open(stand_in, "w") as f:
        f.write("-----BEGIN STAND-IN-----\n")
      config.tls[name] = stand_in
  recipes.validate(config, None)
  return dict(distributed=config.distributed.to_dict(), weights=config.weights.to_dict(),
              buffer=config.buffer.to_dict(), workdir=flags.FLAGS["workdir"].value)


if __name__ == "__main__":
  os.environ.setdefault("SCALERL_BUFFER_TOKEN", "t0ken")
  print(json.dumps([parse(a) for a in json.load(sys.stdin)]))
