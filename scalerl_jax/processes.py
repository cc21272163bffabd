"""Child processes of a run (buffer server, generator workers): start, watch, stop — no orphans.

Every child is started in its own process group (session) with PR_SET_PDEATHSIG=SIGTERM (set by a
tiny exec launcher, see `_LAUNCH`), so it dies with the main process even on SIGKILL;
`ProcessGroup.close()` sends SIGTERM, waits, then SIGKILLs.

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

_PR_SET_PDEATHSIG = 1

# Children are started through this launcher instead of a `preexec_fn`: a preexec_fn forces a plain
# fork() that runs gRPC's fork handlers in the child before exec, which can abort the child
# ("epoll_wait error: Bad file descriptor") while the parent has gRPC calls in flight. Without one,
# subprocess uses vfork+exec; the launcher then sets PR_SET_PDEATHSIG itself (kept across exec) and
# exits if the parent already died. start_new_session gives the child its own process group.
_LAUNCH = ("import ctypes, os, signal, sys\n"
           "try:\n  ctypes.CDLL('libc.so.6').prctl(%d, signal.SIGTERM)\n"
           "except OSError:\n  pass\n"
           "if os.getppid() != int(os.environ['SCALERL_PARENT_PID']):\n  sys.exit(1)\n"
           "os.execvp(sys.argv[1], sys.argv[1:])\n" % _PR_SET_PDEATHSIG)


_spawner = None
_spawner_lock = threading.Lock()


def _popen(*args, **kw) -> subprocess.Popen:
  """Popen from a thread that lives as long as this process: PR_SET_PDEATHSIG fires when the
  *thread* that forked the child exits, so a child started from a short-lived thread (e.g. a
  supervisor restart) would otherwise be SIGTERMed as soon as that thread ends."""
  global _spawner
  if threading.current_thread() is threading.main_thread():
    return subprocess.Popen(*args, **kw)
  import concurrent.futures
  with _spawner_lock:
    if _spawner is None:
      _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawner")
  return _spawner.submit(subprocess.Popen, *args, **kw).result()


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
    p = _popen([sys.executable, "-c", _LAUNCH] + list(argv),
               stdout=subprocess.PIPE if name == "buffer" else log, stderr=log,
               env={**os.environ, **(env or {}), "SCALERL_PARENT_PID": str(os.getpid())},
               start_new_session=True)
    log.close()   # the child holds its own descriptor
    self.procs[name] = p
    self.argv[name] = (list(argv), env)
    return p

  def _read_address(self, p: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.time() + timeout_s
    line = p.stdout.readline()
    if not line or time.time() > deadline:
      raise RuntimeError(f"buffer server did not start; see {self.logdir}/buffer.log")
    return json.loads(line)

  def start_buffer(self, prompts_path: str, config, timeout_s: float = 60.0,
                   wal_dir: str | None = None, learner_state: str | None = None) -> str:
    """Starts the gRPC buffer server process; returns its address once it listens.

    With `wal_dir` (or `config.buffer.wal_dir`) the buffer keeps a write-ahead log there and
    `supervise()` may restart it (same port, state replayed from the log). `learner_state` is the
    learner's checkpoint/resume file, read at every buffer start (buffer/replay.py)."""
    r = config.rollout
    host, _, port = config.buffer.address.rpartition(":")
    argv = [sys.executable, "-m", "scalerl_jax.buffer.server", "--host", host or "127.0.0.1",
            "--port", port or "0", "--token-env", config.buffer.auth_token_env,
            "--prompts", prompts_path, "--prompts-per-step", str(r.prompts_per_step),
            "--group-size", str(r.generations_per_prompt), "--max-lag", str(r.max_lag),
            "--mode", r.mode, "--max-message-bytes", str(config.buffer.max_message_bytes),
            "--shuffle-seed", str(config.seed)]
    if config.rl.no_positive_resampling:
      argv += ["--npr-threshold", str(config.rl.npr_threshold)]
    if config.rl.get("routing_replay", False):   # MoE: the generators send routes; validate them
      from scalerl_jax import models, runtime
      cfg = runtime.model_config(config)
      argv += ["--route-shape", f"{models.num_moe_layers(cfg)},{cfg.num_experts_per_tok},"
                                f"{cfg.num_experts}"]
    b = config.buffer
    wal_dir = wal_dir or b.wal_dir
    if wal_dir:
      argv += ["--wal-dir", wal_dir, "--wal-fsync", str(b.wal_fsync)]
    if learner_state:
      argv += ["--learner-state", learner_state]
    if b.get("lease_ttl_s", None) is not None:
      argv += ["--lease-ttl-s", str(b.lease_ttl_s)]
    self.max_restarts["buffer"] = int(b.get("max_restarts", 3))
    self.max_restarts["gen"] = int(config.generator.get("max_restarts", 3))
    return self.start_buffer_argv(argv, timeout_s, wal_dir or "")

  def start_buffer_argv(self, argv: list[str], timeout_s: float = 60.0, wal_dir: str = "") -> str:
    """Starts a buffer from a full argv (tests use it with any prompt set); returns its address."""
    p = self.start("buffer", argv)
    info = self._read_address(p, timeout_s)
    self.buffer_address, self.buffer_wal = info["address"], wal_dir
    self.buffer_info = info
    return info["address"]

  def restart_buffer(self, timeout_s: float = 60.0) -> dict:
    """Restarts the buffer on the same port with the same WAL dir; returns its startup line
    ({"port", "address", "wal": replay report})."""
    argv, env = self.argv["buffer"]
    argv = list(argv)
    port = self.buffer_address.rpartition(":")[2]
    if "--port" in argv:
      argv[argv.index("--port") + 1] = port
    else:
      argv += ["--port", port]
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
    def loop():
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
