"""Grading throughput: math answers per second (and per CPU second) through the worker-process
pool (rewards/isolation.py) against the thread pool it replaced (`generator.grade_workers`
threads calling the verifier in-process, Math-Verify without a timeout off the main thread).

    python -m bench.grade_pool [--n 272] [--workers 2]

Both grade the same (answer, gold) pairs (tests/data/math_pairs.jsonl, all well-formed: the
peer could not finish a hostile one at all) from `--workers` caller threads; warm-up (worker
start-up, Math-Verify's import) is not timed. CPU seconds count this process and the grading
workers; answers/s per core = answers / CPU seconds. Last line: {"ours", "peer", "unit":
"answers/s", "ratio", ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from concurrent import futures

from bench.common import cpu_of, last_line
from scalerl_jax import config as common
from scalerl_jax.rewards import isolation, registry

PAIRS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data",
                     "math_pairs.jsonl")


def _run(grade, pairs, workers: int, pids) -> tuple[float, float, list]:
  texts = [("<think>x</think> " + p["answer"], p["gold"]) for p in pairs]
  c0, t0 = cpu_of(pids()), time.perf_counter()
  with futures.ThreadPoolExecutor(workers) as ex:
    got = list(ex.map(lambda tg: grade(*tg), texts))
  wall, cpu = time.perf_counter() - t0, cpu_of(pids()) - c0
  return len(texts) / wall, len(texts) / max(cpu, 1e-9), got


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--n", type=int, default=272, help="pairs graded (cycled from the shipped set)")
  ap.add_argument("--workers", type=int, default=2, help="grading threads / worker processes")
  a = ap.parse_args()
  base = [json.loads(l) for l in open(PAIRS)]
  pairs = [base[i % len(base)] for i in range(a.n)]
  me = os.getpid()
  # the peer: the replaced thread pool (in-process verifier, off the main thread)
  registry.grade_direct("math", "</think>$1$", "1")          # Math-Verify imported (not timed)
  peer_rate, peer_per_cpu, peer_got = _run(
      lambda t, g: registry.grade_direct("math", t, g), pairs, a.workers, lambda: [me])
  pool = isolation.GradePool(common.Rewards(grade_processes=a.workers))
  pool.wait_ready()
  workers = lambda: [me] + pool.pids()
  ours_rate, ours_per_cpu, ours_got = _run(
      lambda t, g: pool.grade("math", t, g, True), pairs, a.workers, workers)
  pool.shutdown()
  same = sum(o.reward == p.reward for o, p in zip(ours_got, peer_got))
  last_line(round(ours_rate, 1), round(peer_rate, 1), "answers/s", workers=a.workers, n=a.n,
            ours_per_cpu_s=round(ours_per_cpu, 1), peer_per_cpu_s=round(peer_per_cpu, 1),
            same_rewards=same, cpu_count=os.cpu_count())


if __name__ == "__main__":
  main()
