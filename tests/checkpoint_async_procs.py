"""Subprocess body of tests/training/test_checkpoint_async.py: saves checkpoints back to back, asynchronously,
until it is killed. Checkpoint s holds arrays equal to `expected(s)` and meta {"s": s}.

  python tests/checkpoint_async_procs.py WORKDIR
"""
import sys

import numpy as np


def expected(step: int) -> dict:
  base = np.arange(1 << 20, dtype=np.float32)           # 4 MB per array, 4 arrays
  return {f"w{i}": base * (step + i) for i in range(4)}


def main(wd: str) -> None:
  import jax.numpy as jnp
  from scalerl_jax.training.checkpoint import RunCheckpointer
  ck = RunCheckpointer(wd, keep=3, async_save=True)
  step = 1
  while True:
    ck.save(step, {k: jnp.asarray(v) for k, v in expected(step).items()}, {"s": step})
    if step == 1:
      ck.wait()
      print("ready", flush=True)
    step += 1


if __name__ == "__main__":
  main(sys.argv[1])
