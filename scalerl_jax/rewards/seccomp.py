"""The code sandbox's seccomp deny-list, compiled once per process to a BPF program for bwrap's
`--seccomp FD` (docs/SANDBOX.md).

  filter_bpf(allow_ipc_memory)   # -> bytes (cached); raises SeccompUnavailable

Modelled on the container runtimes' default profile (moby/docker `default.json`): the syscalls it
refuses to an unprivileged container are refused here with EPERM (never a kill, so a program sees
an ordinary error), plus io_uring (removed from docker's default in 2023), `socket()`/`socketpair()`
of any family but AF_UNIX/AF_INET/AF_INET6 (AF_VSOCK reaches the VM host and is not isolated by
the network namespace; AF_NETLINK, AF_PACKET, ...), `clone` with namespace flags and `clone3`
(ENOSYS, so glibc falls back to `clone`, as docker does). System calls of a foreign ABI (i386
`int 0x80`, x32 on x86-64) get EPERM too. Memory that RLIMIT_AS does not count (SysV shm and
message queues, memfds) is refused unless `allow_ipc_memory` (a cgroup memory ceiling holds the
sandbox: sandbox.py passes True only then).

Built with libseccomp through `pyseccomp` (ctypes; needs the system's libseccomp.so.2, Debian
package libseccomp2).
"""
from __future__ import annotations

import errno
import functools
import os

DENY = (
    # keyrings: the host's keys, and keys outlive the sandbox
    "keyctl", "add_key", "request_key",
    # kernel attack surface docker keeps from containers
    "io_uring_setup", "io_uring_enter", "io_uring_register", "userfaultfd", "perf_event_open",
    "bpf", "fanotify_init", "lookup_dcookie", "kcmp", "pidfd_getfd", "process_vm_readv",
    "process_vm_writev", "process_madvise", "ptrace", "memfd_secret", "move_pages",
    "migrate_pages",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "umount", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick", "pivot_root", "chroot", "open_by_handle_at",
    "name_to_handle_at",
    # the machine: clocks, modules, kexec, swap, quota, reboot, accounting, I/O ports, the log
    "acct", "clock_adjtime", "clock_settime", "settimeofday", "stime", "adjtimex",
    "create_module", "init_module", "finit_module", "delete_module", "get_kernel_syms",
    "query_module", "kexec_load", "kexec_file_load", "swapon", "swapoff", "quotactl",
    "quotactl_fd", "reboot", "nfsservctl", "sysfs", "_sysctl", "uselib", "ustat", "vhangup",
    "iopl", "ioperm", "syslog", "vm86", "vm86old",
)
IPC_MEMORY = ("shmget", "msgget", "memfd_create")   # refused unless a cgroup bounds the sandbox
ALLOWED_SOCKET_FAMILIES = (1, 2, 10)                # AF_UNIX, AF_INET, AF_INET6
_CLONE_NEW = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
              0x40000000)   # CLONE_NEW{NS,CGROUP,UTS,IPC,USER,PID,NET}
_ATTR_ACT_BADARCH = 2                   # SCMP_FLTATR_ACT_BADARCH
_ATTR_CTL_OPTIMIZE = 8                  # SCMP_FLTATR_CTL_OPTIMIZE (libseccomp >= 2.5): 2 = tree


class SeccompUnavailable(RuntimeError):
  """libseccomp (or its Python binding) is missing, or the filter could not be built."""


def _lib():
  try:
    import pyseccomp  # local: optional binding, a missing one is SeccompUnavailable (not an import error)
  except ImportError as e:   # the binding (requirements.txt)
    raise SeccompUnavailable(f"pyseccomp is not installed ({e}); `make venv` installs "
                             "requirements.txt") from None
  except RuntimeError as e:  # "Unable to find libseccomp"
    raise SeccompUnavailable(f"{e}: install the system library (apt-get install libseccomp2)") \
        from None
  return pyseccomp


def _deny_socket_families(f, sc, name: str, allowed: tuple[int, ...]) -> None:
  """EPERM for `name` (socket/socketpair) unless arg0 (the family) is one of `allowed`: one rule per
  gap between allowed values, plus `>= max+1` (upper 32 bits set fall there too)."""
  deny = sc.ERRNO(errno.EPERM)
  lo = 0
  for a in sorted(allowed):
    for v in range(lo, a):
      f.add_rule(deny, name, sc.Arg(0, sc.EQ, v))
    lo = a + 1
  f.add_rule(deny, name, sc.Arg(0, sc.GE, lo))


@functools.lru_cache(maxsize=2)
def filter_bpf(allow_ipc_memory: bool) -> bytes:
  """The compiled BPF program (struct sock_filter[]) of the deny-list for this machine's native
  ABI; SysV shm/msg and memfd_create are refused unless `allow_ipc_memory`."""
  sc = _lib()
  eperm = sc.ERRNO(errno.EPERM)
  try:
    f = sc.SyscallFilter(sc.ALLOW)
    f.set_attr(_ATTR_ACT_BADARCH, eperm)
    try:
      f.set_attr(_ATTR_CTL_OPTIMIZE, 2)
    except OSError:
      pass                              # libseccomp < 2.5: a linear filter, same semantics
    names = DENY + (() if allow_ipc_memory else IPC_MEMORY)
    for name in names:
      if sc.resolve_syscall(sc.Arch.NATIVE, name) == -1:   # unknown to this libseccomp
        continue
      f.add_rule(eperm, name)           # names absent on this ABI resolve < -1: a no-op rule
    _deny_socket_families(f, sc, "socket", ALLOWED_SOCKET_FAMILIES)
    _deny_socket_families(f, sc, "socketpair", (1,))
    for flag in _CLONE_NEW:
      f.add_rule(eperm, "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
    if sc.resolve_syscall(sc.Arch.NATIVE, "clone3") != -1:
      f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")   # flags hide in a struct: glibc falls back
    fd = os.memfd_create("seccomp-bpf", os.MFD_CLOEXEC)
    try:
      with os.fdopen(os.dup(fd), "wb") as w:
        f.export_bpf(w)
      os.lseek(fd, 0, os.SEEK_SET)
      chunks = []
      while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    finally:
      os.close(fd)
  except OSError as e:
    raise SeccompUnavailable(f"building the seccomp filter failed: {e}") from None
  prog = b"".join(chunks)
  if not prog or len(prog) % 8:
    raise SeccompUnavailable(f"libseccomp exported a {len(prog)}-byte filter (not sock_filter[])")
  return prog
