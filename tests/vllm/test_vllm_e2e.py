"""`generator.backend=vllm` runs the tiny config end to end with a real vLLM worker process.

* at T = 0.7 the first, on-policy step's IS ratios have mean 1 +- 1e-3 and KL(gen||learner) < 1e-6
  (vLLM's processed log-probs = log_softmax(logits / T); the learner divides by the same T), and
  the start-up log-prob parity gate passes; in the same run, `kill -9` of the vLLM generator
  worker: its engine exits, the worker is restarted and the run finishes with lag <= k;
* an engine started on the wrong checkpoint (`generator.vllm_model_dir`) stops the run at
  start-up, before any step, with the gate's message.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import alive, children, cmdline
from test_vllm_worker import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cmd(workdir, *extra):
  return [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
          f"--workdir={workdir}", "--config.generator.backend=vllm", "--config.total_steps=4",
          "--config.sft.clean_steps=20", "--config.sft.steps=10", "--config.eval.every_steps=2",
          "--config.eval.samples_per_prompt=2", "--config.data.heldout=16",
          "--config.rollout.max_lag=2", *extra]


def _metrics(wd):
  """metrics.jsonl's lines so far (a line being written is left for the next read)."""
  try:
    lines = open(os.path.join(wd, "metrics.jsonl")).read().splitlines()
  except OSError:
    return []
  out = []
  for l in lines:
    try:
      out.append(json.loads(l))
    except ValueError:
      break
  return out


def test_main_with_vllm_backend_and_kill9_of_its_generator(tmp_path):
  """One real run does both (one vLLM run and engine start fewer in the suite):

  * at T = 0.7 the first step is on-policy through vLLM (IS ratio 1, KL ~0, the gate passed);
  * `kill -9` of the generator worker once step 2 is logged: its vLLM engine (a separate process
    in .venv-vllm, talking over a Unix socket) must not outlive it, the supervisor restarts the
    worker (a new engine on the newest weights), the lease of its half-done groups expires, and
    the run reaches its step target with lag <= k. Numbers: docs/RELIABILITY.md (run with -s)."""
  require_vllm()
  steps, kill_after, k = 5, 2, 2
  cmd = _cmd(tmp_path, "--config.generator.temperature=0.7", f"--config.total_steps={steps}",
             "--config.buffer.lease_ttl_s=5", "--config.generator.heartbeat_s=1")
  log = tmp_path / "main.log"
  t0 = time.time()
  p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                       stdout=subprocess.DEVNULL, stderr=open(log, "w"))
  try:
    while not any(l["kind"] == "train" and l["step"] == kill_after for l in _metrics(tmp_path)):
      assert p.poll() is None, log.read_text()[-3000:]
      assert time.time() - t0 < 600
      time.sleep(0.05)
    gen = [c for c in children(p.pid) if "--generator_id gen-0" in cmdline(c)]
    assert len(gen) == 1
    engines = [c for c in children(gen[0]) if "generation.vllm.worker" in cmdline(c)]
    assert engines, "no vLLM engine process under the generator"
    os.kill(gen[0], signal.SIGKILL)
    t_kill = time.time()
    while any(alive(e) for e in engines) and time.time() - t_kill < 60:
      time.sleep(0.1)
    engine_exit_s = time.time() - t_kill
    assert not any(alive(e) for e in engines), "the vLLM engine outlived its generator"
    rc = p.wait(timeout=900)
    assert rc == 0, log.read_text()[-3000:]
  finally:
    if p.poll() is None:
      p.kill()
      p.wait()
  train = [l for l in _metrics(tmp_path) if l["kind"] == "train"]
  assert [l["step"] for l in train] == list(range(1, steps + 1))
  assert all(l["max_lag"] <= k for l in train)
  # vLLM served the initial weights from an HF export of the fetched ones, one per generator in
  # the workdir (generation/export_cache.py: the marker is written last, so it is complete) ...
  export = tmp_path / "vllm_export-gen-0"
  assert (export / "scalerl_export.json").is_file() and (export / "config.json").is_file()
  assert not (tmp_path / "vllm_export-gen-0.writing").exists()
  # ... both engines (the first and the restarted one) wrote their own output to the workdir's
  # log, the second appended to the first (a restart keeps it) ...
  engine_log = (tmp_path / "logs" / "vllm-gen-0.log").read_text()
  assert engine_log.count("--- vLLM engine start") == 2, engine_log[-3000:]
  # ... and its float32 engine + FP32 head sampled with the learner's own log-probs at T = 0.7:
  # the first, on-policy step has IS ratios of 1 and a ~0 KL estimate (a bf16 head would show
  # ~1e-4; a learner at T = 1 shows a mean ratio 1.0022 and KL 9e-3, docs/LEARNER.md).
  first = train[0]
  print(f"\n[vllm T=0.7] first step: is_ratio_mean {first['is_ratio_mean']:.7f}, max "
        f"{first['is_ratio_max']:.7f}, kl_k3 {first['kl_k3']:.2e}, parity mean |d| "
        f"{first['health/parity_mean_abs']:.2e} on {first['health/parity_tokens']} tokens")
  assert first["max_lag"] == 0
  assert abs(first["is_ratio_mean"] - 1.0) < 1e-3 and abs(first["is_ratio_max"] - 1.0) < 1e-3
  assert first["kl_k3"] < 1e-6
  # The start-up parity gate ran on the first batch and passed (float32 engine: ~1e-6 per token).
  assert first["health/parity_alarm"] == 0 and first["health/parity_mean_abs"] < 1e-4
  assert first["health/parity_tokens"] > 0
  # The kill: the supervisor restarted exactly the killed worker.
  events = [json.loads(l) for l in open(tmp_path / "logs" / "supervisor.log")]
  assert [e["name"] for e in events] == ["gen-0"] and events[0]["returncode"] == -9
  print("[kill9-vllm-generator]", json.dumps(dict(
      steps=steps, killed_after_step=kill_after, engine_exit_s=round(engine_exit_s, 2),
      restart_after_s=round(events[0]["t"] - t_kill, 2), wall_s=round(time.time() - t0, 1),
      max_lag=max(l["max_lag"] for l in train))))


def test_parity_gate_stops_a_run_whose_engine_has_the_wrong_weights(tmp_path):
  """The fleet's engine is started on another checkpoint of the same architecture (a random one,
  as a mixed-up base/instruct path would be): the gate fails the run before step 1."""
  require_vllm()
  from scalerl_jax import models
  from configs import tiny
  import jax
  import numpy as np
  from scalerl_jax.models import sections as model_sections
  cfg = model_sections.model_config(tiny.get_config())
  wrong = tmp_path / "wrong_ckpt"
  models.save_hf(cfg, jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(123))),
                 str(wrong))
  work = tmp_path / "run"
  r = subprocess.run(_cmd(work, f"--config.generator.vllm_model_dir={wrong}"), cwd=ROOT,
                     capture_output=True, text=True, timeout=900)
  last = r.stderr.strip().splitlines()[-1]
  print(f"\n[gate] exit {r.returncode}: {last[:400]}")
  assert r.returncode != 0
  assert last.startswith("run stopped at start-up: log-prob parity gate failed at weight version 0")
  assert "Traceback" not in r.stderr.split("run stopped at start-up")[-1]
  lines = [json.loads(l) for l in open(work / "metrics.jsonl")] if (work / "metrics.jsonl").exists() else []
  assert not [l for l in lines if l.get("kind") == "train"]      # not one RL step was taken
  assert not os.path.isdir(work / "checkpoints") or not os.listdir(work / "checkpoints")


def test_vllm_model_dir_that_is_not_a_checkpoint_is_a_config_error(tmp_path):
  r = subprocess.run(_cmd(tmp_path / "run", f"--config.generator.vllm_model_dir={tmp_path}/nope"),
                     cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert r.returncode != 0
  assert r.stderr.strip().splitlines()[-1].startswith(
      "config error: generator.vllm_model_dir=") and "Traceback" not in r.stderr
