"""JaxSampler(devices=2): the batch decoded data-parallel over two local CPU devices gives the same
completions as one device (run in a subprocess: the device count is fixed when JAX starts)."""
import json
import os
import subprocess
import sys

import numpy as np

from helpers import xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_SCRIPT = os.path.join(ROOT, "tests", "sampler_devices_procs.py")


def test_two_devices_match_one_device():
  env = dict(os.environ, XLA_FLAGS=xla_flags(2),
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, _SCRIPT], env=env, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
  out = json.loads(line[len("RESULT "):])
  assert out["one_devices"] == 1 and out["two_devices"] == 2
  assert len(out["one"]) == len(out["two"]) == 3
  n_interrupted = 0
  for a, b, ref in zip(out["one"], out["two"], out["two_learner"]):
    # Same uniforms for every row: same tokens, phases and versions; log-probs to f32 rounding.
    assert a["tokens"] == b["tokens"] and a["finish"] == b["finish"]
    assert a["policy"] == b["policy"] and b["versions"] == [2] * len(b["tokens"])
    assert len(b["tokens"]) > 32                   # the cache grew past its first 32 slots
    np.testing.assert_allclose(b["logprobs"], a["logprobs"], atol=1e-5)
    pol = np.array(b["policy"])
    n_interrupted += int(not pol.all())            # interrupted: forced tokens have log-prob 0
    np.testing.assert_allclose(np.array(b["logprobs"])[pol], np.array(ref)[pol], atol=2e-5)
    assert np.all(np.array(b["logprobs"])[~pol] == 0.0)
  assert n_interrupted >= 2


def test_worker_cpu_decode_devices_flag(monkeypatch):
  """generator.jax_devices=2 adds the XLA:CPU device-count flag; a pinned generator keeps one."""
  from scalerl_jax import config as common
  from scalerl_jax.generation.jax_engine import cpu_decode_devices
  monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")
  generator = common.Generator.from_config(_config(jax_devices=2).generator)
  assert cpu_decode_devices(generator, pinned=[1]) == 1
  assert os.environ["XLA_FLAGS"] == "--xla_cpu_multi_thread_eigen=false"
  assert cpu_decode_devices(generator, pinned=None) == 2
  assert os.environ["XLA_FLAGS"].split() == ["--xla_cpu_multi_thread_eigen=false",
                                             "--xla_force_host_platform_device_count=2"]
  assert cpu_decode_devices(common.Generator(), None) == 1


def _config(**generator):
  """A full run config (every knob declared) with `generator` overrides."""
  from scalerl_jax import config as common
  c = common.base_config()
  c.generator.update(generator)
  return c
