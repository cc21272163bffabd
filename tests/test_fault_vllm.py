"""Generator fault with the vLLM backend: `kill -9` of a vLLM generator worker mid-run. Its vLLM
engine (a separate process in .venv-vllm, talking over a Unix socket) must not outlive it, the
supervisor restarts the worker (a new engine on the newest weights), the lease of its half-done
groups expires, and the run reaches its step target with lag <= k.

Numbers observed here are tabulated in docs/RELIABILITY.md (run with -s to print them).
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from scalerl_jax.generation.vllm.generator import vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_resume import _alive, _children, _lines  # noqa: E402


def _cmdline(pid):
  try:
    return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
  except OSError:
    return ""


def test_kill9_vllm_generator_is_restarted_and_the_run_finishes(tmp_path):
  if not vllm_python().exists():
    pytest.skip(f"vLLM venv missing ({vllm_python()}); run scripts/setup_vllm_venv.sh")
  wd = str(tmp_path)
  steps, kill_after, k = 6, 2, 2
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={wd}",
         "--config.generator.backend=vllm", f"--config.total_steps={steps}",
         "--config.sft.clean_steps=20", "--config.sft.steps=10", "--config.eval.every_steps=100",
         "--config.eval.samples_per_prompt=1", "--config.data.heldout=8",
         f"--config.rollout.max_lag={k}", "--config.buffer.lease_ttl_s=5",
         "--config.generator.heartbeat_s=1"]
  t0 = time.time()
  p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       stdout=subprocess.DEVNULL, stderr=open(os.path.join(wd, "main.log"), "w"))
  try:
    def logged(s):
      try:
        return any(l["step"] == s and l["kind"] == "train" for l in _lines(wd))
      except (OSError, ValueError):
        return False
    while not logged(kill_after):
      assert p.poll() is None, open(os.path.join(wd, "main.log")).read()[-3000:]
      assert time.time() - t0 < 600
      time.sleep(0.05)
    gen = [c for c in _children(p.pid) if "--generator_id gen-0" in _cmdline(c)]
    assert len(gen) == 1
    engines = [c for c in _children(gen[0]) if "generation.vllm.worker" in _cmdline(c)]
    assert engines, "no vLLM engine process under the generator"
    os.kill(gen[0], signal.SIGKILL)
    t_kill = time.time()
    while any(_alive(e) for e in engines) and time.time() - t_kill < 60:
      time.sleep(0.1)
    engine_exit_s = time.time() - t_kill
    assert not any(_alive(e) for e in engines), "the vLLM engine outlived its generator"
    rc = p.wait(timeout=900)
    assert rc == 0, open(os.path.join(wd, "main.log")).read()[-3000:]
  finally:
    if p.poll() is None:
      p.kill()
  wall = time.time() - t0
  train = [l for l in _lines(wd) if l["kind"] == "train"]
  assert [l["step"] for l in train] == list(range(1, steps + 1))
  assert all(l["max_lag"] <= k for l in train)
  events = [json.loads(l) for l in open(os.path.join(wd, "logs", "supervisor.log"))]
  assert [e["name"] for e in events] == ["gen-0"] and events[0]["returncode"] == -9
  print("\n[kill9-vllm-generator]", json.dumps(dict(
      steps=steps, killed_after_step=kill_after, engine_exit_s=round(engine_exit_s, 2),
      restart_after_s=round(events[0]["t"] - t_kill, 2), wall_s=round(wall, 1),
      max_lag=max(l["max_lag"] for l in train))))
