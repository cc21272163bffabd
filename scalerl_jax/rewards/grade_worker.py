"""One grading worker process (rewards/isolation.py starts it; not a user command):

    python -m scalerl_jax.rewards.grade_worker FD MEMORY_MB

A fresh interpreter (exec'd, never forked from the grading process with its gRPC threads): it
imports the verifiers, warms Math-Verify, caps its address space at what it then holds plus
MEMORY_MB (RLIMIT_AS), says "ready" on the socket FD and then serves requests
(name, text, answer, require_think_close) -> ("ok", Grade) | ("oom", detail) | ("error", detail),
graded in its main thread. It exits at EOF, after an out-of-memory, or when its parent dies.
"""
from __future__ import annotations

import ctypes
import os
import resource
import signal
import sys
from multiprocessing.connection import Connection

from scalerl_jax.rewards import isolation, registry

_PR_SET_PDEATHSIG = 1


def _vm_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def serve(conn: Connection, memory_mb: int) -> None:
  """Warm up, cap memory, say ready, then grade until EOF (module docstring)."""
  isolation.mark_worker()
  registry.grade_direct("math", "</think>$\\frac{1}{2}$", "0.5")   # imports + warms Math-Verify
  limit = _vm_bytes() + int(memory_mb) * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
  conn.send(("ready", os.getpid()))
  while True:
    try:
      name, text, answer, rtc = conn.recv()
    except (EOFError, OSError):
      return
    except MemoryError:   # the request itself does not fit (a completion of many MB)
      conn.send(("oom", f"the answer needed more than rewards.grade_memory_mb={memory_mb} MB"))
      return
    try:
      conn.send(("ok", registry.grade_direct(name, text, answer, rtc)))
    except MemoryError:
      conn.send(("oom", f"the grade needed more than rewards.grade_memory_mb={memory_mb} MB"))
      return
    except Exception as e:   # noqa: BLE001  (any verifier failure is this answer's grade_error)
      conn.send(("error", f"{type(e).__name__}: {e}"[:200]))


def main() -> None:
  ppid = os.getppid()
  try:   # die with the process that started this worker
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
  except (OSError, AttributeError):
    pass
  if os.getppid() != ppid:
    return
  # A signal to the grading process's group (a pod's SIGTERM, ^C) is its parent's to act on: the
  # worker finishes nothing on its own and dies with its parent (PDEATHSIG above, or EOF).
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  fd, memory_mb = int(sys.argv[1]), int(sys.argv[2])
  serve(Connection(fd), memory_mb)


if __name__ == "__main__":
  main()
