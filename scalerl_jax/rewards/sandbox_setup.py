"""How one code sandbox is built (rewards/sandbox.py runs it; its docstring and docs/SANDBOX.md
describe the isolation as a whole).

  Limits                                # per-program limits (memory, CPU, processes, output, ...)
  LAUNCHER                              # the in-sandbox launcher: applies the limits, runs the program
  bwrap_command(bwrap, python, limits, status_fd, seccomp_fd)   # bwrap's argument list

and the pieces of one spawn: `memfd` (the program's source and stdin reach the sandbox as
inherited memfds), `as_nobody_if_root` (setpriv to uid/gid 65534 when the grader is root),
`SPAWN_SH` (joins the sandbox's cgroup and sets its oom_score_adj before exec'ing bwrap) and
`fresh_session_keyring` (the grading thread's own session keyring, which bwrap inherits). No
process state here but the per-thread keyring id: the settings, the cgroup pool and the run
itself are sandbox.py's.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import shutil
import subprocess
import sys
import threading

SANDBOX_UID = 65534                 # "nobody": the uid inside the sandbox (and on the host if root)
EXIT_MEMORY = 101                   # launcher: the program raised MemoryError
EXIT_FILE_SIZE = 102                # launcher: a write hit RLIMIT_FSIZE (EFBIG)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program limits. memory and file size in bytes; times in seconds."""
  memory_bytes: int = 1 << 30       # RLIMIT_AS of each process
  wall_s: float = 6.0               # the grader kills the sandbox after this long
  cpu_s: int = 0                    # RLIMIT_CPU; 0 = ceil(wall_s)
  nproc: int = 8                    # RLIMIT_NPROC: processes + threads, bwrap's init included
  output_bytes: int = 16 << 20      # stdout beyond this kills the sandbox ("output_limit")
  file_bytes: int = 16 << 20        # RLIMIT_FSIZE
  tmpfs_bytes: int = 64 << 20       # size of the private /tmp
  nofile: int = 64                  # RLIMIT_NOFILE
  sandbox_memory_bytes: int = 0     # cgroup memory ceiling of the whole sandbox; 0 = memory_bytes
                                    # + tmpfs_bytes + 64 MiB (only where cgroups are available)

  def sandbox_memory(self) -> int:
    """The per-sandbox cgroup memory ceiling in bytes."""
    return self.sandbox_memory_bytes or self.memory_bytes + self.tmpfs_bytes + (64 << 20)


# Runs inside the sandbox as `python3 -I -c LAUNCHER SRC_FD MEM CPU NPROC FSIZE NOFILE MODE [FN]`.
# It reads the program from SRC_FD, closes it, sets the limits, then runs the program in-process
# (one interpreter start per run). Stdin mode: the program runs as __main__; functional mode: it is
# imported as __solution__ and FN (top-level or Solution().FN) is called with one JSON argument per
# stdin line, the JSON result printed.
LAUNCHER = r'''
import os, resource as R, sys
def _launch():
  fd, mem, cpu, nproc, fsize, nofile = map(int, sys.argv[1:7])
  mode, fn_name = sys.argv[7], (sys.argv[8] if len(sys.argv) > 8 else "")
  with os.fdopen(fd, "rb") as f:
    src = f.read().decode("utf-8", "replace")
  for lim, v in ((R.RLIMIT_NOFILE, nofile), (R.RLIMIT_AS, mem), (R.RLIMIT_CPU, cpu),
                 (R.RLIMIT_NPROC, nproc), (R.RLIMIT_FSIZE, fsize), (R.RLIMIT_CORE, 0),
                 (R.RLIMIT_RTPRIO, 0), (R.RLIMIT_MEMLOCK, 0), (R.RLIMIT_MSGQUEUE, 0),
                 (R.RLIMIT_SIGPENDING, 64)):
    R.setrlimit(lim, (v, v + 1 if lim == R.RLIMIT_CPU else v))
  try:                               # already 1000 (and locked) where the grader is root
    with open("/proc/self/oom_score_adj", "w") as f:
      f.write("1000")
  except OSError:
    pass
  sys.argv = ["solution.py"]
  try:
    code = compile(src, "solution.py", "exec")
    if mode == "stdin":
      exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
      return
    import json                      # only here: importing json (re, enum, ...) costs ~10 ms
    ns = {"__name__": "__solution__", "__builtins__": __builtins__}
    exec(code, ns)
    if fn_name in ns:
      fn = ns[fn_name]
    elif "Solution" in ns:
      fn = getattr(ns["Solution"](), fn_name)
    else:
      raise SystemExit("function %r not defined" % fn_name)
    args = [json.loads(line) for line in sys.stdin.read().splitlines() if line.strip()]
    print(json.dumps(fn(*args)))
  except MemoryError:
    os._exit(101)
  except OSError as e:
    if e.errno == 27:                # EFBIG
      os._exit(102)
    raise
_launch()
'''


def memfd(name: str, data: bytes) -> int:
  fd = os.memfd_create(name, 0)   # inheritable only through pass_fds / stdin
  view = memoryview(data)
  while view:
    view = view[os.write(fd, view):]
  os.lseek(fd, 0, os.SEEK_SET)
  return fd


_FACTS = ("import sys, sysconfig as c; v = c.get_config_var; print(sys.prefix); "
          "print('%d.%d' % sys.version_info[:2]); print(c.get_paths()['stdlib']); "
          "print(v('LIBDIR') or ''); print(v('INSTSONAME') if v('Py_ENABLE_SHARED') else '')")


@dataclasses.dataclass(frozen=True)
class Interpreter:
  """A host interpreter as the sandbox sees it: `path` (its real path), `prefix`, `version`
  ("3.11"), `stdlib` (host directory), `libpython` (host path of its shared library; "" when
  static). Inside the sandbox it runs as `exe`: a /usr interpreter at /usr/bin/python3 (its stdlib
  is in /usr/lib, bound anyway); any other (/usr/local as in the python:*-slim images, pyenv,
  /opt) at /usr/local/bin/python3 with its stdlib at /usr/local/lib/pythonX.Y and its
  libpython in /usr/local/lib (LD_LIBRARY_PATH), where the interpreter finds its prefix."""
  path: str
  prefix: str
  version: str
  stdlib: str
  libpython: str

  @property
  def exe(self) -> str:
    return "/usr/bin/python3" if self.prefix == "/usr" else "/usr/local/bin/python3"

  def binds(self) -> list[str]:
    """bwrap args that give the sandbox this interpreter, its stdlib and its libpython."""
    args = ["--ro-bind", self.path, self.exe]
    if self.prefix != "/usr":
      args += ["--ro-bind", self.stdlib, f"/usr/local/lib/python{self.version}"]
      if self.libpython:
        args += ["--ro-bind", self.libpython, "/usr/local/lib/" + os.path.basename(self.libpython),
                 "--setenv", "LD_LIBRARY_PATH", "/usr/local/lib"]
    return args


@functools.lru_cache(maxsize=8)
def interpreter(python: str) -> Interpreter:
  """The facts of interpreter `python` (it runs once, isolated: `-I -S`); FileNotFoundError
  when it is missing, RuntimeError when it does not run."""
  real = os.path.realpath(python)
  if not (os.path.isfile(real) and os.access(real, os.X_OK)):
    raise FileNotFoundError(python)
  r = subprocess.run([real, "-I", "-S", "-c", _FACTS], capture_output=True, text=True, timeout=60)
  if r.returncode != 0:
    raise RuntimeError(f"{python} does not run: {r.stderr.strip()[-200:]}")
  prefix, version, stdlib, libdir, soname = (r.stdout.splitlines() + [""] * 5)[:5]
  lib = ""
  for d in ((os.path.join(prefix, "lib"), libdir) if soname else ()):   # its prefix's first
    if d and os.path.isfile(os.path.join(d, soname)):
      lib = os.path.realpath(os.path.join(d, soname))
      break
  return Interpreter(real, prefix, version, stdlib, lib)


def world_usable(path: str) -> bool:
  """Whether the sandbox's user (nobody) can reach `path`: every directory above it searchable by
  others, the file itself readable (and, for a directory, searchable) by others."""
  real = os.path.realpath(path)
  try:
    st = os.stat(real)
  except OSError:
    return False
  need = 0o5 if os.path.isdir(real) or os.access(real, os.X_OK) else 0o4
  if st.st_mode & need != need:
    return False
  d = os.path.dirname(real)
  while d not in ("/", ""):
    if not os.stat(d).st_mode & 0o1:
      return False
    d = os.path.dirname(d)
  return True


def default_python() -> str:
  """The interpreter a sandbox uses when `rewards.code_python` is "": the base interpreter of the
  one running (outside any venv; the image's own: /usr/local/bin/python3.X on python:*-slim), if
  the sandbox's user can reach it, else /usr/local/bin/python3 or /usr/bin/python3 (a pyenv
  interpreter under a private /root, say)."""
  base = os.path.realpath(getattr(sys, "_base_executable", "") or sys.executable)
  for p in (base, "/usr/local/bin/python3", "/usr/bin/python3"):
    if os.path.isfile(p) and world_usable(p):
      return os.path.realpath(p)
  return base


def _root_binds(python: str) -> list[str]:
  """bwrap args for the read-only root: the interpreter (`Interpreter.binds`), /usr/lib(64), and
  /lib /lib64 /bin."""
  args = interpreter(python).binds()
  for d in ("/usr/lib", "/usr/lib64"):
    if os.path.isdir(d):
      args += ["--ro-bind", d, d]
  for d in ("/lib", "/lib64", "/bin"):
    if os.path.islink(d):
      args += ["--symlink", os.readlink(d), d]
    elif os.path.isdir(d) and d != "/bin":      # non-merged-/usr systems keep libraries in /lib*
      args += ["--ro-bind", d, d]
  return args


def bwrap_command(bwrap: str, python: str, limits: Limits, status_fd: int,
                  seccomp_fd: int = -1) -> list[str]:
  """The bwrap argument list up to (not including) the interpreter's arguments; `seccomp_fd`
  (>= 0): an inherited descriptor holding the compiled filter (bwrap --seccomp)."""
  return [bwrap,
          *(["--seccomp", str(seccomp_fd)] if seccomp_fd >= 0 else []),
          "--unshare-all", "--unshare-user", "--disable-userns", "--cap-drop", "ALL",
          "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
          "--die-with-parent", "--new-session", "--clearenv", "--as-pid-1",
          "--setenv", "PATH", "/usr/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
          *_root_binds(python),
          "--proc", "/proc", "--dev", "/dev",
          "--size", str(limits.tmpfs_bytes), "--tmpfs", "/tmp",
          "--remount-ro", "/dev", "--remount-ro", "/",
          "--chdir", "/tmp", "--json-status-fd", str(status_fd),
          interpreter(python).exe]


def as_nobody_if_root(cmd: list[str]) -> tuple[list[str], dict]:
  """Root is exempt from RLIMIT_NPROC, so as root bwrap runs as uid/gid 65534 on the host: via
  setpriv (keeps subprocess's vfork: no fork of a large, gRPC-threaded grader), else Popen(user=)."""
  if os.geteuid() != 0:
    return cmd, {}
  setpriv = SETPRIV or shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
  if setpriv:
    u = str(SANDBOX_UID)
    return [setpriv, "--reuid", u, "--regid", u, "--clear-groups", "--"] + cmd, {}
  return cmd, dict(user=SANDBOX_UID, group=SANDBOX_UID, extra_groups=[])


SETPRIV = shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
SH = shutil.which("sh", path="/usr/bin:/bin") or "/bin/sh"
# Runs (as the grader's user) just before bwrap: joins the cgroup.procs files given before "--"
# (writing 0 = this process; bwrap and everything it starts inherit the cgroups), sets its
# oom_score_adj to 1000 (with CAP_SYS_RESOURCE also the floor the program cannot go below), execs.
SPAWN_SH = ('for f; do [ "$f" = -- ] && break; echo 0 > "$f" || exit 125; shift; done; shift; '
             'echo 1000 > /proc/self/oom_score_adj 2>/dev/null; exec "$@"')
_SYS_KEYCTL = {"x86_64": 250, "aarch64": 219}.get(os.uname().machine)
_KEYCTL_GET_KEYRING_ID, _KEYCTL_JOIN_SESSION_KEYRING = 0, 1
_KEY_SPEC_SESSION_KEYRING = -3
_keyring = threading.local()


def fresh_session_keyring() -> None:
  """Makes this thread (whose creds a spawned bwrap inherits) join a new anonymous session keyring,
  again only when the thread's session keyring is no longer the one it joined here: the grader's
  own session keyring (and its keys) is then not possessed by any sandbox. Not a new one per run:
  a non-root user may hold only 200 keys (kernel.keys.maxkeys) and replaced keyrings are freed
  asynchronously. keyctl/add_key/request_key are refused inside the sandbox anyway (seccomp)."""
  if _SYS_KEYCTL is None:
    return
  libc = _libc()
  current = libc.syscall(_SYS_KEYCTL, _KEYCTL_GET_KEYRING_ID,
                         ctypes.c_long(_KEY_SPEC_SESSION_KEYRING), 0)
  if current > 0 and current == getattr(_keyring, "id", None):
    return                              # still ours (nobody on this thread joined another)
  new = libc.syscall(_SYS_KEYCTL, _KEYCTL_JOIN_SESSION_KEYRING, None)
  if new < 0:
    raise OSError(ctypes.get_errno(), "keyctl(KEYCTL_JOIN_SESSION_KEYRING) failed")
  _keyring.id = new


@functools.lru_cache(maxsize=1)
def _libc():
  return ctypes.CDLL(None, use_errno=True)
