"""The train step's behaviour lock: on the dumped batches of tests/data/train_step_lock.npz (the tiny
dense and tiny MoE models), the step's outputs (loss, metrics, a sha256 of the gradients; with the
real clipped AdamW a sha256 of the new state) are bit-identical to the ones the code gave when the
fixture was written (commit "train-step lock", before the step became a composition of registered
pieces). Cases: every loss family, the recipes' aggregations / advantage norms, each rollout
correction switch, 1 and 2 micro-batches, length buckets, lags, MoE routing replay and recorded
routes (tests/train_step_lock_procs.py).

The step runs in a subprocess with XLA_FLAGS fixed to the flags the fixture was written with, so
that neither this process's flags nor its compile cache take part. An intended change of what the
step computes rewrites the fixture (`python tests/train_step_lock_procs.py --write`) in the same
commit, saying why.
"""
import json
import os
import subprocess
import sys

import numpy as np

import train_step_lock_procs as lock

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_train_step_outputs_are_bit_identical_to_the_fixture():
  env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE),
             # AVX2 codegen on every CPU: the fixture was written on an AVX-512 AMD EPYC and
             # checks bit-identical with and without this cap there (2026-12-07, commit 9790229),
             # so a CI machine with another ISA (AVX-512/AMX Xeon) compiles the same code.
             XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_max_isa=AVX2")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  proc = subprocess.run([sys.executable, os.path.join(HERE, "train_step_lock_procs.py"), "--check"],
                        env=env, capture_output=True, text=True, timeout=900)
  assert proc.stdout.strip(), proc.stderr[-3000:]
  out = json.loads(proc.stdout.strip().splitlines()[-1])
  assert out["differ"] == 0 and proc.returncode == 0, out["first"]
  assert out["keys"] >= 200


def test_the_fixture_exercises_every_switch_it_claims():
  """The lock is only as good as its cases: each loss family, each correction switch and both
  route kinds change something in the fixture (a case where nothing bites locks nothing)."""
  with np.load(lock.FIXTURE) as f:
    v = {k: f[k] for k in f.files}
  cases = {c[0]: c for c in lock.CASES}
  assert {c[2].get("loss", "cispo") for c in lock.CASES} == {"cispo", "ppo", "dapo", "gspo",
                                                             "reinforce"}
  for name in cases:
    assert v[f"{name}/m/skipped"] == 0, name
    assert abs(float(v[f"{name}/m/loss"])) > 1e-4, name
  assert v["dense_scalerl/m/clip_frac_high"] > 0          # CISPO's truncation
  assert v["dense_grpo_lags_m2/m/clip_frac_high"] > 0     # PPO's clip
  band = v["dense_dapo_tis_band_buckets/m/rc/token_masked_frac_lag0"] + \
      v["dense_dapo_tis_band_buckets/m/rc/token_masked_frac_lagpos"]
  tis = v["dense_dapo_tis_band_buckets/m/rc/token_tis_truncated_frac_lag0"]
  assert band > 0 and tis > 0
  seq = "dense_gspo_seq_band_seq_tis/m/rc/"
  assert 0 < v[seq + "seq_masked_frac_lag0"] < 1 and v[seq + "seq_tis_truncated_frac_lag0"] > 0
  assert v["moe_cispo_r3_m2/m/router_disagree"] >= 0 and "moe_cispo_r3_m2/m/router_pairs" in v
  assert v["moe_dapo_recorded_band/m/router_disagree"] > 0
  assert v["dense_cispo_adamw_m2/sha_state"].dtype.kind == "U"


def test_the_step_names_no_loss_aggregation_norm_or_switch():
  """make_train_step composes registered pieces: no registered name is a string in its module."""
  import ast
  from scalerl_jax import rl
  from scalerl_jax.rl import correction
  src = open(os.path.join(os.path.dirname(HERE), "scalerl_jax", "learner", "train_step.py")).read()
  strings = {n.value for n in ast.walk(ast.parse(src)) if isinstance(n, ast.Constant)
             and isinstance(n.value, str)}
  names = set(rl.registered_losses()) | set(rl.AGGREGATIONS) | set(rl.ADV_NORMS) | set(
      correction.SWITCHES)
  assert len(names) >= 14          # "prompt" is an aggregation and a normalisation
  assert strings & names == set()
