"""Children never outlive their parent by more than the grace period (processes._LAUNCH), even
when the child's main thread is stuck in a C call where its SIGTERM handler cannot run: the
"a child outlived the killed learner" flake of tests/e2e/test_resume.py.

A parent process starts one child through `ProcessGroup.start` (the launcher every buffer /
generator / vLLM worker goes through); the child installs a SIGTERM handler that would exit at once,
then blocks forever in a C call: `pthread_mutex_lock` on a mutex it already holds, once through
`ctypes.CDLL` (GIL released: Python threads still run, the handler does not) and once through
`ctypes.PyDLL` (GIL held: nothing in the interpreter runs, so no watchdog *thread* could help).
Both processes are in tests/child_watchdog_procs.py.
The parent is SIGKILLed; the child must be gone within grace + slack, and not before its SIGTERM
grace (it proves the handler really could not run and the reaper did the work)."""
import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import alive, descendants

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRACE_S = 1.0
SLACK_S = 6.0     # process exit + polling on a loaded 2-core box

PROCS = os.path.join(ROOT, "tests", "child_watchdog_procs.py")


@pytest.mark.parametrize("dll", ["CDLL", "PyDLL"], ids=["c_call_gil_released", "c_call_gil_held"])
def test_child_stuck_in_a_c_call_dies_after_its_parent_is_killed(tmp_path, dll):
  ready = tmp_path / "ready"
  env = {**os.environ, "PYTHONPATH": ROOT, "SCALERL_CHILD_GRACE_S": str(GRACE_S)}
  parent = subprocess.Popen([sys.executable, PROCS, "parent", str(tmp_path), dll, str(ready)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
  try:
    child = int(parent.stdout.readline())
    end = time.time() + 60
    while not ready.exists():
      assert alive(child) and time.time() < end, "the child did not reach its C call"
      time.sleep(0.02)
    family = [child] + descendants(child)           # the child and its reaper
    assert len(family) == 2, family
    time.sleep(0.2)                                  # inside the second lock now
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    t_kill = time.time()
    while any(alive(p) for p in family) and time.time() - t_kill < GRACE_S + SLACK_S:
      time.sleep(0.02)
    gone_s = time.time() - t_kill
    left = [p for p in family if alive(p)]
    assert not left, f"survivors after {gone_s:.1f} s: {left}"
    print(f"\n[{dll}] child stuck in pthread_mutex_lock gone {gone_s:.2f} s after its parent's "
          f"SIGKILL (grace {GRACE_S} s)")
    assert gone_s >= GRACE_S * 0.9     # its SIGTERM handler never ran: the reaper killed it
  finally:
    if parent.poll() is None:
      parent.kill()
    for p in [locals().get("child")] + locals().get("family", []):
      if p and alive(p):
        os.kill(p, signal.SIGKILL)


def test_what_a_child_leaves_in_its_group_dies_when_it_exits(tmp_path):
  """A child that exits normally (the parent still alive) takes the rest of its process group
  with it: a vLLM worker's EngineCore outlived it before (found as ~1.9 GB orphans under init)."""
  pidfile = tmp_path / "grandchild.pid"
  env = {**os.environ, "PYTHONPATH": ROOT, "SCALERL_CHILD_GRACE_S": str(GRACE_S)}
  parent = subprocess.Popen([sys.executable, PROCS, "parent", str(tmp_path), "leaver",
                             str(pidfile)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
  grandchild = None
  try:
    child = int(parent.stdout.readline())
    end = time.time() + 60
    while not pidfile.exists():
      assert time.time() < end, "the child did not start its grandchild"
      time.sleep(0.02)
    grandchild = int(pidfile.read_text())
    assert os.getpgid(grandchild) == child              # in the child's group, as vLLM's are
    t0 = time.time()
    while (alive(child) or alive(grandchild)) and time.time() - t0 < SLACK_S:
      time.sleep(0.02)
    assert not alive(child)
    assert not alive(grandchild), f"the grandchild still ran {SLACK_S} s after the child exited"
    assert parent.poll() is None                        # the run's main process is untouched
    print(f"\nthe grandchild was gone {time.time() - t0:.2f} s after the child exited")
  finally:
    parent.kill()
    parent.wait()
    if grandchild and alive(grandchild):
      os.kill(grandchild, signal.SIGKILL)
