"""Processes of tests/core/test_processes_watchdog.py (run as `python tests/child_watchdog_procs.py ROLE ...`).

parent WORKDIR DLL READY: starts one child (`stuck DLL READY`) through `ProcessGroup.start` (the exec
  launcher every buffer / generator goes through), prints its pid, then sleeps until it is killed.
stuck DLL READY: installs a SIGTERM handler that would exit at once, touches READY, then deadlocks
  in `pthread_mutex_lock` on a mutex it already holds, called through `ctypes.DLL` (CDLL: the GIL
  is released, Python threads run but the main thread never returns to the interpreter; PyDLL: the
  GIL is held, nothing in the interpreter runs).
leaver PIDFILE: starts a grandchild in its own process group (`sleep 300`, as vLLM starts its
  EngineCore), writes the grandchild's pid to PIDFILE, then exits normally.
"""
import ctypes
import os
import signal
import sys
import time


def parent(workdir: str, dll: str, ready: str) -> None:
  from scalerl_jax.processes import ProcessGroup
  g = ProcessGroup(workdir)
  role = ["leaver", ready] if dll == "leaver" else ["stuck", dll, ready]
  p = g.start(role[0], [sys.executable, os.path.abspath(__file__), *role])
  print(p.pid, flush=True)
  time.sleep(600)


def leaver(pidfile: str) -> None:
  import subprocess
  g = subprocess.Popen(["sleep", "300"])                  # same process group as this child
  with open(pidfile + ".tmp", "w") as f:
    f.write(str(g.pid))
  os.replace(pidfile + ".tmp", pidfile)


def stuck(dll: str, ready: str) -> None:
  signal.signal(signal.SIGTERM, lambda *_: os._exit(0))   # would exit at once, if it could run
  lib = getattr(ctypes, dll)("libc.so.6")
  mutex = ctypes.create_string_buffer(64)                 # PTHREAD_MUTEX_INITIALIZER (zeros)
  lib.pthread_mutex_lock(mutex)
  open(ready, "w").close()                                # about to block for good
  lib.pthread_mutex_lock(mutex)                           # self-deadlock: never returns


if __name__ == "__main__":
  role, args = sys.argv[1], sys.argv[2:]
  {"parent": parent, "stuck": stuck, "leaver": leaver}[role](*args)
