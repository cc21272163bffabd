"""Per-sandbox cgroup memory and pids ceilings for the code sandbox (docs/SANDBOX.md).

  pool = CgroupPool.detect()          # None where this process cannot create cgroups with limits
  slot = pool.acquire(memory_bytes, pids)
  ... spawn with `slot.procs_files` (the spawner writes "0" to each before exec) ...
  oom = pool.release(slot)            # -> OOM kills in the slot during the run

Works on cgroup v1 (separate `memory` and `pids` hierarchies, as on the CI/dev machines here) and
v2 (one unified hierarchy whose `subtree_control` can enable memory and pids below this process's
cgroup, i.e. a delegated subtree). The slots live in `<own cgroup>/scalerl-sandbox/<pid>-<k>` and
are reused (a slot is returned to the pool only when no process is left in it), so a run costs a
few small writes, not a mkdir/rmdir (dying memory cgroups pinned by page cache pile up otherwise).
Slots of dead grader processes are removed at detect time.
"""
from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import threading

log = logging.getLogger(__name__)

DIR_NAME = "scalerl-sandbox"


@dataclasses.dataclass
class Slot:
  """One reusable cgroup (v2) or pair of cgroups (v1 memory + pids) holding one sandbox."""
  dirs: tuple[str, ...]                 # v1: (memory dir, pids dir); v2: (dir,)
  memory_dir: str
  pids_dir: str
  oom_before: int = 0
  limits: tuple[int, int] = (0, 0)      # (memory bytes, pids) last written

  @property
  def procs_files(self) -> tuple[str, ...]:
    """The cgroup.procs files the spawner joins (writes "0" to) before exec."""
    return tuple(os.path.join(d, "cgroup.procs") for d in self.dirs)


def _write(path: str, value: str) -> None:
  with open(path, "w") as f:
    f.write(value)


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _own_cgroups() -> dict[str, str]:
  """controller ("memory", "pids", or "" for v2) -> this process's cgroup path."""
  out = {}
  for line in _read("/proc/self/cgroup").splitlines():
    _, ctrls, path = line.split(":", 2)
    for c in ctrls.split(",") if ctrls else [""]:
      out[c] = path
  return out


def _mounts() -> dict[str, str]:
  """"memory"/"pids" (v1 hierarchies) and "" (the v2 hierarchy) -> mount point."""
  out = {}
  for line in _read("/proc/self/mountinfo").splitlines():
    pre, post = line.split(" - ", 1)
    fstype, _, opts = post.split(" ", 2)
    mnt = pre.split()[4]
    if fstype == "cgroup2":
      out.setdefault("", mnt)
    elif fstype == "cgroup":
      for c in opts.split(","):
        if c in ("memory", "pids"):
          out.setdefault(c, mnt)
  return out


class CgroupPool:
  """Reusable per-sandbox cgroups under this process's own cgroup(s)."""

  def __init__(self, version: int, bases: tuple[str, ...]):
    self.version = version
    self.bases = bases                   # v1: (memory base, pids base); v2: (base,)
    self._free: list[Slot] = []
    self._dying: list[Slot] = []         # released with processes (or pids) still charged
    self._lock = threading.Lock()
    self._ids = itertools.count()
    self.pid = os.getpid()

  def __repr__(self) -> str:
    return f"cgroup v{self.version} {','.join(self.bases)}"

  @classmethod
  def detect(cls) -> "CgroupPool | None":
    """A pool if this process can create child cgroups with memory and pids limits, else None
    (the reason is logged at debug level)."""
    try:
      own, mounts = _own_cgroups(), _mounts()
      if "memory" in mounts and "pids" in mounts and "memory" in own and "pids" in own:
        bases = tuple(os.path.join(mounts[c], own[c].lstrip("/"), DIR_NAME)
                      for c in ("memory", "pids"))
        for b in bases:
          os.makedirs(b, exist_ok=True)
        pool = cls(1, bases)
      elif "" in mounts and "" in own:
        parent = os.path.join(mounts[""], own[""].lstrip("/"))
        if not {"memory", "pids"} <= set(_read(os.path.join(parent, "cgroup.subtree_control")).split()):
          _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")  # EBUSY if it has processes
        base = os.path.join(parent, DIR_NAME)
        os.makedirs(base, exist_ok=True)
        if not {"memory", "pids"} <= set(_read(os.path.join(base, "cgroup.subtree_control")).split()):
          _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
        pool = cls(2, (base,))
      else:
        log.debug("no memory/pids cgroup hierarchy mounted")
        return None
      pool._remove_stale()
      pool.release(pool.acquire(64 << 20, 8))     # proves the limits can be written
      atexit.register(pool.remove_all)
      return pool
    except OSError as e:
      log.debug("per-sandbox cgroups unavailable: %s", e)
      return None

  def _remove_stale(self, dead_only: bool = True) -> None:
    """Removes empty slots left by grader processes that no longer exist (and, with
    dead_only=False, this process's own)."""
    me = str(os.getpid())
    for base in self.bases:
      for name in os.listdir(base):
        pid = name.split("-", 1)[0]
        if pid.isdigit() and (not os.path.exists(f"/proc/{pid}") or (pid == me and not dead_only)):
          try:
            os.rmdir(os.path.join(base, name))
          except OSError:
            pass

  def _new_slot(self) -> Slot:
    name = f"{os.getpid()}-{next(self._ids)}"
    dirs = tuple(os.path.join(b, name) for b in self.bases)
    for d in dirs:
      os.makedirs(d, exist_ok=True)
    return Slot(dirs, dirs[0], dirs[-1])

  def acquire(self, memory_bytes: int, pids: int) -> Slot:
    """A slot (reused or new) with memory ceiling `memory_bytes` (no swap) and `pids` tasks."""
    with self._lock:
      settled = [x for x in self._dying if self._idle(x)]
      for x in settled:
        self._dying.remove(x)
      self._free.extend(settled)
      slot = next((x for x in reversed(self._free) if not self._shmem(x) and self._idle(x)), None)
      if slot is not None:
        self._free.remove(slot)
    if slot is not None:
      try:
        return self._configure(slot, memory_bytes, pids)
      except OSError:                   # e.g. a lower ceiling than its charged page cache: EBUSY
        self._drop(slot)
    slot = self._new_slot()
    try:
      return self._configure(slot, memory_bytes, pids)
    except OSError:
      self._drop(slot)
      raise

  def _configure(self, slot: Slot, memory_bytes: int, pids: int) -> Slot:
    """Writes the limits (unless unchanged) and records the OOM kill count."""
    if slot.limits == (memory_bytes, pids):
      pass                            # a reused slot with the same limits: nothing to write
    elif self.version == 1:
      m = slot.memory_dir
      # memsw >= limit always: raise memsw first when growing, lower it last when shrinking
      memsw = os.path.join(m, "memory.memsw.limit_in_bytes")
      has_memsw = os.path.exists(memsw)
      for attempt in range(2):
        try:
          _write(os.path.join(m, "memory.limit_in_bytes"), str(memory_bytes))
          break
        except OSError:
          if not (has_memsw and attempt == 0):
            raise
          _write(memsw, str(memory_bytes))
      if has_memsw:
        _write(memsw, str(memory_bytes))
      _write(os.path.join(slot.pids_dir, "pids.max"), str(pids))
    else:
      d = slot.memory_dir
      _write(os.path.join(d, "memory.max"), str(memory_bytes))
      if os.path.exists(os.path.join(d, "memory.swap.max")):
        _write(os.path.join(d, "memory.swap.max"), "0")
      _write(os.path.join(d, "pids.max"), str(pids))
    slot.limits = (memory_bytes, pids)
    slot.oom_before = self.oom_kills(slot)
    return slot

  def _idle(self, slot: Slot) -> bool:
    """No process in the slot and no task charged to its pids counter. A killed sandbox's tasks
    leave cgroup.procs at exit but stay charged until reaped; a new sandbox in a slot whose
    pids.current is still near pids.max fails bwrap's clone with EAGAIN ("Creating new namespace
    failed: Resource temporarily unavailable", seen in 12-38 of 120 short-limit kills)."""
    try:
      if any(_read(f).strip() for f in slot.procs_files):
        return False
      return int(_read(os.path.join(slot.pids_dir, "pids.current")).strip() or 0) == 0
    except (OSError, ValueError):
      return False

  def _shmem(self, slot: Slot) -> int:
    """Bytes of shmem (SysV shm, memfd, tmpfs) still charged to the slot: an IPC namespace is
    freed asynchronously after its last process, so a slot is reused only once this is 0."""
    try:
      for line in _read(os.path.join(slot.memory_dir, "memory.stat")).splitlines():
        k, _, v = line.partition(" ")
        if k == "shmem":
          return int(v)
    except OSError:
      return 1
    return 0

  def oom_kills(self, slot: Slot) -> int:
    """OOM kills in this slot since it was created."""
    f = "memory.oom_control" if self.version == 1 else "memory.events"
    for line in _read(os.path.join(slot.memory_dir, f)).splitlines():
      k, _, v = line.partition(" ")
      if k == "oom_kill":
        return int(v)
    return 0

  def release(self, slot: Slot) -> int:
    """Returns the OOM kills during this use; the slot goes back to the pool, to be reused once
    it holds no process and no charged task (`_idle`)."""
    try:
      kills = self.oom_kills(slot) - slot.oom_before
    except OSError:
      return 0
    idle = self._idle(slot)
    with self._lock:                     # a dying slot is reused once its tasks are reaped
      (self._free if idle else self._dying).append(slot)
    if not idle:
      log.debug("sandbox cgroup %s still has tasks; reused once they are gone", slot.dirs[0])
    return kills

  def remove_all(self) -> None:
    """Removes this process's free slots and, if then empty, the base directories (at exit: a
    cgroup directory left behind would keep its parent cgroup from being removed)."""
    if os.getpid() != self.pid:          # a forked child: the slots are its parent's
      return
    with self._lock:
      free, self._free = self._free + self._dying, []
      self._dying = []
    for slot in free:
      self._drop(slot)
    self._remove_stale(dead_only=False)
    for base in self.bases:
      try:
        os.rmdir(base)
      except OSError:
        pass                            # another grader's slots, or a slot still in use

  def _drop(self, slot: Slot) -> None:
    for d in slot.dirs:
      try:
        os.rmdir(d)
      except OSError:
        pass
