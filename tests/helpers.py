"""Shared test helpers: free ports and child processes whose output goes to files.

Why files: a child whose stdout/stderr is a pipe that nobody reads blocks once it has written
64 KiB. Tests that started several processes with `stdout=PIPE, stderr=PIPE` and then waited for
them one by one (`p.communicate()` in a loop), or ran other work first, left the others' pipes
unread: in the suite a JAX process blocked on its log writes while its partner waited for it at
jax.distributed's shutdown barrier, which timed out after 300 s (`test_two_processes_equal_one`,
a fresh-clone run). Output written to files never blocks, and every process is waited for
against one deadline.
"""
from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import time

from scalerl_jax import xla_env


TEST_OPT_FLAG = "--xla_backend_optimization_level"


def with_test_compile_flags(flags: str | None) -> str:
  """An XLA_FLAGS value plus the compile-bound tests' `--xla_backend_optimization_level=0`
  (LLVM's optimizer off; conftest.py says why), unless it already names a level."""
  kept = (flags or "").split()
  if any(f.startswith(TEST_OPT_FLAG) for f in kept):
    return " ".join(kept)
  return " ".join(kept + [f"{TEST_OPT_FLAG}=0"])


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a compile-bound JAX script a test starts: the inherited flags (a user's
  `--xla_cpu_max_isa=...`), the tests' compile level, and the simulated device count set to
  `devices` (None: removed)."""
  return xla_env.with_device_count(with_test_compile_flags(os.environ.get("XLA_FLAGS")), devices)


def proc_state(pid: int) -> str | None:
  """The state letter of /proc/PID/stat (R, S, Z, ...), or None when there is no such process."""
  try:
    return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
  except (OSError, IndexError):
    return None


def alive(pid: int) -> bool:
  """True while `pid` exists and is not a zombie."""
  return proc_state(pid) not in (None, "Z")


def children(pid: int) -> list[int]:
  """The pids whose parent is `pid` now."""
  out = []
  for d in os.listdir("/proc"):
    if d.isdigit():
      try:
        if int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1]) == pid:
          out.append(int(d))
      except (OSError, IndexError, ValueError):
        pass
  return out


def descendants(pid: int) -> list[int]:
  """Children of `pid` and theirs (generator workers, the buffer, their reapers, vLLM engines)."""
  kids = children(pid)
  return kids + [g for k in kids for g in descendants(k)]


def cmdline(pid: int) -> str:
  """The command line of `pid`, arguments joined by spaces ("" once it is gone)."""
  try:
    return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
  except OSError:
    return ""


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@dataclasses.dataclass
class Logged:
  """A child process whose stdout and stderr go to `<log>.out` / `<log>.err`."""
  proc: subprocess.Popen
  log: str

  def output(self) -> tuple[str, str]:
    """(stdout, stderr) written so far."""
    read = lambda p: open(p, errors="replace").read() if os.path.exists(p) else ""
    return read(self.log + ".out"), read(self.log + ".err")


def start(cmd: list[str], log: str, **popen_kwargs) -> Logged:
  """Starts `cmd` with stdout/stderr to files `log`.out / `log`.err (never a pipe)."""
  os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
  with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **popen_kwargs)
  return Logged(proc, log)


def finish(children: list[Logged], timeout: float) -> list[tuple[int | None, str, str]]:
  """Waits for every child against one deadline; returns [(returncode, stdout, stderr)]. A child
  still running at the deadline is killed (its returncode is then None in the result)."""
  deadline = time.time() + timeout
  results = []
  try:
    for c in children:
      try:
        rc = c.proc.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        rc = None
      results.append((rc, *c.output()))
  finally:
    for c in children:
      if c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait()
  return results
