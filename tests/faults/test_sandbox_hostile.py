"""Hostile model-written programs graded by the code reward: each gets reward 0 with a recorded
reason, ran sandboxed, and leaves the host unchanged (sentinel files, marker files on the host,
no process left in its PID namespace, the grader's environment, a live buffer server serving).

Every program knows the host's real paths, the buffer's port and the token's variable name (the
worst case); where it could "prove" a breach by printing a secret, the expected output IS that
secret, so the sandbox leaking it would make the test fail with reward 1.
"""
import dataclasses
import hashlib
import json
import os
import time
import uuid

import numpy as np
import pytest

from scalerl_jax import rewards
from scalerl_jax.rewards import sandbox
from scalerl_jax.rewards.sandbox_setup import Limits
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.types import PromptSpec

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN_ENV = "SCALERL_BUFFER_TOKEN"
TOKEN = "hostile-test-token-" + uuid.uuid4().hex
SECRET = "checkpoint-secret-" + uuid.uuid4().hex
# Tight limits keep the suite fast and the shared machine safe (memory: <= nproc x 256 MiB).
LIMITS = Limits(memory_bytes=256 << 20, wall_s=2.0, output_bytes=1 << 20)
# Programs that must run to completion: a 2 s wall limit is what the hostile ones test, but a
# python start inside bwrap on a loaded 2-core box (load 8-12) can take longer (af_vsock failed so).
ROOMY = dataclasses.replace(LIMITS, wall_s=20.0)

ANY_FAIL = {"runtime_error", "wrong_answer", "timeout", "memory", "output_limit", "file_limit"}

# (id, program template, expected output or None = "PWNED", allowed reasons). Templates see
# {sentinel} {repo} {port} {token_env} {marker} {grader_pid} {hosttmp}.
HOSTILE = [
    ("fork_bomb", "import os\nwhile True:\n  os.fork()\n", None, {"runtime_error", "timeout"}),
    ("thread_bomb", "import threading, time\nwhile True:\n"
     "  threading.Thread(target=time.sleep, args=(60,)).start()\n", None, {"runtime_error", "timeout"}),
    ("memory_bomb", "a = []\nwhile True:\n  a.append(bytearray(16 << 20))\n", None, {"memory"}),
    ("memory_bomb_children", "import os\nfor _ in range(6):\n  if os.fork() == 0:\n"
     "    a = bytearray(200 << 20)\n    while True: pass\nos.wait()\n", None,
     {"timeout", "runtime_error", "memory"}),
    ("infinite_loop", "while True:\n  pass\n", None, {"timeout"}),
    ("cpu_loop_ignoring_signals", "import signal\nfor s in (signal.SIGXCPU, signal.SIGTERM):\n"
     "  signal.signal(s, signal.SIG_IGN)\nwhile True:\n  pass\n", None, {"timeout"}),
    ("long_sleep", "import time\ntime.sleep(3600)\nprint('PWNED')\n", None, {"timeout"}),
    ("stdout_flood_1gb", "import sys\nb = b'x' * (1 << 20)\nfor _ in range(1024):\n"
     "  sys.stdout.buffer.write(b)\n", None, {"output_limit"}),
    ("stderr_flood", "import sys\nb = b'x' * (1 << 20)\nfor _ in range(1024):\n"
     "  sys.stderr.buffer.write(b)\n", None, {"timeout", "wrong_answer"}),
    ("huge_file_write", "with open('/tmp/big', 'wb') as f:\n  for _ in range(1024):\n"
     "    f.write(b'x' * (1 << 20))\n", None, {"file_limit"}),
    ("fill_tmpfs", "for i in range(64):\n  open('/tmp/f%d' % i, 'wb').write(b'x' * (15 << 20))\n",
     None, {"runtime_error", "file_limit"}),
    ("read_workdir", "print(open('{repo}/NOTES.md').read().splitlines()[0])\n",
     "@NOTES_FIRST_LINE", {"runtime_error"}),
    ("read_checkpoint", "print(open('{sentinel}/checkpoint.msgpack').read())\n", SECRET,
     {"runtime_error"}),
    ("list_host_dirs", "import os\nprint(sorted(os.listdir('/')), os.path.exists('{repo}'),\n"
     "      os.path.exists('/etc/passwd'), os.path.exists('/root'), os.path.exists('/work'))\n",
     "@HOST_ROOT_LISTING", {"wrong_answer"}),
    ("env_token", "import os\nprint(os.environ.get('{token_env}', ''))\n", TOKEN, {"wrong_answer"}),
    ("proc_environ_token", "import os\nfound = ''\nfor p in os.listdir('/proc'):\n"
     "  for f in ('environ', 'cmdline'):\n    try:\n"
     "      d = open('/proc/%s/%s' % (p, f), 'rb').read()\n    except OSError:\n      continue\n"
     "    if b'{token_env}=' in d:\n"
     "      found = d.split(b'{token_env}=')[1].split(b'\\0')[0].decode()\nprint(found)\n",
     TOKEN, {"wrong_answer"}),
    ("proc_grader_environ", "d = open('/proc/{grader_pid}/environ', 'rb').read()\n"
     "print(d.split(b'{token_env}=')[1].split(b'\\0')[0].decode())\n", TOKEN, {"runtime_error"}),
    ("write_root", "open('/pwned-{marker}', 'w').write('x')\n", None, {"runtime_error"}),
    ("write_repo", "open('{repo}/pwned-{marker}', 'w').write('x')\n", None, {"runtime_error"}),
    ("write_host_tmp", "open('{hosttmp}/pwned-{marker}', 'w').write('x')\n"
     "open('/tmp/pwned-{marker}', 'w').write('x')\n", None, {"wrong_answer", "runtime_error"}),
    ("overwrite_checkpoint", "import os\nopen('{sentinel}/checkpoint.msgpack', 'w').write('x')\n"
     "os.remove('{sentinel}/checkpoint.msgpack')\n", None, {"runtime_error"}),
    ("connect_buffer_port", "import socket\ns = socket.create_connection(('127.0.0.1', {port}), 1)\n"
     "print('PWNED')\n", None, {"runtime_error"}),
    ("connect_outside", "import socket\ns = socket.create_connection(('192.0.2.1', 80), 1)\n"
     "print('PWNED')\n", None, {"runtime_error"}),
    ("udp_outside", "import socket\ns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
     "s.sendto(b'x', ('192.0.2.1', 53))\nprint('PWNED')\n", None, {"runtime_error"}),
    ("kill_parent_and_pid1", "import os, signal\nfor p in (os.getppid(), 1):\n  try:\n"
     "    os.kill(p, signal.SIGKILL)\n  except OSError:\n    pass\nprint('alive')\n", None,
     {"wrong_answer"}),
    ("kill_everything", "import os, signal\nfor p in [-1, {grader_pid}] + list(range(2, 5000)):\n"
     "  try:\n    os.kill(p, signal.SIGKILL)\n  except OSError:\n    pass\nprint('alive')\n", None,
     {"wrong_answer", "timeout", "runtime_error"}),
    ("ptrace_parent", "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "r = [libc.ptrace(16, p, 0, 0) for p in (os.getppid(), 1, {grader_pid})]\n"
     "print('PWNED' if 0 in r else r)\n", None, {"wrong_answer"}),
    ("setsid_double_fork_daemon", "import os, time\nif os.fork() == 0:\n  os.setsid()\n"
     "  if os.fork() == 0:\n    time.sleep(3)\n    open('/tmp/daemon-{marker}', 'w').write('x')\n"
     "    time.sleep(3600)\n  os._exit(0)\ntime.sleep(0.2)\nprint('bye')\n", None,
     {"wrong_answer"}),
    ("daemon_keeps_stdout", "import os, sys, time\nif os.fork() == 0:\n  os.setsid()\n"
     "  if os.fork() == 0:\n    while True:\n      time.sleep(0.1)\n      print('PWNED', flush=True)\n"
     "  os._exit(0)\n", None, {"wrong_answer", "timeout"}),
    ("segfault_ctypes", "import ctypes\nctypes.string_at(0)\n", None, {"runtime_error"}),
    ("subprocess_sh", "import subprocess\nr = subprocess.run(['sh', '-c', 'echo PWNED; touch "
     "{hosttmp}/sh-{marker}'], capture_output=True)\nprint(r.stdout.decode())\n", None,
     {"runtime_error"}),
    ("subprocess_python_reads_host", "import subprocess, sys\nr = subprocess.run([sys.executable, "
     "'-c', 'print(open(\"{sentinel}/checkpoint.msgpack\").read())'], capture_output=True)\n"
     "print(r.stdout.decode())\n", SECRET, {"wrong_answer"}),
    ("symlink_escape", "import os\nos.symlink('{sentinel}/checkpoint.msgpack', '/tmp/l')\n"
     "os.symlink('/proc/1/root/../../../../{sentinel}', '/tmp/d')\n"
     "for p in ('/tmp/l', '/tmp/d/checkpoint.msgpack', '/proc/self/root/../{sentinel}/checkpoint.msgpack',"
     " '/proc/1/cwd/../../{sentinel}/checkpoint.msgpack'):\n  try:\n"
     "    print(open(p).read())\n  except OSError:\n    pass\n", SECRET, {"wrong_answer"}),
    ("close_stdout_early", "import os\nos.close(1)\nprint('PWNED')\n", None,
     {"runtime_error", "wrong_answer"}),
    ("close_stdout_then_sleep", "import os, time\nos.close(1)\nos.close(2)\ntime.sleep(3600)\n",
     None, {"timeout"}),
    ("invalid_utf8_output", "import sys\nsys.stdout.buffer.write(b'\\xff\\xfe\\x80 PWN\\xc3\\n')\n",
     None, {"wrong_answer"}),
    ("nested_userns_and_mount", "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
     "r = [libc.unshare(0x10000000), libc.unshare(0x00020000),\n"
     "     libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)]\n"
     "print('PWNED' if 0 in r else r)\n", None, {"wrong_answer"}),
    ("raise_rlimits_and_setuid", "import os, resource\n"
     "resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\nos.setuid(0)\nprint('PWNED')\n", None,
     {"runtime_error"}),
    ("fd_exhaustion", "fs = [open('/dev/null') for _ in range(100000)]\nprint('PWNED')\n", None,
     {"runtime_error"}),
    ("device_access", "for p in ('/dev/mem', '/dev/kmsg', '/dev/sda', '/dev/shm/x'):\n"
     "  open(p, 'w')\nprint('PWNED')\n", None, {"runtime_error"}),
]


def _snapshot(root: str) -> dict:
  out = {}
  for d, _, files in os.walk(root):
    for f in files:
      p = os.path.join(d, f)
      with open(p, "rb") as fh:
        out[p] = hashlib.sha256(fh.read()).hexdigest()
  return out


def _pid_ns_members(inodes: set[int], started_by: float) -> list[str]:
  """Live host processes inside any of these PID namespaces that started by `started_by`
  (CLOCK_BOOTTIME seconds), as "pid state: cmdline".

  Zombies are dead (no memory, nothing runs); the host's init reaps them on its own schedule
  (measured here: every ~2 s). The start-time bound keeps out a later sandbox's processes: once
  the dead namespace is freed the kernel may hand its inode number to a new one (seen in CI: a
  concurrent worker's live launcher in a reused namespace inode)."""
  hz = os.sysconf("SC_CLK_TCK")
  left = []
  for p in os.listdir("/proc"):
    if not p.isdigit():
      continue
    try:
      if os.stat(f"/proc/{p}/ns/pid").st_ino not in inodes:
        continue
      with open(f"/proc/{p}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
      state, start = fields[0], int(fields[19]) / hz     # stat fields 3 and 22
      if state in (b"Z", b"X") or start > started_by:
        continue
      with open(f"/proc/{p}/cmdline", "rb") as f:
        left.append(f"{p} {state.decode()}: {f.read()[:200]!r}")
    except OSError:
      continue
  return left


@pytest.fixture(scope="module")
def buffer():
  prompts = [PromptSpec(i, np.array([1, 2, i], np.int32), "a") for i in range(4)]
  srv = BufferServer(prompts, token=TOKEN, port=0, prompts_per_step=2, group_size=2,
                     max_lag=1).start()
  client = BufferClient(srv.address, TOKEN)
  try:
    yield srv, client, int(srv.address.rsplit(":", 1)[1])
  finally:
    client.close()
    srv.stop()


@pytest.fixture
def recorded(monkeypatch):
  """Every RunResult code.py gets from the sandbox during the test."""
  runs = []
  real = sandbox.run_program

  def spy(*a, **kw):
    r = real(*a, **kw)
    runs.append(r)
    return r
  monkeypatch.setattr(sandbox, "run_program", spy)
  return runs


@pytest.mark.parametrize("name,template,expected,reasons", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_program(name, template, expected, reasons, buffer, recorded, tmp_path, monkeypatch):
  srv, client, port = buffer
  monkeypatch.setenv(TOKEN_ENV, TOKEN)                      # the grader holds the token
  sentinel = tmp_path / "sentinel"
  sentinel.mkdir()
  (sentinel / "checkpoint.msgpack").write_text(SECRET)
  (sentinel / "params.bin").write_bytes(os.urandom(4096))
  marker = uuid.uuid4().hex
  hosttmp = "/tmp"
  if expected == "@NOTES_FIRST_LINE":
    expected = open(os.path.join(REPO, "NOTES.md")).read().splitlines()[0]
  elif expected == "@HOST_ROOT_LISTING":
    expected = str((sorted(os.listdir("/")), True, True, True, True))
  src = template.format(sentinel=sentinel, repo=REPO, port=port, token_env=TOKEN_ENV,
                        marker=marker, grader_pid=os.getpid(), hosttmp=hosttmp)
  answer = json.dumps([{"input": "", "output": expected or "PWNED"}])
  before = _snapshot(str(sentinel))
  t0 = time.monotonic()

  g = rewards.grade_code(f"</think>\n```python\n{src}```", answer, LIMITS)

  returned = time.clock_gettime(time.CLOCK_BOOTTIME)
  elapsed = time.monotonic() - t0
  assert g.reward == 0.0, (g, src)
  assert g.reason in reasons, (g, src)
  assert g.sandboxed and recorded and all(r.sandboxed for r in recorded)
  assert elapsed < LIMITS.wall_s + 3.0                       # killed on time
  # nothing outlives the sandbox: no process left in its PID namespace
  inodes = {r.pid_ns for r in recorded if r.pid_ns}
  assert inodes, recorded
  # checked at once: the sandbox returns only after its init is dead, and the kernel kills every
  # member before a namespace's init dies
  assert _pid_ns_members(inodes, returned) == []
  # the host is unchanged
  if name == "setsid_double_fork_daemon":
    time.sleep(3.5)                                          # past the daemon's planned write
  assert _snapshot(str(sentinel)) == before
  for d in (hosttmp, REPO, "/", str(sentinel), str(tmp_path)):
    assert not [f for f in os.listdir(d) if marker in f], d
  assert os.environ[TOKEN_ENV] == TOKEN
  # the grader's own gRPC server still serves
  assert client.status().contents.current_version >= -1


def test_suite_is_big_enough():
  assert len(HOSTILE) >= 30 and len({h[0] for h in HOSTILE}) == len(HOSTILE)


# --- Holes found by the red team (issue 28): memory RLIMIT_AS does not count, the grader's
# keyring, AF_VSOCK / netlink / packet sockets, inherited rlimits, kernel interfaces. Each program
# prints what it got; on the pre-seccomp sandbox each of these tests fails.

_MACHINE = os.uname().machine
# io_uring_setup, userfaultfd, perf_event_open, bpf, fanotify_init, add_key, request_key, keyctl
_NR = {"x86_64": dict(io_uring_setup=425, userfaultfd=323, perf_event_open=298, bpf=321,
                      fanotify_init=300, add_key=248, request_key=249, keyctl=250),
       "aarch64": dict(io_uring_setup=425, userfaultfd=282, perf_event_open=241, bpf=280,
                       fanotify_init=262, add_key=217, request_key=218, keyctl=219)}.get(_MACHINE)
needs_nr = pytest.mark.skipif(_NR is None, reason=f"syscall numbers not listed for {_MACHINE}")

SHM_1GIB = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
libc.shmat.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
libc.shmdt.argtypes = [ctypes.c_void_p]
got = 0
for i in range(32):                  # 32 x 32 MiB = 1 GiB of SysV shm, each detached once touched
  sid = libc.shmget(0, 32 << 20, 0o1600)
  if sid < 0:
    break
  p = libc.shmat(sid, None, 0)
  ctypes.memset(p, 1, 32 << 20)
  libc.shmdt(p)
  got += 32
print(got)
'''
MEMFD_960MIB = r'''
import os
fds, got = [], 0
for i in range(60):                  # 60 x 16 MiB (RLIMIT_FSIZE each) = 960 MiB, never mapped
  try:
    fd = os.memfd_create("m%d" % i)
    os.ftruncate(fd, 16 << 20)
    os.posix_fallocate(fd, 0, 16 << 20)
  except OSError:
    break
  fds.append(fd)
  got += 16
print(got)
'''


def _shmem_mib() -> int:
  for line in open("/proc/meminfo"):
    if line.startswith("Shmem:"):
      return int(line.split()[1]) >> 10
  return 0


@pytest.mark.parametrize("src,full", [(SHM_1GIB, "1024"), (MEMFD_960MIB, "960")],
                         ids=["sysv_shm_1gib", "memfd_960mib"])
def test_memory_outside_rlimit_as_is_bounded(src, full):
  """SysV shm (created, touched, detached) and never-mapped memfds are not counted by RLIMIT_AS
  (256 MiB here): a cgroup ceiling kills the sandbox at 256+64+64 MiB ("memory"), or, without
  one, seccomp refuses shmget/memfd_create. Never more than the ceiling is held, nor kept."""
  shm0 = _shmem_mib()
  g = rewards.grade_code(f"</think>\n```python\n{src}```",
                         json.dumps([{"input": "", "output": full}]),
                         dataclasses.replace(LIMITS, wall_s=15.0))   # slow page faults under load
  assert g.reward == 0.0 and g.sandboxed, g
  if sandbox.cgroup_pool() is not None:
    assert g.reason == "memory", g
  else:
    assert g.reason == "wrong_answer", g          # printed 0: the first call was refused
  deadline = time.monotonic() + 10.0              # an IPC namespace is freed asynchronously
  while _shmem_mib() > shm0 + 64 and time.monotonic() < deadline:
    time.sleep(0.1)
  assert _shmem_mib() <= shm0 + 64, (shm0, _shmem_mib())


def test_shm_and_memfd_refused_without_a_cgroup_ceiling():
  s = dataclasses.replace(sandbox.settings(), cgroup="none")
  for src in (SHM_1GIB, MEMFD_960MIB):
    r = sandbox.run_program(src, limits=ROOMY, s=s)
    assert (r.status, r.stdout) == ("ok", b"0\n"), r


KEYRING = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
kid = libc.syscall({request_key}, b"user", b"scalerl-hostile", None, 0)
buf = ctypes.create_string_buffer(256)
if kid > 0:
  n = libc.syscall({keyctl}, 11, kid, buf, 256)          # KEYCTL_READ
  print(buf.raw[:max(n, 0)].decode())
else:
  r = libc.syscall({add_key}, b"user", b"planted", b"x", 1, ctypes.c_long(-3))
  print("request_key", ctypes.get_errno(), "add_key", r, ctypes.get_errno())
'''


@needs_nr
def test_grader_session_keyring_is_not_shared():
  """The grader's session keyring holds a secret; a program reading it (request_key + KEYCTL_READ)
  would print it. It must see neither the grader's keyring (a fresh one is joined) nor be able to
  use keyctl at all (seccomp: EPERM), and it must not plant keys."""
  import ctypes
  libc = ctypes.CDLL(None, use_errno=True)
  assert libc.syscall(_NR["keyctl"], 1, None) > 0                 # a keyring of the test's own
  kid = libc.syscall(_NR["add_key"], b"user", b"scalerl-hostile", SECRET.encode(), len(SECRET),
                     ctypes.c_long(-3))
  assert kid > 0, ctypes.get_errno()
  src = KEYRING.format(**_NR)
  g = rewards.grade_code(f"</think>\n```python\n{src}```",
                         json.dumps([{"input": "", "output": SECRET}]), ROOMY)
  assert g.reward == 0.0 and g.sandboxed, g
  r = sandbox.run_program(src, limits=ROOMY)
  assert r.stdout == b"request_key 1 add_key -1 1\n", r                  # EPERM, EPERM
  # without seccomp the fresh keyring alone hides the grader's key
  r = sandbox.run_program(src, limits=ROOMY,
                          s=dataclasses.replace(sandbox.settings(), seccomp=False))
  assert r.status == "ok" and SECRET.encode() not in r.stdout, r
  assert r.stdout.startswith(b"request_key 126"), r                      # ENOKEY: not found
  libc.syscall(_NR["keyctl"], 1, None)                             # drop the test's keyring


SOCKETS = r'''
import socket
out = []
for fam, typ in ({families}):
  try:
    socket.socket(fam, typ)
    out.append("open")
  except OSError as e:
    out.append(str(e.errno))
print(" ".join(out))
'''


@pytest.mark.parametrize("families", ["(40, 1),", "(16, 3), (17, 3), (17, 2)"],
                         ids=["af_vsock", "netlink_and_packet"])
def test_sockets_other_than_unix_inet_are_refused(families):
  """AF_VSOCK reaches the VM host (no network namespace isolates it); AF_NETLINK and AF_PACKET
  are kernel surfaces no program needs. socket() of any family but AF_UNIX/AF_INET/AF_INET6 is
  EPERM (1); the allowed ones still open."""
  n = families.count("(")
  g = rewards.grade_code(f"</think>\n```python\n{SOCKETS.format(families=families)}```",
                         json.dumps([{"input": "", "output": " ".join(["open"] * n)}]), ROOMY)
  assert g.reward == 0.0 and g.sandboxed, g
  r = sandbox.run_program(SOCKETS.format(families=families), limits=ROOMY)
  assert r.stdout.decode().split() == ["1"] * n, r
  r = sandbox.run_program(SOCKETS.format(families="(1, 1), (2, 1), (10, 2)"), limits=ROOMY)
  assert r.stdout == b"open open open\n", r


RLIMITS = r'''
import resource as R
print([R.getrlimit(x) for x in (R.RLIMIT_RTPRIO, R.RLIMIT_MEMLOCK, R.RLIMIT_MSGQUEUE,
                                R.RLIMIT_SIGPENDING)], open("/proc/self/oom_score_adj").read().strip())
try:
  open("/proc/self/oom_score_adj", "w").write("0")
except OSError as e:
  print("lower", e.errno)
print(open("/proc/self/oom_score_adj").read().strip())
'''


def test_rlimits_reset_and_oom_first():
  """The grader's rtprio/memlock/msgqueue/sigpending limits are not inherited (the test raises
  its RTPRIO to 50 first where it may; MEMLOCK 8 MiB, MSGQUEUE 800 KiB and SIGPENDING ~96k are
  the defaults here), and sandboxed programs are the OOM killer's first choice (1000); where the
  grader holds CAP_SYS_RESOURCE the floor is locked: the program cannot lower it."""
  import resource as R
  saved = R.getrlimit(R.RLIMIT_RTPRIO)
  try:
    R.setrlimit(R.RLIMIT_RTPRIO, (50, 50))       # needs CAP_SYS_RESOURCE (not in every container)
  except (ValueError, OSError):
    pass
  try:
    r = sandbox.run_program(RLIMITS, limits=ROOMY)
  finally:
    R.setrlimit(R.RLIMIT_RTPRIO, saved)
  lines = r.stdout.decode().splitlines()
  assert r.status == "ok" and lines[0] == "[(0, 0), (0, 0), (0, 0), (64, 64)] 1000", r
  cap_eff = int(next(l for l in open("/proc/self/status") if l.startswith("CapEff:")).split()[1], 16)
  if cap_eff >> 24 & 1:                      # CAP_SYS_RESOURCE: the spawner locked the floor
    assert lines[1:] == ["lower 13", "1000"], r                            # EACCES


KERNEL_IFACES = r'''
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
out = []
for nr, args in (({io_uring_setup}, (0, 0)), ({userfaultfd}, (1,)), ({perf_event_open}, (0, 0, -1, -1, 0)),
                 ({bpf}, (0, 0, 0)), ({fanotify_init}, (0x200, 0))):   # UFFD_USER_MODE_ONLY, FAN_REPORT_FID
  r = libc.syscall(nr, *args)
  out.append(str(ctypes.get_errno()) if r < 0 else "open")
print(" ".join(out))
'''


@needs_nr
def test_kernel_interfaces_are_refused():
  """io_uring, userfaultfd, perf_event_open, bpf, fanotify: reachable from an unprivileged user
  namespace (EFAULT/EINVAL = the kernel parsed the call), refused by seccomp with EPERM (1)."""
  r = sandbox.run_program(KERNEL_IFACES.format(**_NR), limits=ROOMY)
  assert r.status == "ok" and r.stdout == b"1 1 1 1 1\n", r

# ==================================================================================================
# Gaming the comparison (issue #28). Programs that run cleanly but try to pass without the right
# output by exploiting how outputs are compared (scalerl_jax/rewards/code.py::outputs_match and
# json_equal; rules in docs/SANDBOX.md "How outputs are compared"). Kept apart from the sandbox
# tests above. EXPLOITS got reward 1.0 from the comparison before issue #28 (checked against the
# old code); GUARDS were already rejected and stay so; HONEST are correct programs in unusual but
# legitimate formats that must keep passing.
# ==================================================================================================

def _stdin_tests(*outputs):
  return [{"input": "", "output": o} for o in outputs]


def _fn_tests(*outputs):
  return {"fn_name": "f", "tests": [{"input": "0", "output": o, "testtype": "functional"}
                                    for o in outputs]}


# (id, program, answer (tests), expected reason after the fix)
EXPLOITS = [
    # float('nan') compared with `abs(x - y) > tol` is never "too far": nan passed every number
    ("nan_for_every_number", "print('nan')\n", _stdin_tests("3\n", "-17\n", "2.5\n"),
     "wrong_answer"),
    ("nan_spellings", "print('-NaN +nan NAN')\n", _stdin_tests("1 2 3\n"), "wrong_answer"),
    ("nan_against_inf", "print('nan')\n", _stdin_tests("inf\n"), "wrong_answer"),
    ("infinity_against_inf", "print('Infinity')\n", _stdin_tests("inf\n"), "wrong_answer"),
    ("overflowing_exponent_against_inf", "print('1e999')\n", _stdin_tests("inf\n"), "wrong_answer"),
    # relative tolerance on integers: answers mod 1e9+7 were accepted up to ~1000 off
    ("integer_off_by_999", "print(999999000)\n", _stdin_tests("999999999\n"), "wrong_answer"),
    ("integer_beyond_float_precision", "print(12345678901234567890)\n",
     _stdin_tests("12345678901234567891\n"), "wrong_answer"),
    ("almost_zero_for_zero", "print('0.0000001')\n", _stdin_tests("0\n"), "wrong_answer"),
    # float() parses forms that are not the expected token's text
    ("leading_zeros_dropped", "print('11 7')\n", _stdin_tests("0011 007\n"), "wrong_answer"),
    ("unicode_digits", "print('\\u0663')\n", _stdin_tests("3\n"), "wrong_answer"),
    ("underscore_digits", "print('1_000')\n", _stdin_tests("1000\n"), "wrong_answer"),
    ("leading_plus", "print('+5')\n", _stdin_tests("5\n"), "wrong_answer"),
    # str.split() splits on Unicode spaces: an expected 'x<NBSP>y' token was matched by 'x y'
    ("unicode_space_splits_expected_token", "print('x y')\n", _stdin_tests("x\u00a0y\n"),
     "wrong_answer"),
    # decode('utf-8', 'replace') maps any invalid byte onto an expected U+FFFD
    ("invalid_utf8_as_replacement_char", "import sys\nsys.stdout.buffer.write(b'\\xff\\n')\n",
     _stdin_tests("\ufffd\n"), "wrong_answer"),
    # functional: Python's == has True == 1 and False == 0
    ("bool_for_int", "def f(x):\n  return True\n", _fn_tests("1"), "wrong_answer"),
    ("bool_for_zero_in_list", "def f(x):\n  return [False, True]\n", _fn_tests("[0, 1]"),
     "wrong_answer"),
    # functional: the program owns the interpreter, so it can print any text as its "JSON"
    ("overflowing_float_for_infinity", "import json\njson.dumps = lambda v: '1e999'\n"
     "def f(x):\n  return 0\n", _fn_tests("Infinity"), "wrong_answer"),
    # functional: json.loads raised RecursionError out of grade_code (it must never raise)
    ("deeply_nested_json", "import json\njson.dumps = lambda v: '[' * 5000 + ']' * 5000\n"
     "def f(x):\n  return 0\n", _fn_tests("[]"), "wrong_answer"),
    # tests that expect nothing: a program that does nothing passed them
    ("empty_program_on_empty_outputs", "pass\n", _stdin_tests("", "\n", "  \n"), "trivial_tests"),
    ("none_on_null_outputs", "def f(x):\n  pass\n", _fn_tests("null", "null"), "trivial_tests"),
]

GUARDS = [
    ("hex_number", "print('0x10')\n", _stdin_tests("16\n"), "wrong_answer"),
    ("trailing_token", "print(3, 'junk')\n", _stdin_tests("3\n"), "wrong_answer"),
    ("missing_token", "print(3)\n", _stdin_tests("3 4\n"), "wrong_answer"),
    ("empty_output", "pass\n", _stdin_tests("3\n"), "wrong_answer"),
    ("whitespace_only_output", "print('   ')\n", _stdin_tests("3\n"), "wrong_answer"),
    ("bool_text_for_number", "print('True')\n", _stdin_tests("1\n"), "wrong_answer"),
    ("inf_for_big_number", "print('inf')\n", _stdin_tests("1e308\n"), "wrong_answer"),
    ("number_for_text", "print(0)\n", _stdin_tests("NO\n"), "wrong_answer"),
    ("wrong_case", "print('yes')\n", _stdin_tests("YES\n"), "wrong_answer"),
    ("mixed_tokens_swapped", "print('abc 1')\n", _stdin_tests("1 abc\n"), "wrong_answer"),
    ("functional_nan_for_number", "def f(x):\n  return float('nan')\n", _fn_tests("1.5"),
     "wrong_answer"),
    ("functional_extra_output", "print(1)\ndef f(x):\n  return 1\n", _fn_tests("1"),
     "wrong_answer"),
]

HONEST = [
    ("float_more_digits", "print(1/3)\n", _stdin_tests("0.3333333333\n")),
    ("float_for_integer_value", "print('2.000 2e0 1E+3')\n", _stdin_tests("2 2 1000\n")),
    ("fraction_within_1e-6", "print(2.5000001)\n", _stdin_tests("2.5\n")),
    ("negative_zero", "print('-0 -0.0')\n", _stdin_tests("0 0.0\n")),
    ("layout_differs", "print('1\\t2\\r\\n3   ')\n", _stdin_tests("1 2\n3\n")),
    ("same_literal_non_finite", "print('nan inf -inf')\n", _stdin_tests("nan inf -inf\n")),
    ("mixed_text_and_numbers", "print('Case #1: 0.50 YES')\n", _stdin_tests("Case #1: 0.5 YES\n")),
    ("some_tests_empty", "n = int(input())\nif n:\n  print(n)\n",
     [{"input": "0\n", "output": ""}, {"input": "5\n", "output": "5\n"}]),
    ("functional_float_for_int", "def f(x):\n  return [2.0, {'b': None, 'a': 'x'}]\n",
     _fn_tests('[2, {"a": "x", "b": null}]')),
    ("functional_same_non_finite", "def f(x):\n  return [float('nan'), float('inf')]\n",
     _fn_tests("[NaN, Infinity]")),
]


def _grade(program, tests):
  return rewards.grade_code(f"</think>\n```python\n{program}```", json.dumps(tests), LIMITS)


@pytest.mark.parametrize("name,program,tests,reason", EXPLOITS + GUARDS,
                         ids=[e[0] for e in EXPLOITS + GUARDS])
def test_gaming_the_comparison_gets_no_reward(name, program, tests, reason):
  g = _grade(program, tests)
  assert (g.reward, g.reason) == (0.0, reason), g


@pytest.mark.parametrize("name,program,tests", HONEST, ids=[h[0] for h in HONEST])
def test_honest_output_formats_still_pass(name, program, tests):
  g = _grade(program, tests)
  assert (g.reward, g.reason, g.sandboxed) == (1.0, "pass", True), g


def test_comparison_rules_without_a_sandbox():
  """The same rules on the pure functions (no program run): tolerance edges and sizes."""
  from scalerl_jax.rewards.code import outputs_match, json_equal
  assert outputs_match("1.000001", "1.0") and not outputs_match("1.0000011", "1.0")
  assert outputs_match("1000000.5", "1000000.0") and not outputs_match("1000000.5", "1000000")
  assert not outputs_match("1e99999999999999999999999", "1")          # Decimal cannot hold it
  assert outputs_match("1e999 -1e-999", "1e999 -1e-999")
  assert outputs_match("", " \n\t") and not outputs_match("\u00a0", "")
  big = " ".join(str(i) for i in range(200000))
  assert outputs_match(big + "\n", big) and not outputs_match(big + " 0", big)
  assert json_equal(2, 2) and not json_equal(True, 1) and not json_equal(1, True)
