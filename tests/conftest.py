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

Second: compile-bound tests compile with LLVM's optimizer off (`--xla_backend_optimization_level=0`,
helpers.with_test_compile_flags): the in-process tests (set below) and the N-device scripts the
tests start (`helpers.xla_flags(N)`: moe, sharding, plan, multihost, ...). Their programs are
tiny and mostly compiled, not run: on this 2-core box test_sampler.py 135 -> 81 CPU-s,
test_hf_parity.py + test_train_step.py 294 -> 179 CPU-s. `python -m scalerl_jax.main` runs (and
the rehearsal's pods) keep XLA's default (except the 3-step real-shape rehearsal, which is mostly
compiles: test_rehearse_realshape.py passes the tests' level to its pods): with the shared
compilation cache they mostly run, and
at level 0 the suite's e2e runs took 10-25 % more CPU (SFT and decode steps run slower).
XLA's fusion and buffer decisions happen before LLVM, so `memory_analysis()` and
`cost_analysis()` are the same; results differ from the default level in the last bits (the
tiny model's logits and gradients: max relative difference 5e-7 to 8e-7, a different vectorised
summation order). No test compares bits across levels: a multi-process test starts all its JAX
processes with helpers.xla_flags, and tolerance-based parity tests are far above 1e-6. A level
already in XLA_FLAGS is kept (`XLA_FLAGS=--xla_backend_optimization_level=3 make test` tests
everything at the default).
"""
import os
import shutil
import tempfile

import jax  # noqa: F401  (first: this process's jax config is read before the variables are set)

from helpers import with_test_compile_flags  # noqa: E402

# This process (the in-process tests) compiles at the tests' level: XLA reads XLA_FLAGS once, at
# its first compile, which happens here; the variable is then restored, so `main` runs and the
# rehearsal's pods inherit the user's flags unchanged.
_USER_XLA_FLAGS = os.environ.get("XLA_FLAGS")
os.environ["XLA_FLAGS"] = with_test_compile_flags(_USER_XLA_FLAGS)
jax.jit(lambda x: x + 1)(0).block_until_ready()
if _USER_XLA_FLAGS is None:
  del os.environ["XLA_FLAGS"]
else:
  os.environ["XLA_FLAGS"] = _USER_XLA_FLAGS

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


# Run order under `make test` (`-n 4 --dist loadgroup --no-loadscope-reorder`): the longest work
# units (an xdist_group, or a single test) first, each unit's tests in collection order; then
# everything else in collection order. xdist's default order (groups by their number of tests,
# then single tests alphabetically) left the 3-4 min single tests (two-process multihost with its
# 45-s skew, the 2-device sampler, ...) to the last minutes: fc10 (2026-12-04, commit a991211, 2-core AMD EPYC) idled 6-39 % of
# both cores in its last 8 minutes while the other workers had run out of work. Wall seconds of
# each unit in fc10, longest first (a unit not listed here runs after these):
_FIRST = (
    "vllm",                          # 1081 s: the vLLM engines, one at a time
    "rehearse",                      # 518
    "gcs",                           # 434
    "e2e_smoke",                     # 312
    "resume",                        # 298
    "eval_e2e",                      # 285
    "sampler",                       # 276
    "moe",                           # 269
    "forecast_e2e",                  # 266
    "tests/e2e/test_multihost.py::test_two_processes_equal_one",              # 212
    "routing_replay",                # 192
    "fleet_eval",                    # 165
    "tests/generation/test_sampler_devices.py::test_two_devices_match_one_device",  # 159
    "tests/faults/test_chaos.py::test_chaos_three_minutes_fixed_seed",          # 144
    "e2e_multitask",                 # 120
    "e2e_instruct",                  # 108
    "tests/e2e/test_multihost.py::test_main_runs_as_two_processes",          # 99
    "tests/learner/test_train_step_lock.py::test_train_step_outputs_are_bit_identical_to_the_fixture",  # ~100 (alone, 2026-12-07, loaded)
    "tests/models/test_sharding.py::test_sharded_equals_unsharded_8_devices",   # 95
    "tests/learner/test_sharded_step.py::test_sharded_equals_unsharded",      # 80
    "tests/e2e/test_external_buffer.py::test_learner_buffer_and_fleet_as_separate_jobs",  # 79
    "ckpt_start",                    # 69
    "moe_flops",                     # 65
)


def _unit(item) -> str:
  """The xdist work unit of a test: its xdist_group's name, else its node id."""
  m = item.get_closest_marker("xdist_group")
  if m is not None:
    return str(m.args[0] if m.args else m.kwargs.get("name", ""))
  return item.nodeid


def pytest_collection_modifyitems(config, items):
  rank = {u: i for i, u in enumerate(_FIRST)}
  items.sort(key=lambda it: rank.get(_unit(it), len(rank)))   # stable: collection order within


def pytest_unconfigure(config):
  if _MADE_HERE and not hasattr(config, "workerinput"):   # the controller (or a plain run)
    shutil.rmtree(_MADE_HERE, ignore_errors=True)


# Suite profiling: with SCALERL_TEST_CPU_LOG=PATH every test phase appends one JSON line to
# PATH.<worker> with its wall seconds and the CPU seconds of this process and of the children it
# reaped (a `main` run's generator and buffer processes included). Under `-n 4` on 2 cores, wall
# time mixes in the other workers' load; CPU seconds are what a test costs the suite.
_CPU_LOG = os.environ.get("SCALERL_TEST_CPU_LOG", "")
if _CPU_LOG:
  import json
  import time

  import pytest

  def _profiled(phase):
    @pytest.hookimpl(hookwrapper=True)
    def hook(item, *args):
      t0, c0 = time.monotonic(), os.times()
      yield
      t1, c1 = time.monotonic(), os.times()
      worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
      with open(f"{_CPU_LOG}.{worker}", "a") as f:
        f.write(json.dumps(dict(
            test=item.nodeid, phase=phase, wall=round(t1 - t0, 2),
            cpu=round(c1.user - c0.user + c1.system - c0.system, 2),
            children=round(c1.children_user - c0.children_user
                           + c1.children_system - c0.children_system, 2))) + "\n")
    return hook

  pytest_runtest_setup = _profiled("setup")
  pytest_runtest_call = _profiled("call")
  pytest_runtest_teardown = _profiled("teardown")
