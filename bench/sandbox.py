"""Sandboxed vs plain-subprocess program runs per second (code rewards' start cost at RL rates).

``python -m bench.sandbox`` runs the same small DeepCoder-style program (read numbers on stdin,
print their sum) N times with W concurrent workers two ways, interleaved in rounds:
  ours   scalerl_jax.rewards.sandbox.run_program: a fresh bubblewrap sandbox per run (namespaces,
         read-only root, limits launcher, stdout cap, wall-clock kill), stdin/out checked;
  peer   subprocess.run([system python3, "-I", "-S", "-c", program]) with the same stdin: no
         isolation, no limits (the floor any grader pays: one interpreter start);
  bare   (--compare-bare) run_program without the seccomp filter and the per-sandbox cgroup
         (the sandbox before issue 28), for the cost of those two layers.
Last stdout line: one JSON object {"ours", "peer", "unit", "ratio" = ours / peer (median of the
per-round ratios), ...}. Target: ratio >= 0.5 on 2 cores.
"""
from __future__ import annotations

import argparse
import dataclasses
import concurrent.futures as cf
import json
import os
import statistics
import subprocess
import time

from scalerl_jax.rewards import sandbox

PROGRAM = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))\n"
STDIN = " ".join(str(i) for i in range(100)) + "\n"
WANT = b"4950\n"


def _ours(_, s=None):
  r = sandbox.run_program(PROGRAM, STDIN, s=s)
  if r.status != "ok" or r.stdout != WANT or not r.sandboxed:
    raise RuntimeError(f"sandboxed run failed: {r}")


def _bare(i):
  return _ours(i, dataclasses.replace(sandbox.settings(), seccomp=False, cgroup="none"))


def _peer(python):
  def run(_):
    r = subprocess.run([python, "-I", "-S", "-c", PROGRAM], input=STDIN.encode(),
                       capture_output=True, timeout=30)
    if r.returncode != 0 or r.stdout != WANT:
      raise RuntimeError(f"plain run failed: {r}")
  return run


def _rate(fn, n: int, workers: int) -> float:
  with cf.ThreadPoolExecutor(workers) as ex:
    t = time.perf_counter()
    list(ex.map(fn, range(n)))
    return n / (time.perf_counter() - t)


def main(argv=None) -> dict:
  """Runs the benchmark; returns the result dict (also printed as the last stdout line)."""
  ap = argparse.ArgumentParser(prog="python -m bench.sandbox", description=__doc__.splitlines()[0])
  ap.add_argument("--runs", type=int, default=100, help="programs per measurement")
  ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians reported)")
  ap.add_argument("--workers", type=int, default=2, help="concurrent runs (both sides)")
  ap.add_argument("--compare-bare", action="store_true",
                  help="also time the sandbox without seccomp and cgroup (interleaved)")
  args = ap.parse_args(argv)
  info = sandbox.check_sandbox()
  python = sandbox.settings().python
  _rate(_ours, 4, 2), _rate(_peer(python), 4, 2)          # warm the page cache
  ours, peer, bare = [], [], []
  for _ in range(args.rounds):
    ours.append(_rate(_ours, args.runs, args.workers))
    peer.append(_rate(_peer(python), args.runs, args.workers))
    if args.compare_bare:
      bare.append(_rate(_bare, args.runs, args.workers))
    print(f"round: sandboxed {ours[-1]:.1f}/s  plain {peer[-1]:.1f}/s  ratio {ours[-1] / peer[-1]:.2f}"
          + (f"  bare {bare[-1]:.1f}/s ratio {bare[-1] / peer[-1]:.2f}" if bare else ""), flush=True)
  o, p = statistics.median(ours), statistics.median(peer)
  ratios = [a / b for a, b in zip(ours, peer)]
  # ratio: median of the per-round ratios (each round runs both sides back to back, so a burst of
  # other load on the shared machine hits both); ratio_of_medians for comparison.
  res = {"ours": round(o, 1), "peer": round(p, 1), "unit": "programs/s",
         "ratio": round(statistics.median(ratios), 3), "ratio_of_medians": round(o / p, 3),
         "workers": args.workers, "runs": args.runs, "rounds": args.rounds,
         "ratios": [round(r, 3) for r in ratios],
         "cpus": os.cpu_count(), "loadavg_1m": round(os.getloadavg()[0], 2),
         "probe_start_ms": info["start_ms"], "bwrap": info["bwrap"],
         "seccomp": info["seccomp"], "cgroup": info["cgroup"]}
  if bare:
    res.update(bare=round(statistics.median(bare), 1),
               ratio_bare=round(statistics.median(b / q for b, q in zip(bare, peer)), 3),
               ratio_ours_to_bare=round(statistics.median(a / b for a, b in zip(ours, bare)), 3))
  print(json.dumps(res))
  return res


if __name__ == "__main__":
  main()
