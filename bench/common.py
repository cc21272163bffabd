"""What every bench shares: CPU seconds of the processes it measures, free ports, and the one
JSON last line (`{"ours", "peer", "unit", "ratio", ...}`, ratio > 1 = ours better) that
docs/results and the README quote."""
from __future__ import annotations

import json
import math

from harness.procs import cpu_seconds, free_port  # noqa: F401  (the benches' one copy)


def cpu_of(pids) -> float:
  """Sum of user + system CPU seconds of `pids` (each process's own threads)."""
  return sum(cpu_seconds(p) for p in pids)


def last_line(ours: float | None, peer: float | None, unit: str, *, higher_is_better: bool = True,
              **extra) -> dict:
  """Prints (and returns) the bench's JSON last line. `ratio` = ours / peer when higher is
  better (throughput), peer / ours when lower is (seconds); None when either side is missing."""
  ok = ours is not None and peer is not None and ours > 0 and peer > 0 and math.isfinite(ours * peer)
  ratio = ((ours / peer) if higher_is_better else (peer / ours)) if ok else None
  out = {"ours": ours, "peer": peer, "unit": unit, "ratio": ratio, **extra}
  print(json.dumps(out), flush=True)
  return out
