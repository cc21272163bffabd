"""harness.procs, the one copy of the process / port / polling helpers (tests, benches, chaos)."""
import socket
import subprocess
import sys
import time

import pytest

from harness import procs


def test_descendants_cmdline_and_cpu_seconds_of_a_process_tree():
  # A child that starts a grandchild which burns 0.5 CPU-s (process time, so load beside the
  # test only delays it), then both sleep.
  code = ("import subprocess, sys, time\n"
          "subprocess.Popen([sys.executable, '-c', 'import time\\n"
          "while time.process_time() < 0.5: pass\\ntime.sleep(60)', 'grandchild-marker'])\n"
          "time.sleep(60)\n")
  p = subprocess.Popen([sys.executable, "-c", code])
  try:
    kids = procs.wait_until(lambda: [k for k in procs.descendants(p.pid)
                                     if "grandchild-marker" in procs.cmdline(k)], 20, "grandchild")
    assert len(kids) == 1 and procs.alive(kids[0]) and procs.children(p.pid) == kids
    assert procs.proc_state(p.pid) in ("S", "R")
    busy = procs.wait_until(lambda: procs.cpu_seconds(kids[0]) >= 0.45, 50, "grandchild CPU")
    assert busy and procs.argv(kids[0])[-2:] == ["grandchild-marker", ""]
  finally:
    for k in procs.descendants(p.pid):
      subprocess.run(["kill", "-9", str(k)])
    p.kill()
    p.wait()
  assert not procs.alive(p.pid) and procs.proc_stat(p.pid) is None
  assert procs.cpu_seconds(p.pid) == 0.0 and procs.cmdline(p.pid) == ""


def test_wait_until_returns_the_value_or_names_what_timed_out():
  t = time.monotonic()
  calls = []
  assert procs.wait_until(lambda: calls.append(1) or len(calls) >= 3 and "ok", 5, "x",
                          interval_s=0.01) == "ok"
  assert len(calls) == 3
  with pytest.raises(TimeoutError, match="waiting for the moon"):
    procs.wait_until(lambda: None, 0.2, "the moon", interval_s=0.05)
  assert procs.wait_until(lambda: 0, 0.05, raise_on_timeout=False) == 0
  assert time.monotonic() - t < 3


def test_free_port_is_bindable():
  port = procs.free_port()
  with socket.socket() as s:
    s.bind(("127.0.0.1", port))
