"""Issue 46: liveness from progress for the learner and the buffer (scalerl_jax/progress.py).

A real buffer process with a progress file (buffer.progress_file, what the rendered run config
gives it): while a
generator leases from it slowly (one lease every 0.4 s, each a unit of progress: a served lease
and its WAL commit), the pod's exec probe (the exact command launch/gke/render.py renders) keeps
passing; frozen on purpose (SIGSTOP: the port stays open, a TCP probe would pass), the probe fails
within the bound plus one tick. The learner's wiring (a tick at every publish) and the rendered
probes are checked in tests/launch/test_manifests.py / the preflight.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.procs import buffer_knobs
from launch.gke import render
from scalerl_jax.progress import Beacon, age_s, probe_command
from scalerl_jax.protocol.client import BufferClient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "liveness-test-token"
BOUND_S = 3.0
pytestmark = pytest.mark.xdist_group("liveness")


def _probe(path: str) -> bool:
  cmd = probe_command(path, BOUND_S)
  return subprocess.run([sys.executable, *cmd[1:]], timeout=30).returncode == 0


def test_a_frozen_buffer_fails_its_probe_within_the_bound_a_slow_one_does_not(tmp_path):
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_id": i, "tokens": [1, 2, 3], "answer": "1"}) + "\n"
                             for i in range(400)))
  beacon = tmp_path / "progress"
  p = subprocess.Popen(
      [sys.executable, "-m", "scalerl_jax.buffer.server", "--port=0", f"--prompts={prompts}",
       f"--wal-dir={tmp_path / 'wal'}",
       *buffer_knobs(2, 1, 1000, buffer__progress_file=beacon, buffer__lease_ttl_s=600)],
      cwd=ROOT, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT,
                                                         "SCALERL_BUFFER_TOKEN": TOKEN})
  try:
    address = json.loads(p.stdout.readline())["address"]
    client = BufferClient(address, TOKEN, retries=0)
    assert _probe(str(beacon))                      # touched at start-up
    ok, t_end = [], time.monotonic() + 3 * BOUND_S  # slow but progressing: a lease every 0.4 s
    while time.monotonic() < t_end:
      assert client.lease("gen@1", max_groups=1)
      ok.append(_probe(str(beacon)))
      time.sleep(0.4)
    assert all(ok) and len(ok) >= 5, ok
    os.kill(p.pid, signal.SIGSTOP)                  # frozen: its port stays open
    t0 = time.monotonic()
    while _probe(str(beacon)):
      assert time.monotonic() - t0 < BOUND_S + 2.0, "a frozen buffer still passed its probe"
      time.sleep(0.2)
    took = time.monotonic() - t0
    assert took <= BOUND_S + 2.0 and age_s(str(beacon)) >= BOUND_S
    print(f"frozen buffer failed its probe after {took:.1f} s (bound {BOUND_S:g} s)")
    client.close()
  finally:
    os.kill(p.pid, signal.SIGKILL)
    p.wait(10)


def test_the_beacon_throttles_and_never_raises(tmp_path):
  b = Beacon(str(tmp_path / "d" / "f"), min_interval_s=10.0)
  b.tick()
  t = os.path.getmtime(tmp_path / "d" / "f")
  os.utime(tmp_path / "d" / "f", (t - 100, t - 100))
  b.tick()                                   # within min_interval_s: not written again
  assert age_s(str(tmp_path / "d" / "f")) >= 99
  Beacon("").tick()                          # no file: a no-op
  Beacon("/proc/version/x").tick()           # an unwritable path: no exception (the probe fails)
  assert age_s(str(tmp_path / "missing")) == float("inf")


def test_rendered_learner_and_buffer_probe_their_progress_files():
  from tests.launch.test_manifests import load_variant, pod_spec   # noqa: E402  (the committed manifests)
  for variant in sorted(render.VARIANTS):
    docs = load_variant(variant)
    for (kind, _), d in docs.items():
      if kind not in ("JobSet", "Deployment"):
        continue
      comp = d["metadata"]["labels"]["app.kubernetes.io/component"]
      if comp in ("learner", "buffer"):
        c = pod_spec(d)["containers"][0]
        cmd = c["livenessProbe"]["exec"]["command"]
        assert "/tmp/scalerl/progress" in cmd[-1] and "getmtime" in cmd[-1], (variant, comp, cmd)
        assert c["livenessProbe"]["failureThreshold"] == 1
        if comp == "buffer":   # the file is the run config's buffer.progress_file (the ConfigMap)
          run_cfg = docs[("ConfigMap", next(k[1] for k in docs if k[0] == "ConfigMap"))]
          text = next(iter(run_cfg["data"].values()))
          assert "'progress_file': '/tmp/scalerl/progress'" in text.split("'buffer'")[1][:2000]
          assert any(a.startswith("--run-config=") for a in c["command"])
