"""Suite-wide setting: one persistent XLA compilation cache for the processes the tests start.

About 25 tests run `python -m scalerl_jax.main` (and its generator and buffer processes) on the
tiny config. Each process compiled the same SFT, learner and sampler programs again: 25 of a
3-step run's 65 s on a quiet 2-core box. Those processes now share one cache directory for the
whole `pytest` run (both xdist workers: the directory is made here, in the controller, before
the workers start, and they inherit the variable), so only the first run of each program compiles.

* This process (and so every in-process test) imports jax first and keeps compiling without the
  cache; only processes started after this point read the variables.
* A size limit turns on JAX's file lock around cache reads and writes: two workers never read a
  half-written entry.
* An executable loaded from the cache is the compiled one: same numbers, same
  `memory_analysis()`/`cost_analysis()` (checked when this was added). Tests that must compile
  (the chaos harness) set their own directory.
* A `JAX_COMPILATION_CACHE_DIR` already in the environment is kept. The directory made here is
  removed when the run ends.
"""
import os
import shutil
import tempfile

import jax  # noqa: F401  (first: this process's jax config is read before the variables are set)

_MADE_HERE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  _MADE_HERE = tempfile.mkdtemp(prefix="scalerl-test-xla-cache-")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _MADE_HERE
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(8 << 30))
if "SCALERL_SFT_CACHE_DIR" not in os.environ and _MADE_HERE:
  # The tiny runs' SFT warm starts, shared the same way (sft.cache_dir; keyed by a hash of the
  # model, sft, data sections and seed, so only identical warm starts are reused): ~9 s of each
  # tiny run's ~40 s on a warm XLA cache.
  os.environ["SCALERL_SFT_CACHE_DIR"] = os.path.join(_MADE_HERE, "sft")


def pytest_unconfigure(config):
  if _MADE_HERE and not hasattr(config, "workerinput"):   # the controller (or a plain run)
    shutil.rmtree(_MADE_HERE, ignore_errors=True)
