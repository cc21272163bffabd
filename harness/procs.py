"""Processes as the harness sees them (Linux /proc), free loopback ports and polling.

One copy of each helper for the tests (`tests/helpers.py` re-exports them), the benches
(`bench/common.py`) and the chaos harness (`harness/chaos.py`)."""
from __future__ import annotations

import os
import socket
import time
from typing import Callable, TypeVar

T = TypeVar("T")


def proc_stat(pid: int) -> list[str] | None:
  """The fields of /proc/PID/stat after the command name (state, ppid, ...; utime is [11],
  stime [12]), or None when there is no such process."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()
  except (OSError, IndexError):
    return None


def proc_state(pid: int) -> str | None:
  """The state letter of /proc/PID/stat (R, S, Z, T, ...), or None when there is no such process."""
  st = proc_stat(pid)
  return st[0] if st else None


def alive(pid: int) -> bool:
  """True while `pid` exists and is not a zombie."""
  return proc_state(pid) not in (None, "Z")


def _parents() -> dict[int, list[int]]:
  """ppid -> [pid] over every process now (one scan of /proc)."""
  kids: dict[int, list[int]] = {}
  for d in os.listdir("/proc"):
    if d.isdigit():
      st = proc_stat(int(d))
      if st is not None and len(st) > 1:
        kids.setdefault(int(st[1]), []).append(int(d))
  return kids


def children(pid: int) -> list[int]:
  """The pids whose parent is `pid` now."""
  return _parents().get(pid, [])


def descendants(pid: int) -> list[int]:
  """Children of `pid` and theirs (generator workers, the buffer, their reapers, vLLM engines),
  from one scan of /proc."""
  kids, out, todo = _parents(), [], [pid]
  while todo:
    for k in kids.get(todo.pop(), []):
      out.append(k)
      todo.append(k)
  return out


def argv(pid: int) -> list[str]:
  """The arguments of `pid` ([] once it is gone)."""
  try:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
      return f.read().decode(errors="replace").split("\0")
  except OSError:
    return []


def cmdline(pid: int) -> str:
  """The command line of `pid`, arguments joined by spaces ("" once it is gone)."""
  return " ".join(argv(pid)).strip()


def cpu_seconds(pid: int) -> float:
  """User + system CPU seconds of `pid` (all its threads; not its children); 0 when gone."""
  st = proc_stat(pid)
  return (int(st[11]) + int(st[12])) / os.sysconf("SC_CLK_TCK") if st else 0.0


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def wait_until(cond: Callable[[], T], timeout_s: float, what: str = "", interval_s: float = 0.05,
               raise_on_timeout: bool = True) -> T:
  """Polls `cond()` every `interval_s` until it returns something truthy, and returns that. At
  the deadline: raises TimeoutError naming `what` (or returns the last falsy value when
  `raise_on_timeout` is False). `cond` is always called at least once."""
  end = time.monotonic() + timeout_s
  while True:
    v = cond()
    if v or time.monotonic() >= end:
      break
    time.sleep(interval_s)
  if not v and raise_on_timeout:
    raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what or cond}")
  return v


def buffer_knobs(prompts_per_step: int, group_size: int, max_lag: int, *,
                 max_completion_tokens: int | None = None, **knobs) -> list[str]:
  """The `--config.a.b=value` overrides of a buffer started by hand (`python -m
  scalerl_jax.buffer.server` without a run file reads the declared defaults plus these): the batch
  shape, PipelineRL-k, No-Positive-Resampling off (and rl.adv_norm=none for groups of one, which
  the run config's checks require), the completion limit as a thinking budget
  (`max_completion_tokens` = think_budget_max + the interruption allowance 64 + answer_budget 0)
  and any other knob by its path (`knobs`: {"buffer.lease_ttl_s": 20}, written with `__` for
  the dot: `buffer__lease_ttl_s=20`)."""
  out = {"rollout.prompts_per_step": prompts_per_step, "rollout.generations_per_prompt": group_size,
         "rollout.max_lag": max_lag, "rl.no_positive_resampling": False}
  if group_size < 2:          # one sample per prompt: no group advantage to normalise
    out["rl.adv_norm"] = "none"
  if max_completion_tokens is not None:
    out.update({"rollout.think_budget_min": 0, "rollout.answer_budget": 0,
                "rollout.think_budget_max": max(int(max_completion_tokens) - 64, 0)})
  out.update({k.replace("__", "."): v for k, v in knobs.items()})
  return [f"--config.{k}={v}" for k, v in out.items()]
