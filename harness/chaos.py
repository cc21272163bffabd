"""Chaos harness: a tiny run with random faults, then its invariants checked from its files.

  python -m harness.chaos --config=configs/tiny.py --minutes M --seed S --workdir DIR \
      [--total-steps N] [--faults N] [--pairs N] [--config.KEY=VALUE ...]

Runs `python -m scalerl_jax.main` (2 JAX generators, `config.resume=auto`) in DIR/run and, at times
drawn from the seed over --minutes (or at the matching step of the first 3/4 of --total-steps,
whichever comes first: a fast machine still gets every fault), injects (docs/RELIABILITY.md
"Chaos runs"):

  kill_generator     kill -9 of a generator worker (the run's supervisor restarts it)
  kill_buffer        kill -9 of the buffer (the supervisor restarts it from its WAL, same port)
  kill_learner       kill -9 of the main process; the harness reruns the same command (resume)
  stop_generator     SIGSTOP of a generator for lease TTL + 3 s, then SIGCONT (its leases expire)
  drop_connection    every generator <-> buffer TCP connection cut mid-stream: generators dial the
                     buffer through a loopback proxy the harness owns (`buffer.generator_address`)
  disk_full          DIR/run is a size-limited tmpfs (root) filled up as a checkpoint save starts;
                     freed once the learner exits (then the same command again) or after 20 s
  corrupt_checkpoint 16 bytes flipped in the newest finished checkpoint, then kill -9 of the
                     learner: the rerun must fall back to the previous checkpoint
  hostile_answer, sigterm (opt-in, by --kinds): harness/chaos_faults.py

`--pairs` of the faults are overlapping pairs: the second fault of a pair is injected while the
first is still in effect (its window: until the killed process is back, the stopped one continued,
the proxy saw a new connection, the disk was freed). Everything is bounded: the fault count, each
wait (a fault whose target does not appear within --target-wait-s is skipped and counted), the run's wall
time (minutes + 15 min), the number of reruns. Only loopback ports and processes it started.

After the run the harness checks (tools/audit.py, from the buffer's WAL incl. its archive, the
learner's checkpoints, trained_ids.jsonl, metrics.jsonl and resumes.jsonl) and prints each
invariant, then ONE JSON line last: {"faults": {kind: n}, "invariants": {name: bool}, ...}.
Exit status 1 when an invariant fails.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

from harness import chaos_faults
from harness.procs import alive, argv, descendants, free_port, proc_stat, wait_until
from scalerl_jax.tools import audit as auditmod

KINDS = ("kill_generator", "kill_buffer", "kill_learner", "stop_generator", "drop_connection",
         "disk_full", "corrupt_checkpoint")
# A pair's first fault is the one that lasts (its window is open when the second lands); faults
# that end the learner's process tree go second.
_ORDER = {"stop_generator": 0, "disk_full": 1, "kill_buffer": 2, "kill_generator": 3,
          "drop_connection": 4, "kill_learner": 5, "corrupt_checkpoint": 6, **chaos_faults.ORDER}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Proxy:
  """Loopback TCP proxy between the generators and the buffer; `cut()` drops every connection."""

  def __init__(self, listen_port: int, target_port: int):
    self.target = ("127.0.0.1", target_port)
    self.sock = socket.socket()
    self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self.sock.bind(("127.0.0.1", listen_port))
    self.sock.listen(128)
    self.conns: set = set()
    self.lock = threading.Lock()
    self.accepted = 0
    self.last_accept = 0.0
    self.closed = False
    threading.Thread(target=self._accept, daemon=True, name="proxy").start()

  def _accept(self) -> None:
    while not self.closed:
      try:
        c, _ = self.sock.accept()
      except OSError:
        return
      try:
        u = socket.create_connection(self.target, timeout=5)
        u.settimeout(None)
      except OSError:
        c.close()
        continue
      for s in (c, u):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      with self.lock:
        self.conns.update((c, u))
        self.accepted += 1
        self.last_accept = time.time()
      for a, b in ((c, u), (u, c)):
        threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

  def _pump(self, a, b) -> None:
    try:
      while True:
        d = a.recv(1 << 16)
        if not d:
          break
        b.sendall(d)
    except OSError:
      pass
    for s in (a, b):
      try:
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      s.close()
      with self.lock:
        self.conns.discard(s)

  def cut(self) -> int:
    """Resets every open connection (SO_LINGER 0: RST, like a dropped link); returns how many."""
    with self.lock:
      conns = list(self.conns)
      self.conns.clear()
    for s in conns:
      try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      try:
        s.close()
      except OSError:
        pass
    return len(conns) // 2

  def close(self) -> None:
    self.closed = True
    self.sock.close()
    self.cut()


# ---- processes ---------------------------------------------------------------------------------
def _module_procs(root_pid: int, module: str) -> list[int]:
  """Descendants running `python -m module` (not their launcher-forked reapers)."""
  out = []
  for p in descendants(root_pid):
    a = argv(p)
    if len(a) > 2 and a[1] == "-m" and a[2] == module and alive(p):
      out.append(p)
  return out


def overlaps(faults: list[dict]) -> list[list]:
  """Pairs of faults in effect at once: fault j injected while fault i's window was still open
  (t_i <= t_j < t_i + window_i; a window still open at the end counts to the end)."""
  out = []
  for i, a in enumerate(faults):
    end = a["t"] + a.get("window_s", float("inf"))
    for b in faults[i + 1:]:
      if a["t"] <= b["t"] < end:
        out.append([a["kind"], b["kind"], a["t"], b["t"]])
  return out


# ---- the harness -------------------------------------------------------------------------------
class Chaos:

  def __init__(self, a, overrides: list[str]):
    self.a = a
    self.rng = random.Random(a.seed)
    self.kinds = tuple(a.kinds.split(",")) if a.kinds else KINDS
    unknown = set(self.kinds) - set(KINDS + chaos_faults.KINDS)
    if unknown:
      raise SystemExit(f"error: unknown fault kinds {sorted(unknown)}; known: "
                       f"{', '.join(KINDS + chaos_faults.KINDS)}")
    self.dir = os.path.abspath(a.workdir)
    self.run_dir = os.path.join(self.dir, "run")
    os.makedirs(self.run_dir, exist_ok=True)
    self.tmpfs = False
    if a.tmpfs_mb > 0 and os.geteuid() == 0 and not os.path.ismount(self.run_dir):
      r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={a.tmpfs_mb}m", "tmpfs",
                          self.run_dir], capture_output=True, text=True)
      self.tmpfs = r.returncode == 0
      if not self.tmpfs:
        self.log(f"no tmpfs ({r.stderr.strip()}): disk_full faults are skipped")
    self.buffer_port, proxy_port = free_port(), free_port()
    self.proxy = Proxy(proxy_port, self.buffer_port)
    self.cmd = [sys.executable, "-m", "scalerl_jax.main", f"--config={a.config}",
                f"--workdir={self.run_dir}", f"--config.total_steps={a.total_steps}",
                "--config.generator.num_workers=2", "--config.generator.backend=jax",
                f"--config.buffer.address=127.0.0.1:{self.buffer_port}",
                f"--config.buffer.generator_address=127.0.0.1:{proxy_port}",
                "--config.audit.trained_ids=True", "--config.audit.wal_archive=True",
                "--config.generator.max_restarts=100000", "--config.buffer.max_restarts=100000",
                f"--config.buffer.lease_ttl_s={a.lease_ttl_s}", "--config.generator.heartbeat_s=1",
                f"--config.checkpoint.every_steps={a.checkpoint_every}",
                "--config.checkpoint.keep=3", "--config.resume=auto",
                "--config.sft.clean_steps=20", "--config.sft.steps=10",
                "--config.eval.every_steps=100000", "--config.eval.samples_per_prompt=1",
                "--config.data.heldout=8", "--config.forecast.enabled=False",
                *chaos_faults.run_overrides(self.kinds, self.dir, self.run_dir)] + overrides
    # A persistent XLA compilation cache (outside the tmpfs): a rerun loads the learner's and the
    # samplers' executables instead of compiling them again (~50 s each on a busy 2-core box).
    self.env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                "SCALERL_CHILD_GRACE_S": "3",
                "JAX_COMPILATION_CACHE_DIR": os.path.join(self.dir, "jax_cache"),
                "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5"}
    self.learner: subprocess.Popen | None = None
    self.learner_t0 = 0.0
    self.runs = 0
    self.exits: list[dict] = []
    self.seen_pids: set[int] = set()
    self.faults: list[dict] = []
    self.skipped: dict[str, int] = {}
    self.t0 = time.time()
    self.filler = os.path.join(self.run_dir, ".chaos_filler")
    self.planned_kill = False      # the learner's next exit is one the harness caused
    self.disk_full_run = 0         # the learner run that saw the last disk_full fault

  def log(self, msg: str) -> None:
    t = time.time() - getattr(self, "t0", time.time())
    line = f"[chaos {int(t) // 60:02d}:{int(t) % 60:02d}] {msg}"
    print(line, flush=True)
    with open(os.path.join(self.dir, "chaos.log"), "a") as f:
      f.write(line + "\n")

  # -- the learner ---------------------------------------------------------------------------------
  def start_learner(self) -> None:
    self.runs += 1
    out = open(os.path.join(self.dir, f"learner-{self.runs:03d}.log"), "wb")
    self.learner = subprocess.Popen(self.cmd, cwd=ROOT, env=self.env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    self.learner_t0 = time.time()
    out.close()
    self.seen_pids.add(self.learner.pid)
    self.log(f"learner run {self.runs} started (pid {self.learner.pid})")

  def track(self) -> None:
    if self.learner is not None and self.learner.poll() is None:
      self.seen_pids.update(descendants(self.learner.pid))

  def wait_tree_gone(self, pids, timeout_s: float = 60.0) -> list[int]:
    wait_until(lambda: not any(alive(p) for p in pids), timeout_s, interval_s=0.1,
               raise_on_timeout=False)
    return [p for p in pids if alive(p)]

  def _last_train(self) -> dict:
    try:
      lines = open(os.path.join(self.run_dir, "metrics.jsonl")).read().splitlines()
    except OSError:
      return {}
    for l in reversed(lines):
      try:
        rec = json.loads(l)
      except ValueError:
        continue
      if rec.get("kind") == "train":
        return rec
    return {}

  def step(self) -> int:
    return int(self._last_train().get("step", 0))

  def stepping(self) -> bool:
    """The current learner run has trained a step (so every fault leaves progress between)."""
    return float(self._last_train().get("time", 0.0)) > self.learner_t0

  def valid_checkpoints(self) -> list[int]:
    d = os.path.join(self.run_dir, "checkpoints")
    try:
      return sorted(int(n) for n in os.listdir(d)
                    if n.isdigit() and os.path.exists(os.path.join(d, n, "manifest.json")))
    except OSError:
      return []

  def saving(self) -> bool:
    d = os.path.join(self.run_dir, "checkpoints")
    try:
      return any(".orbax-checkpoint-tmp" in n for n in os.listdir(d))
    except OSError:
      return False

  # -- faults --------------------------------------------------------------------------------------
  def _wait_for(self, cond, timeout_s: float = 120.0):
    end = time.time() + timeout_s
    while time.time() < end:
      self.service()
      v = cond()
      if v:
        return v
      time.sleep(0.05)
    return None

  def _gens(self):
    return (_module_procs(self.learner.pid, "scalerl_jax.generation.worker")
            if self.learner is not None and self.learner.poll() is None else [])

  def _buffer(self):
    return (_module_procs(self.learner.pid, "scalerl_jax.buffer.server")
            if self.learner is not None and self.learner.poll() is None else [])

  def ready(self, kind: str):
    """The fault's target, once it exists (None: not yet)."""
    if kind in chaos_faults.KINDS:
      return chaos_faults.ready(self, kind)
    if self.learner is None or self.learner.poll() is not None or not self.stepping():
      return None
    ck = self.valid_checkpoints()
    if kind in ("kill_generator", "stop_generator"):
      g = [p for p in self._gens() if proc_stat(p) and proc_stat(p)[0] != "T"]
      return sorted(g)[self.rng.randrange(len(g))] if g else None
    if kind == "kill_buffer":
      b = self._buffer()
      return b[0] if b else None
    if kind == "drop_connection":
      return True if self.proxy.conns else None
    if kind == "kill_learner":   # not before checkpoint 1: an earlier kill would start over
      return True if ck else None
    if kind == "corrupt_checkpoint":   # the fallback needs a previous valid checkpoint
      return ck[-1] if len(ck) >= 2 else None
    if kind == "disk_full":
      return True if self.tmpfs and ck else None
    raise ValueError(kind)

  def inject(self, kind: str, target) -> dict:
    """Injects one fault; returns its record with a `window_end` callable."""
    now = time.time()
    f = dict(kind=kind, t=round(now - self.t0, 1), step=self.step(), learner_run=self.runs)
    if kind in chaos_faults.KINDS:
      return chaos_faults.inject(self, kind, target, f)
    if kind == "kill_generator":
      os.kill(target, signal.SIGKILL)
      f["pid"] = target
      f["_end"] = lambda: len(set(self._gens()) - {target}) >= 2   # a replacement runs
    elif kind == "kill_buffer":
      os.kill(target, signal.SIGKILL)
      f["pid"] = target
      f["_end"] = lambda: bool(set(self._buffer()) - {target})
    elif kind == "stop_generator":
      os.kill(target, signal.SIGSTOP)
      hold = self.a.lease_ttl_s + 3.0
      f.update(pid=target, stopped_s=hold)
      self.timers.append((now + hold, lambda: self._cont(target)))
      f["_end"] = lambda: not alive(target) or (proc_stat(target) or ["T"])[0] != "T"
    elif kind == "drop_connection":
      f["connections"] = self.proxy.cut()
      f["_end"] = lambda: self.proxy.last_accept > now
    elif kind in ("kill_learner", "corrupt_checkpoint"):
      if kind == "corrupt_checkpoint":
        f["checkpoint"] = target
        f["file"] = self._corrupt(target)
      self._kill_learner()
      run = self.runs
      f["_end"] = lambda: self.runs > run and self.learner.poll() is None and bool(self._buffer())
    elif kind == "disk_full":
      saw = self._wait_for(self.saving, timeout_s=30.0)
      f["during_save"] = bool(saw)
      f["filled_bytes"] = self._fill()
      self.disk_full_run = self.runs      # this learner run's exit, whenever it comes, is the fault's
      run = self.runs
      self.timers.append((time.time() + 20.0, self._free))
      f["_end"] = lambda: not os.path.exists(self.filler)
      f["t"] = round(time.time() - self.t0, 1)
    return f

  def _cont(self, pid: int) -> None:
    try:
      os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
      pass

  def _corrupt(self, step: int) -> str:
    d = os.path.join(self.run_dir, "checkpoints", str(step), "state")
    files = [os.path.join(r, n) for r, _, fs in os.walk(d) for n in fs]
    big = max(files, key=os.path.getsize)
    with open(big, "r+b") as fh:
      fh.seek(os.path.getsize(big) // 2)
      chunk = fh.read(16)
      fh.seek(-len(chunk), 1)
      fh.write(bytes(x ^ 0xFF for x in chunk))
    return os.path.relpath(big, os.path.join(self.run_dir, "checkpoints", str(step)))

  def _kill_learner(self) -> None:
    if self.learner is not None and self.learner.poll() is None:
      self.seen_pids.update(descendants(self.learner.pid))
      self.planned_kill = True
      os.kill(self.learner.pid, signal.SIGKILL)
      self.learner.wait()      # no later fault of the same moment picks a process of this tree

  def _fill(self) -> int:
    """Grows the filler file over every free block (again each loop while the fault lasts: orbax
    deleting an old checkpoint frees space). Returns the bytes added."""
    added = 0
    try:
      fd = os.open(self.filler, os.O_CREAT | os.O_WRONLY, 0o600)
    except OSError:
      return 0
    try:
      size = os.fstat(fd).st_size
      st = os.statvfs(self.run_dir)
      n = st.f_bavail * st.f_frsize
      if n > 0:
        try:
          os.posix_fallocate(fd, size, n)
          added = n
        except OSError:
          pass
      os.lseek(fd, 0, os.SEEK_END)
      block = b"\0" * 4096
      while True:                     # whatever fallocate left: until ENOSPC
        try:
          if os.write(fd, block) <= 0:
            break
          added += 4096
        except OSError:
          break
    finally:
      os.close(fd)
    return added

  def _free(self) -> None:
    if os.path.exists(self.filler):
      os.remove(self.filler)
      self.log("disk space freed")

  # -- the loop ------------------------------------------------------------------------------------
  def service(self) -> None:
    """Timers (SIGCONT, freeing the disk) and the rerun of a learner that exited."""
    now = time.time()
    if os.path.exists(self.filler):
      self._fill()
    for t, fn in [x for x in self.timers if x[0] <= now]:
      self.timers.remove((t, fn))
      fn()
    self.track()
    for f in self.faults:
      if f.get("_end") is not None and f["_end"]():
        f["window_s"] = round(time.time() - self.t0 - f["t"], 1)
        f["_end"] = None
    if self.learner is not None and self.learner.poll() is not None and not self.finished:
      rc = self.learner.returncode
      kids = [p for p in self.seen_pids if p != self.learner.pid and alive(p)]
      ex = dict(run=self.runs, returncode=rc, step=self.step(), planned=self.planned_kill,
                disk_full=os.path.exists(self.filler) or self.disk_full_run == self.runs,
                t=round(now - self.t0, 1))
      tail = open(os.path.join(self.dir, f"learner-{self.runs:03d}.log"), "rb").read()[-20000:]
      for cause in ("CheckpointError", "No space left on device", "OSError", "RuntimeError"):
        if cause.encode() in tail:
          ex["cause"] = cause
          break
      self.exits.append(ex)
      if rc == 0 and self.step() >= self.a.total_steps:
        self.finished = True
        self.log(f"learner run {self.runs} finished: step {self.step()}")
        return
      if not ex["planned"] and not ex["disk_full"]:
        tail = open(os.path.join(self.dir, f"learner-{self.runs:03d}.log"), "rb").read()[-1500:]
        self.log(f"learner run {self.runs} exited with {rc} unexpectedly at step {ex['step']}: "
                 f"...{tail.decode(errors='replace')[-600:]}")
      else:
        self.log(f"learner run {self.runs} exited ({rc}) at step {ex['step']}"
                 f"{' (disk full)' if ex['disk_full'] else ''}"
                 f"{' ' + ex['cause'] if rc != -9 and ex.get('cause') else ''}")
      self.planned_kill = False
      left = self.wait_tree_gone(kids, 60.0)
      if left:
        self.log(f"children still alive 60 s after the learner died: {left}")
      self._free()
      if self.runs >= self.a.max_runs:
        raise RuntimeError(f"gave up after {self.runs} learner runs")
      self.start_learner()

  def plan(self) -> list[tuple[float, int, list[str]]]:
    """The seeded fault events: (time after start in s, step, kinds); see `due`."""
    n, pairs = self.a.faults, self.a.pairs
    kinds = [self.kinds[i % len(self.kinds)] for i in range(n)]
    self.rng.shuffle(kinds)
    events, i = [], 0
    pair_idx = set(self.rng.sample(range(n - pairs), pairs)) if n > pairs else set()
    slots = n - pairs
    for j in range(slots):
      if j in pair_idx and i + 1 < n:
        a, b = kinds[i], kinds[i + 1]
        ends = ("kill_learner", "corrupt_checkpoint")
        if a == b or (a in ends and b in ends):   # swap the second with a later kind that fits
          for m in range(i + 2, n):
            if kinds[m] != a and not (a in ends and kinds[m] in ends):
              kinds[i + 1], kinds[m] = kinds[m], kinds[i + 1]
              break
          b = kinds[i + 1]
        events.append(sorted([a, b], key=_ORDER.get))
        i += 2
      elif i < n:
        events.append([kinds[i]])
        i += 1
    span = self.a.minutes * 60.0
    start = min(self.a.warmup_s, span / 4)
    times = sorted(self.rng.uniform(start, span) for _ in events)
    # The same place as a step: an event is due at its time or once the run reaches its step,
    # whichever comes first, so a machine that trains faster than --minutes foresaw still gets
    # every fault before the last step (the steps end at 3/4 of total_steps).
    last = max(1, (3 * self.a.total_steps) // 4)
    steps = [max(1, int(round((t - start) / max(span - start, 1e-9) * last))) for t in times]
    return list(zip(times, steps, events))

  def due(self, event) -> bool:
    """The event's time has come, or the run has reached its step."""
    t, step, _ = event
    return time.time() - self.t0 >= t or self.step() >= step

  def run(self) -> int:
    self.timers: list = []
    self.finished = False
    plan = self.plan()
    with open(os.path.join(self.dir, "plan.json"), "w") as fh:
      json.dump([dict(t=round(t, 1), step=st, kinds=k) for t, st, k in plan], fh)
    self.log(f"plan: {sum(len(k) for *_, k in plan)} faults in {len(plan)} events over "
             f"{self.a.minutes} min or by step {plan[-1][1] if plan else 0}, whichever comes "
             f"first ({sum(len(k) == 2 for *_, k in plan)} pairs); total_steps "
             f"{self.a.total_steps}; buffer :{self.buffer_port}, generators dial the proxy")
    self.start_learner()
    deadline = self.t0 + self.a.minutes * 60.0 + self.a.grace_min * 60.0
    last_log = 0.0
    ok_end = True
    try:
      while not self.finished:
        if time.time() > deadline:
          self.log("deadline passed before the run finished")
          ok_end = False
          break
        self.service()
        if plan and self.due(plan[0]) and not os.path.exists(self.filler):
          # (a full disk is left alone until freed: its own failure path, not another fault's)
          *_, kinds = plan.pop(0)
          self.fire(kinds)
        if time.time() - last_log > 15:
          last_log = time.time()
          by = {}
          for f in self.faults:
            by[f["kind"]] = by.get(f["kind"], 0) + 1
          self.log(f"step {self.step()}/{self.a.total_steps}, learner run {self.runs}, "
                   f"{len(self.faults)} faults {json.dumps(by)}, {len(plan)} events left")
        time.sleep(0.05)
    finally:
      self.stop_all()
    for k in [k for *_, ks in plan for k in ks]:
      self.skipped[k] = self.skipped.get(k, 0) + 1
    return self.report(ok_end)

  def fire(self, kinds: list[str]) -> None:
    first = None
    for j, kind in enumerate(kinds):
      target = self._wait_for(lambda kind=kind: self.ready(kind), self.a.target_wait_s)
      if target is None:
        self.skipped[kind] = self.skipped.get(kind, 0) + 1
        self.log(f"skipped {kind}: no target within {self.a.target_wait_s:.0f} s")
        continue
      if j == 1 and first is not None:
        time.sleep(self.rng.uniform(0.1, 0.5))
        self.service()
      f = self.inject(kind, target)
      self.faults.append(f)
      if j == 0:
        first = f
      else:
        f["paired_with"] = len(self.faults) - 2
        f["overlapping"] = first.get("_end") is not None   # the first one's window still open
      self.log(f"fault {len(self.faults)}: {kind} "
               + json.dumps({k: v for k, v in f.items() if not k.startswith("_")}))

  def stop_all(self) -> None:
    self._free()
    for _t, fn in list(self.timers):
      if fn != self._free:
        fn()
    self.timers = []
    if self.learner is not None and self.learner.poll() is None:
      self.seen_pids.update(descendants(self.learner.pid))
      os.killpg(self.learner.pid, signal.SIGTERM)
      try:
        self.learner.wait(60)
      except subprocess.TimeoutExpired:
        os.killpg(self.learner.pid, signal.SIGKILL)
        self.learner.wait()
    self.proxy.close()

  def report(self, ok_end: bool) -> int:
    left = self.wait_tree_gone(list(self.seen_pids), 30.0)
    res = auditmod.audit(self.run_dir, total_steps=self.a.total_steps)
    inv = dict(res["invariants"])
    inv["no_process_left_running"] = not left
    res["details"]["no_process_left_running"] = (
        f"{len(self.seen_pids)} processes started, alive now: {left}")
    inv["run_reaches_total_steps"] = inv["run_reaches_total_steps"] and ok_end and self.finished
    more, why = chaos_faults.invariants(self)
    inv.update(more)
    res["details"].update(why)
    by, overlapping = {}, 0
    for f in self.faults:
      by[f["kind"]] = by.get(f["kind"], 0) + 1
      overlapping += bool(f.get("overlapping"))
    concurrent = overlaps(self.faults)
    self.log("faults injected:")
    for k in KINDS + tuple(k for k in chaos_faults.KINDS if k in self.kinds):
      self.log(f"  {k:20s} {by.get(k, 0)}  (skipped {self.skipped.get(k, 0)})")
    self.log(f"  overlapping pairs    {overlapping} planned; {len(concurrent)} pairs of faults in "
             f"effect at once in all")
    self.log("invariants:")
    for k, v in inv.items():
      self.log(f"  {'PASS' if v else 'FAIL'}  {k}: {res['details'][k]}")
    summary = dict(faults=by, invariants=inv, overlapping_pairs=overlapping,
                   concurrent_pairs=len(concurrent), concurrent=concurrent,
                   disk_full_exits=[e.get("cause") for e in self.exits
                                    if e["disk_full"] and not e["planned"]],
                   skipped=self.skipped, learner_runs=self.runs,
                   unexpected_exits=[e for e in self.exits
                                     if not e["planned"] and not e["disk_full"] and e["returncode"]],
                   ledger=res["ledger"], duration_s=round(time.time() - self.t0, 1),
                   total_steps=self.a.total_steps, seed=self.a.seed)
    with open(os.path.join(self.dir, "faults.json"), "w") as fh:
      json.dump([{k: v for k, v in f.items() if not k.startswith("_")} for f in self.faults], fh,
                indent=1)
    with open(os.path.join(self.dir, "summary.json"), "w") as fh:
      json.dump(summary, fh, indent=1)
    self.unmount()
    print(json.dumps(summary), flush=True)
    return 0 if all(inv.values()) else 1

  def unmount(self) -> None:
    """Keeps the small files of the run (DIR/result/) and unmounts the tmpfs."""
    if not self.tmpfs:
      return
    keep = os.path.join(self.dir, "result")
    os.makedirs(keep, exist_ok=True)
    for n in ("metrics.jsonl", "resumes.jsonl", "trained_ids.jsonl", "config.json"):
      p = os.path.join(self.run_dir, n)
      if os.path.exists(p):
        subprocess.run(["cp", p, keep])
    subprocess.run(["cp", "-r", os.path.join(self.run_dir, "logs"), keep], capture_output=True)
    if not self.a.keep_mount:
      subprocess.run(["umount", "-l", self.run_dir], capture_output=True)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                               formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
  ap.add_argument("--config", required=True)
  ap.add_argument("--minutes", type=float, required=True, help="faults are injected over this span")
  ap.add_argument("--seed", type=int, required=True)
  ap.add_argument("--workdir", required=True)
  ap.add_argument("--total-steps", type=int, default=120)
  ap.add_argument("--faults", type=int, default=None, help="default: 2 per minute, >= 7")
  ap.add_argument("--pairs", type=int, default=None, help="overlapping pairs (default faults // 8)")
  ap.add_argument("--lease-ttl-s", type=float, default=6.0)
  ap.add_argument("--checkpoint-every", type=int, default=3)
  ap.add_argument("--tmpfs-mb", type=int, default=1024, help="0: no tmpfs (no disk_full faults)")
  ap.add_argument("--warmup-s", type=float, default=60.0)
  ap.add_argument("--grace-min", type=float, default=15.0,
                  help="minutes after --minutes the run may take to finish")
  ap.add_argument("--max-runs", type=int, default=200)
  ap.add_argument("--target-wait-s", type=float, default=300.0,
                  help="a fault whose target (a stepping learner, a generator...) does not appear "
                       "within this long is skipped and counted")
  ap.add_argument("--keep-mount", action="store_true")
  ap.add_argument("--kinds", default="", help="comma-separated fault kinds (default: all)")
  a, rest = ap.parse_known_args(argv)
  bad = [x for x in rest if not x.startswith("--config.")]
  if bad:
    ap.error(f"unknown arguments {bad} (only --config.KEY=VALUE overrides pass through)")
  if a.faults is None:
    a.faults = max(len(a.kinds.split(",")) if a.kinds else len(KINDS), int(round(2 * a.minutes)))
  if a.pairs is None:
    a.pairs = a.faults // 8
  def stop(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
  signal.signal(signal.SIGTERM, stop)      # the harness's finally: stop the run, unmount
  return Chaos(a, rest).run()


if __name__ == "__main__":
  sys.exit(main())
