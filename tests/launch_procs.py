"""Subprocess body for tests/launch/test_manifests.py: parses each learner pod command with the real absl
flags of `scalerl_jax.main` (config file + `--config.*` overrides, `--workdir`) and runs
`recipes.validate` on it, as `main` does. Reads a JSON list of argv lists on stdin, prints one JSON
list of {"distributed", "weights", "buffer", "workdir"} (the config sections a pod reads)."""
import json
import os
import sys
import tempfile

from absl import flags

from scalerl_jax import config as run_config
from scalerl_jax import main as main_mod  # defines --config and --workdir
from scalerl_jax import recipes


def parse(argv: list[str]) -> dict:
  sys.argv = ["scalerl_jax.main", *argv]
  flags.FLAGS.unparse_flags()
  main_mod.parse_flags(sys.argv)               # main's own parsing: flags, overrides set aside
  config = run_config.resolve_config(flags.FLAGS["config"].value, main_mod.OVERRIDES)
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
