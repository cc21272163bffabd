"""Grading in worker processes: no model answer can stall the process that grades it.

A reward registered with `isolated=True` (math: Math-Verify / SymPy, which can start an exact
big-number computation such as `2^{2^{40}}` that holds the GIL and never ends) is graded by
`grade()` here, in one of `rewards.grade_processes` worker processes:

  * each a fresh interpreter (`python -m scalerl_jax.rewards.grade_worker`: exec'd like spawn,
    never `fork`ed from a process with gRPC threads, and without re-importing the caller's main
    module as multiprocessing's spawn / forkserver do); a replacement warms up in the background
    and its start-up is not charged to any grade's deadline;
  * each grade has a hard wall-clock deadline (`rewards.grade_timeout_s`): a worker that overruns
    is SIGKILLed and replaced, and the answer gets reward 0 with reason `grade_timeout`;
  * each worker's address space is capped (RLIMIT_AS) at what it had after start-up plus
    `rewards.grade_memory_mb`: a grade that allocates past it gets `grade_oom` (the worker then
    exits and is replaced); any other failure (an exception, a worker that died) `grade_error`;
  * cheap guards run first, in the caller (`register(..., guard=fn)`; math: exponent towers, huge
    exponents, factorials of huge numbers, long digit runs, `rewards/math.py::hazard`): a guarded
    answer gets `grade_guard` without reaching a worker. The deadline is the guarantee; the
    guards only spare a worker.

The caller's thread waits on a pipe (the GIL released), so its other threads (decode, lease
heartbeats, weight fetches) never wait on a grade. `counts()` is the process's tally by reason
(what the generator reports in its heartbeats: docs/SANDBOX.md "Grading processes").
The pool is process-wide and starts on first use; `configure(section)` sets its limits
(a `scalerl_jax.config.Rewards` section; unconfigured: its defaults), `shutdown()` stops its workers.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import queue
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

from scalerl_jax import config
from scalerl_jax.spawn import popen
from scalerl_jax.rewards import registry
from scalerl_jax.rewards.registry import Grade

log = logging.getLogger("scalerl.rewards")

FAULTS = ("grade_timeout", "grade_oom", "grade_error", "grade_guard")   # reward-0 reasons of this module
_START_TIMEOUT_S = 120.0    # a worker's start-up (imports, warm-up) on a loaded machine
_in_worker = False          # True inside a grading worker: grade there directly


def mark_worker() -> None:
  """Called by a grading worker (rewards/grade_worker.py): grades in this process go direct."""
  global _in_worker
  _in_worker = True


@dataclasses.dataclass
class _Worker:
  proc: subprocess.Popen
  conn: Connection
  ready: bool = False


class GradePool:
  """`processes` grading workers (module docstring); `grade()` is thread-safe and blocks only its
  caller, at most `timeout_s` once a worker is free."""

  def __init__(self, section: Any):
    self.timeout_s = float(section.grade_timeout_s)
    self.memory_mb = int(section.grade_memory_mb)
    self.guards = bool(section.grade_guard)
    self._start_lock = threading.Lock()
    self._count_lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()
    self._idle: queue.Queue = queue.Queue()
    self._all: list[_Worker] = []
    self._closed = False
    for _ in range(int(section.grade_processes)):
      self._idle.put(self._start())

  def _start(self) -> _Worker:
    """Starts a worker (it warms up in the background; `_ready` waits for it)."""
    ours, theirs = socket.socketpair()
    with self._start_lock, theirs:
      # from a thread that lives as long as this process (PDEATHSIG follows the forking thread)
      p = popen([sys.executable, "-m", "scalerl_jax.rewards.grade_worker",
                 str(theirs.fileno()), str(self.memory_mb)],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
      w = _Worker(p, Connection(ours.detach()))
      self._all.append(w)
      return w

  def _ready(self, w: _Worker) -> None:
    """Waits for a fresh worker's "ready" (start-up is not charged to a grade's deadline)."""
    if w.ready:
      return
    if not w.conn.poll(_START_TIMEOUT_S):
      raise RuntimeError(f"a grading worker did not start within {_START_TIMEOUT_S:g} s")
    kind, _ = w.conn.recv()
    if kind != "ready":
      raise RuntimeError(f"a grading worker sent {kind!r} before ready")
    w.ready = True

  def pids(self) -> list[int]:
    """Process ids of the current workers."""
    with self._start_lock:
      return [w.proc.pid for w in self._all]

  def wait_ready(self) -> None:
    """Waits until every idle worker has started (a start-up check; raises RuntimeError when one
    cannot start)."""
    ws = []
    try:
      while True:
        ws.append(self._idle.get_nowait())
    except queue.Empty:
      pass
    try:
      for w in ws:
        self._ready(w)
    finally:
      for w in ws:
        self._idle.put(w)

  def _last_word(self, w: _Worker):
    """The out-of-memory a worker reported before it stopped reading a request (None if none)."""
    try:
      if w.conn.poll(1.0):
        kind, detail = w.conn.recv()
        if kind == "oom":
          return Grade(0.0, "grade_oom", detail=str(detail))
    except (EOFError, OSError):
      pass
    return None

  def _retire(self, w: _Worker) -> None:
    w.proc.kill()
    w.proc.wait(5)
    w.conn.close()
    with self._start_lock:
      if w in self._all:
        self._all.remove(w)

  def _count(self, reason: str) -> None:
    with self._count_lock:
      self._counts["graded"] += 1
      if reason in FAULTS:
        self._counts[reason] += 1

  def counts(self) -> dict[str, int]:
    """Grades done by this pool and its faults by reason: {"graded", "grade_timeout", ...}."""
    with self._count_lock:
      return {k: int(self._counts[k]) for k in ("graded",) + FAULTS}

  def grade(self, name: str, text: str, answer: str, require_think_close: bool, guard=None):
    """The Grade of one completion, from a worker within `timeout_s` or a reward-0 Grade with
    reason grade_timeout / grade_oom / grade_error; `guard(text, answer)` (optional) runs first:
    a non-empty string it returns is the detail of a grade_guard."""
    if self._closed:
      raise RuntimeError("the grading pool is shut down")
    why = guard(text, answer) if guard is not None and self.guards else ""
    if why:
      self._count("grade_guard")
      return Grade(0.0, "grade_guard", detail=why)
    w = self._idle.get()
    replace = True
    try:
      self._ready(w)
    except (RuntimeError, EOFError, OSError) as e:   # a broken install: loud, never a silent 0
      self._retire(w)
      self._idle.put(self._start())
      raise RuntimeError(f"grading worker failed to start: {e} (exit code {w.proc.returncode})") from e
    t0 = time.monotonic()
    try:
      w.conn.send((name, text, answer, require_think_close))
      if not w.conn.poll(self.timeout_s):
        g = Grade(0.0, "grade_timeout", detail=f"no grade within rewards.grade_timeout_s="
                  f"{self.timeout_s:g} s; worker killed and replaced")
      else:
        kind, got = w.conn.recv()
        replace = kind == "oom"
        g = got if kind == "ok" else Grade(0.0, "grade_oom" if kind == "oom" else "grade_error",
                                           detail=str(got))
    except (EOFError, OSError) as e:   # the worker stopped reading: its last word, else died
      g = self._last_word(w) or Grade(0.0, "grade_error", detail=f"grading worker died: "
                                      f"{type(e).__name__} (exit code {w.proc.poll()})")
    finally:
      if replace:
        self._retire(w)
        if not self._closed:
          w = self._start()
      self._idle.put(w)
    if g.reason in FAULTS:
      log.warning("grade %s after %.1f s (%s): %s", g.reason, time.monotonic() - t0, name, g.detail)
    self._count(g.reason)
    return g

  def shutdown(self) -> None:
    """Stops every worker (a grade in flight then gets grade_error)."""
    self._closed = True
    for w in list(self._all):
      self._retire(w)


_pool: GradePool | None = None
_section: Any = None
_pool_lock = threading.Lock()


def configure(section: Any) -> None:
  """Sets the limits of this process's pool (restarting it when it runs with others)."""
  global _section
  with _pool_lock:
    if _pool is not None and _section != section:
      _shutdown_locked()
    _section = section


def pool() -> GradePool:
  """This process's pool, started on first use (limits: `configure`, else the defaults)."""
  global _pool
  with _pool_lock:
    if _pool is None:
      _pool = GradePool(_section if _section is not None else config.Rewards())
    return _pool


def in_worker() -> bool:
  """True inside a grading worker (it grades directly)."""
  return _in_worker


def counts() -> dict[str, int]:
  """This process's grade tally by reason (zeros before the pool started)."""
  with _pool_lock:
    p = _pool
  return p.counts() if p is not None else {k: 0 for k in ("graded",) + FAULTS}


def grade(name: str, completion_text: str, answer: str, require_think_close: bool = True) -> Grade:
  """Grade(reward, reason, ...) of one completion with reward `name`: a reward registered
  `isolated=True` in this process's pool (a worker process, a deadline; grade_* reasons on a
  fault), the others here (registry.grade_direct). Inside a grading worker: directly."""
  isolated, guard = registry.isolation_of(name)
  if not isolated or _in_worker:
    return registry.grade_direct(name, completion_text, answer, require_think_close)
  return pool().grade(name, completion_text, answer, require_think_close, guard=guard)


def compute_reward(name: str, completion_text: str, answer: str,
                   require_think_close: bool = True) -> float:
  """Scores one completion with reward `name` (as `grade`, the reward alone). Without
  `require_think_close` a completion with no `</think>` is graded whole (text.answer_view)."""
  isolated, _ = registry.isolation_of(name)
  if not isolated or _in_worker:
    return registry.compute_direct(name, completion_text, answer, require_think_close)
  return float(grade(name, completion_text, answer, require_think_close).reward)


def _shutdown_locked() -> None:
  global _pool
  if _pool is not None:
    _pool.shutdown()
    _pool = None


def shutdown() -> None:
  """Stops this process's pool (the next grade starts a new one)."""
  with _pool_lock:
    _shutdown_locked()
