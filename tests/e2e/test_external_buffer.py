"""The cluster layout of launch/ on localhost: the buffer, a generator worker and the learner as three
separately started jobs (as the GKE manifests run them), joined only by the buffer's address and the
auth token. The worker reads the same config FILE as the learner (`--run_config=configs/tiny.py`)
and names itself after the host; the learner runs with `--config.buffer.external=True`."""
import json
import os
import subprocess
import sys

import pytest

from helpers import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.update({k: str(v) for k, v in extra.items()})
  return env


def test_external_buffer_needs_token_and_address(tmp_path):
  env = _env()
  env.pop("SCALERL_BUFFER_TOKEN", None)
  base = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
          f"--workdir={tmp_path}", "--config.buffer.external=True"]
  r = subprocess.run(base + ["--config.buffer.address=127.0.0.1:5"], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "config error: buffer.external=True: set $SCALERL_BUFFER_TOKEN" in r.stderr
  r = subprocess.run(base, cwd=ROOT, env=_env(SCALERL_BUFFER_TOKEN="t" * 32),
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and "needs buffer.address=HOST:PORT" in r.stderr, r.stderr[-2000:]
  assert not os.path.exists(tmp_path / "metrics.jsonl")


@pytest.mark.slow
def test_learner_buffer_and_fleet_as_separate_jobs(tmp_path):
  env = _env(SCALERL_BUFFER_TOKEN="s3cret-" * 4)
  prompts = tmp_path / "prompts.jsonl"
  subprocess.run([sys.executable, "-m", "scalerl_jax.data.export", "--config=configs/tiny.py",
                  f"--out={prompts}"], cwd=ROOT, env=env, check=True, timeout=120)
  port = free_port()
  with open(tmp_path / "buffer.err", "w") as err:   # its log to a file (an unread pipe blocks)
    buffer = subprocess.Popen(
        [sys.executable, "-m", "scalerl_jax.buffer.server", "--host=127.0.0.1",
         f"--port={port}", "--run-config=configs/tiny.py", f"--prompts={prompts}"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)   # stdout: its port
  worker = learner = None
  try:
    assert json.loads(buffer.stdout.readline())["port"] == port
    with open(tmp_path / "worker.err", "w") as err:
      worker = subprocess.Popen(
          [sys.executable, "-m", "scalerl_jax.generation.worker", "--run_config=configs/tiny.py",
           f"--buffer=127.0.0.1:{port}", "--backend=jax", f"--workdir={tmp_path}"],
          cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
    learner = subprocess.run(
        [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
         f"--workdir={tmp_path / 'run'}", "--config.buffer.external=True",
         f"--config.buffer.address=127.0.0.1:{port}", "--config.total_steps=2",
         "--config.sft.clean_steps=20", "--config.sft.steps=10", "--config.eval.every_steps=2",
         "--config.eval.samples_per_prompt=1", "--config.pin_cpus=False"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert learner.returncode == 0, learner.stderr[-4000:]
  finally:
    for p in (worker, buffer):
      if p is not None and p.poll() is None:
        p.kill()
  lines = [json.loads(l) for l in open(tmp_path / "run" / "metrics.jsonl")]
  train = [l for l in lines if l["kind"] == "train"]
  assert [l["step"] for l in train] == [1, 2] and all(l["policy_tokens"] > 0 for l in train)
  assert not os.path.exists(tmp_path / "run" / "logs" / "buffer.log")   # no local buffer started
  assert worker.returncode is None or worker.returncode < 0                # it was still serving
