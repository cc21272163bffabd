"""Child processes of a run (buffer server, generator workers): start, watch, stop — no orphans.

Every child is started in its own process group (session) with PR_SET_PDEATHSIG=SIGTERM (set by a
tiny exec launcher, see `_LAUNCH`), so it dies with the main process even on SIGKILL; a reaper
process per child SIGKILLs the child's group `SCALERL_CHILD_GRACE_S` (10 s) after the parent died,
even if the child is stuck in a C call where its SIGTERM handler cannot run, and at once when the
child itself exits (its own children, such as vLLM's engine processes, do not outlive it;
docs/RELIABILITY.md "Children never outlive their parent"). `ProcessGroup.close()` sends SIGTERM,
waits, then SIGKILLs.

Supervision (docs/RELIABILITY.md): `supervise()` (or `start_supervisor()`, a background thread)
restarts a dead generator up to `config.generator.max_restarts` times (default 3) and a dead buffer
(only when it has a write-ahead log, on the same port, up to `config.buffer.max_restarts`, default 3);
anything beyond the limits raises like `check()`.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from scalerl_jax.spawn import popen
from scalerl_jax.protocol.rpc import TLS

_PR_SET_PDEATHSIG = 1
GRACE_ENV = "SCALERL_CHILD_GRACE_S"   # seconds a child may take to exit after its parent died
DEFAULT_GRACE_S = 10.0                # > the generator worker's own 5 s SIGTERM grace

# Children are started through this launcher instead of a `preexec_fn`: a preexec_fn forces a plain
# fork() that runs gRPC's fork handlers in the child before exec, which can abort the child
# ("epoll_wait error: Bad file descriptor") while the parent has gRPC calls in flight. Without one,
# subprocess uses vfork+exec; the launcher then sets PR_SET_PDEATHSIG itself (kept across exec) and
# exits if the parent already died. start_new_session gives the child its own process group.
#
# PDEATHSIG=SIGTERM alone is not a bound: a Python handler runs only when the main thread is between
# bytecodes, so a child inside a long C call (XLA, a blocking lock, a C extension holding the GIL)
# outlives its parent until that call returns (the "child outlived the killed learner" CI flake).
# A watchdog *thread* would not be enough either (it needs the GIL). So before exec the launcher
# forks a reaper, a separate single-threaded process that shares nothing with the child's
# interpreter: it waits on a pidfd of the parent (poll of `kill(parent, 0)` where pidfds are
# unavailable), gives the child `SCALERL_CHILD_GRACE_S` (default 10 s) to exit on its SIGTERM,
# then SIGKILLs the child's whole process group (the child, its own children such as vLLM engine
# processes, and itself). The reaper has PDEATHSIG=SIGUSR1 towards the child: when the child exits,
# for any reason, the reaper SIGKILLs what is left of the child's group (itself included). Without
# that, a vLLM worker that exited on its SIGTERM (or after a shutdown cut short) left vLLM's
# EngineCore and its VLLM::Worker running under init, ~1.9 GB each, for the rest of the test run.
_LAUNCH = """\
import ctypes, os, select, signal, sys, time
parent = int(os.environ['SCALERL_PARENT_PID'])
grace = float(os.environ.get('%(grace_env)s') or %(grace)r)
try:
  prctl = ctypes.CDLL('libc.so.6').prctl
  prctl(%(pdeathsig)d, signal.SIGTERM)
except OSError:
  prctl = None
try:
  pidfd = os.pidfd_open(parent)
except (AttributeError, OSError):
  pidfd = None
if os.getppid() != parent:
  sys.exit(1)
child = os.getpid()
if os.fork() == 0:
  try:
    leads = os.getpgid(0) == child   # the child leads its own group: what it leaves there goes too
    if leads:
      signal.signal(signal.SIGUSR1, lambda *_: os.killpg(child, signal.SIGKILL))
    if prctl is not None:
      prctl(%(pdeathsig)d, signal.SIGUSR1 if leads else signal.SIGKILL)
    if os.getppid() == child:
      for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
      if pidfd is not None:
        select.select([pidfd], [], [])
      else:
        while True:
          time.sleep(0.25)
          try:
            os.kill(parent, 0)
          except ProcessLookupError:
            break
      time.sleep(grace)
      if os.getpgid(child) == child:
        os.killpg(child, signal.SIGKILL)
      os.kill(child, signal.SIGKILL)
  finally:
    os._exit(0)
if pidfd is not None:
  os.close(pidfd)
os.execvp(sys.argv[1], sys.argv[1:])
""" % dict(grace_env=GRACE_ENV, grace=DEFAULT_GRACE_S, pdeathsig=_PR_SET_PDEATHSIG)


def launcher_argv(argv: list[str], python: str | None = None) -> list[str]:
  """`argv` wrapped in the exec launcher (PDEATHSIG + reaper, see `_LAUNCH`); `python` runs the
  launcher (stdlib only: any interpreter, e.g. the vLLM venv's). Start it with `child_env(...)` and
  `start_new_session=True`."""
  return [python or sys.executable, "-c", _LAUNCH] + list(argv)


def child_env(env: dict | None = None) -> dict:
  """The environment of a launched child: `env` (default os.environ) + this process as its parent."""
  return {**(os.environ if env is None else env), "SCALERL_PARENT_PID": str(os.getpid())}


def pin_to_device_cpus(config, role: str, index: int = 0) -> list[int] | None:
  """With `config.pin_cpus`, pins this process to its own CPU(s), modelling one accelerator per
  role on a CPU host: the learner takes CPU 0, generator i takes CPU 1 + i (mod the CPU count).
  Must run before JAX initializes its thread pools. Returns the CPUs, or None when not pinning."""
  if not config.pin_cpus or not sys.platform.startswith("linux"):   # sched_setaffinity: Linux
    return None
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < 2:
    return None
  cpu = cpus[0] if role == "learner" else cpus[(1 + index) % len(cpus)]
  os.sched_setaffinity(0, {cpu})
  if role == "generator":   # one CPU: XLA's intra-op pool only adds contention to the small
    # decode ops (bench.sampler --xla-threads 1: 1.17-1.19x vLLM vs 0.94-0.95x with the pool)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false").strip()
  return [cpu]


def buffer_flags(config, *, run_file: str, prompts: str, host: str, port: int,
                 wal_dir: str | None = None, learner_state: str | None = None,
                 tls: list[str] | tuple = (), overrides=()) -> list[str]:
  """The flags of `python -m scalerl_jax.buffer.server` for a run `config` (the typed RunConfig; or
  the resolved ConfigDict launch/ renders, which has the same attributes): the one definition, used
  by `ProcessGroup.start_buffer` (main starts the buffer) and by launch/spec.py (the buffer pod).

  Every knob the buffer reads comes from `run_file`, the run's resolved run file (main's
  WORKDIR/config.json; a pod's rendered run config) with `overrides` (`--config.a.b=value`, as
  every pod of the run takes them); the flags are only where it listens, its prompts, the
  write-ahead log (`--wal-dir` on a local disk, docs/STORAGE.md), the learner-state file it
  rewinds from (`--learner-state`, may be gs://), `tls` (the TLS flags: main's from config.tls; a
  pod's, the mounted Secret's files) and, with routing replay, the model's route shape (computed
  here: the buffer runs without JAX)."""
  flags = [f"--run-config={run_file}", *overrides, f"--host={host}", f"--port={int(port)}",
           f"--prompts={prompts}"]
  if config.rl.routing_replay or config.rl.record_routes:   # MoE: generators send routes; validate
    from scalerl_jax import models  # local: JAX (the vLLM venv imports this module)
    from scalerl_jax.models import sections as model_sections  # local: JAX (the vLLM venv imports this module)
    cfg = model_sections.model_config(config)
    flags.append(f"--route-shape={models.num_moe_layers(cfg)},{cfg.num_experts_per_tok},"
                 f"{cfg.num_experts}")
  if wal_dir:
    flags.append(f"--wal-dir={wal_dir}")
  if learner_state:
    flags.append(f"--learner-state={learner_state}")
  return flags + list(tls)


class ProcessGroup:
  """The run's children, each with a log file under WORKDIR/logs/."""

  def __init__(self, workdir: str):
    self.logdir = os.path.join(workdir, "logs")
    os.makedirs(self.logdir, exist_ok=True)
    self.procs: dict[str, subprocess.Popen] = {}
    self.argv: dict[str, tuple] = {}          # name -> (argv, env) to restart with
    self.restarts: dict[str, int] = {}
    self.events: list[dict] = []              # restarts done: {"name", "returncode", "t"}
    self.max_restarts = {"gen": 3, "buffer": 3}
    self.buffer_address = ""
    self.buffer_wal = ""
    self._lock = threading.RLock()
    self._closing = threading.Event()
    self._supervisor_error: BaseException | None = None
    self._supervising = False

  def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    log = open(os.path.join(self.logdir, f"{name}.log"), "ab")
    p = popen(launcher_argv(argv), stdout=subprocess.PIPE if name == "buffer" else log,
               stderr=log, env=child_env({**os.environ, **(env or {})}), start_new_session=True)
    log.close()   # the child holds its own descriptor
    self.procs[name] = p
    self.argv[name] = (list(argv), env)
    return p

  def _read_address(self, p: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    assert p.stdout is not None          # started with stdout=PIPE
    line = p.stdout.readline()
    if not line or time.time() > deadline:
      raise RuntimeError(f"buffer server did not start; see {self.logdir}/buffer.log")
    return json.loads(line)

  def start_buffer(self, prompts_path: str, config, run_file: str, timeout_s: float = 60.0,
                   wal_dir: str | None = None, learner_state: str | None = None) -> str:
    """Starts the gRPC buffer server process of the run `config` (the typed RunConfig: its
    buffer, rollout, rl, audit, tls and generator sections); returns its address once it listens.

    With `wal_dir` (or `config.buffer.wal_dir`) the buffer keeps a write-ahead log there and
    `supervise()` may restart it (same port, state replayed from the log). `learner_state` is the
    learner's checkpoint/resume file, read at every buffer start (buffer/replay.py). `run_file`:
    the resolved run file the buffer reads its knobs from (WORKDIR/config.json)."""
    host, _, port = config.buffer.address.rpartition(":")
    wal_dir = wal_dir or config.buffer.wal_dir
    argv = [sys.executable, "-m", "scalerl_jax.buffer.server",
            *buffer_flags(config, run_file=run_file, prompts=prompts_path, host=host or "127.0.0.1",
                          port=int(port or 0), wal_dir=wal_dir, learner_state=learner_state,
                          tls=TLS.from_config(config).argv())]
    b = config.buffer
    self.max_restarts["buffer"] = int(b.max_restarts)
    self.max_restarts["gen"] = int(config.generator.max_restarts)
    return self.start_buffer_argv(argv, timeout_s, wal_record=wal_dir or "")

  def start_buffer_argv(self, argv: list[str], timeout_s: float = 60.0, wal_record: str = "") -> str:
    """Starts a buffer from a full argv (tests use it with any prompt set); returns its address.
    `wal_record`: the WAL directory that argv gives it, kept for the record ("" = none)."""
    p = self.start("buffer", argv)
    info = self._read_address(p, timeout_s)
    self.buffer_address, self.buffer_wal = info["address"], wal_record
    self.buffer_info = info
    return info["address"]

  def restart_buffer(self, timeout_s: float = 60.0) -> dict:
    """Restarts the buffer on the same port with the same WAL dir; returns its startup line
    ({"port", "address", "wal": replay report})."""
    argv, env = self.argv["buffer"]
    port = self.buffer_address.rpartition(":")[2]
    argv = [a for a in argv if not a.startswith("--port=")]
    if "--port" in argv:
      argv[argv.index("--port") + 1] = port
    else:
      argv += [f"--port={port}"]
    old = self.procs.get("buffer")
    if old is not None and old.poll() is None:
      raise RuntimeError("buffer is still running")
    p = self.start("buffer", argv, env)
    info = self._read_address(p, timeout_s)
    if info["address"] != self.buffer_address:   # pragma: no cover - the port was taken meanwhile
      raise RuntimeError(f"restarted buffer listens on {info['address']}, not {self.buffer_address}")
    self.buffer_info = info
    return info

  def start_workers(self, n: int, run_config: str, address: str, backend: str) -> None:
    for i in range(n):
      self.start(f"gen-{i}", [sys.executable, "-m", "scalerl_jax.generation.worker",
                              "--run_config", run_config, "--buffer", address,
                              "--generator_id", f"gen-{i}", "--backend", backend])

  def supervise(self) -> list[dict]:
    """Restarts dead generators (and a dead buffer that has a WAL) within their restart limits;
    raises like `check()` for anything else. Returns the restarts done by this call."""
    done = []
    with self._lock:
      if self._closing.is_set():
        return done
      for name, p in list(self.procs.items()):
        if p.poll() is None:
          continue
        kind = "buffer" if name == "buffer" else "gen"
        n = self.restarts.get(name, 0)
        if (kind == "buffer" and not self.buffer_wal) or n >= self.max_restarts[kind]:
          raise RuntimeError(f"{name} exited with code {p.returncode} (restarted {n} times, "
                             f"limit {self.max_restarts[kind] if kind == 'gen' or self.buffer_wal else 0}); "
                             f"see {self.logdir}/{name}.log")
        self.restarts[name] = n + 1
        ev = dict(name=name, returncode=p.returncode, t=time.time(), restart=n + 1)
        if kind == "buffer":
          ev["wal"] = self.restart_buffer().get("wal")
        else:
          argv, env = self.argv[name]
          self.start(name, argv, env)
        with open(os.path.join(self.logdir, "supervisor.log"), "a") as f:
          f.write(json.dumps(ev) + "\n")
        self.events.append(ev)
        done.append(ev)
    return done

  def start_supervisor(self, interval_s: float = 1.0) -> threading.Thread:
    """Runs `supervise()` every `interval_s` in a daemon thread; an error it raises is re-raised
    by the next `check()` (so the trainer's watchdog sees it)."""
    def loop() -> None:
      while not self._closing.wait(interval_s):
        try:
          self.supervise()
        except BaseException as e:   # noqa: BLE001 - handed to check()
          self._supervisor_error = e
          return
    self._supervising = True
    t = threading.Thread(target=loop, daemon=True, name="supervisor")
    t.start()
    return t

  def check(self) -> None:
    """Raises if a child died (its exit code and log path in the message), or if the supervisor
    thread gave up. With a supervisor running, dead children it may still restart are not errors."""
    if self._supervisor_error is not None:
      raise RuntimeError(f"supervisor: {self._supervisor_error}") from self._supervisor_error
    if self._supervising:
      return
    for name, p in self.procs.items():
      if p.poll() is not None:
        raise RuntimeError(f"{name} exited with code {p.returncode}; see "
                           f"{self.logdir}/{name}.log")

  def close(self, grace_s: float = 10.0) -> None:
    self._closing.set()
    with self._lock:
      pass                          # a restart in progress finishes first
    for p in self.procs.values():
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
    deadline = time.time() + grace_s
    for p in self.procs.values():
      try:
        p.wait(max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        p.wait()
