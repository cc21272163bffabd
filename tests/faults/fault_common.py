"""Shared pieces of the fault-injection tests (no tests here): a fault-tolerant fake generator that
runs as its own process and logs every acknowledged rollout id, and a buffer launcher.

    python tests/faults/fault_common.py ADDRESS GEN_ID SEED LOG_PATH [--per-sample] [--heartbeat-s S]

Each line of LOG_PATH is JSON: {"start_version": v, "pid": p} once, then per push
{"leased": group_id} as each lease arrives, and per push
{"gid": group_id, "ids": [...], "dup": [...], "t": time} (only after the push was acknowledged).
"""
import argparse
import json
import os
import sys
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)
from harness.procs import buffer_knobs  # noqa: E402  (after the path: run as a script too)

TOKEN = "fault-test-token"
ENV = {"SCALERL_BUFFER_TOKEN": TOKEN}


def write_prompts(path, n=24):
  with open(path, "w") as f:
    for i in range(n):
      f.write(json.dumps({"prompt_id": 100 + i, "tokens": list(range(i, i + 3 + i % 4)),
                          "answer": str(i)}) + "\n")
  return path


def buffer_argv(prompts, wal_dir, B, G, k, ttl, mode="pipeline", archive=False):
  argv = [sys.executable, "-m", "scalerl_jax.buffer.server", "--port", "0",
          "--prompts", prompts, "--max-workers", "32", "--no-tune-malloc",
          *buffer_knobs(B, G, k, buffer__lease_ttl_s=ttl, rollout__mode=mode,
                        audit__wal_archive=archive)]
  if wal_dir:
    argv += ["--wal-dir", wal_dir]
  return argv


def gen_argv(address, gen_id, seed, log_path, per_sample=False, heartbeat_s=0.5,
             sample_sleep_s=0.01):
  argv = [sys.executable, os.path.abspath(__file__), address, gen_id, str(seed), log_path,
          "--heartbeat-s", str(heartbeat_s), "--sample-sleep-s", str(sample_sleep_s)]
  return argv + (["--per-sample"] if per_sample else [])


def read_log(path):
  if not os.path.exists(path):
    return []
  out = []
  for line in open(path):
    try:
      out.append(json.loads(line))
    except ValueError:        # a line torn by kill -9
      pass
  return out


def _main(argv=None):
  import grpc
  from scalerl_jax.protocol import codec
  from scalerl_jax.protocol.client import BufferClient, assignment_prompt
  from scalerl_jax.generation.fake import random_completion
  ap = argparse.ArgumentParser()
  ap.add_argument("address")
  ap.add_argument("gen_id")
  ap.add_argument("seed", type=int)
  ap.add_argument("log")
  ap.add_argument("--per-sample", action="store_true", help="push each sample on its own")
  ap.add_argument("--heartbeat-s", type=float, default=0.5)
  ap.add_argument("--sample-sleep-s", type=float, default=0.01)
  a = ap.parse_args(argv)
  rng = np.random.default_rng([a.seed, os.getpid()])
  c = BufferClient(a.address, os.environ["SCALERL_BUFFER_TOKEN"], retry_budget_s=60.0)
  logf = open(a.log, "a")

  def log(d):
    logf.write(json.dumps(d) + "\n")
    logf.flush()

  got = None
  while got is None:                 # like worker.Worker: the newest weights before generating
    got = c.fetch_version(-1, wait_timeout_s=30)
  version = got
  log({"start_version": version, "pid": os.getpid(), "t": time.time()})
  stop = threading.Event()
  lease_id = f"{a.gen_id}@{os.getpid()}"     # per process, like worker.Worker
  working = {"gids": []}                    # the group being generated, like worker.Worker

  def heartbeat():
    while not stop.wait(a.heartbeat_s):
      try:
        c.heartbeat(lease_id, version, group_ids=working["gids"])
      except grpc.RpcError:
        pass
  threading.Thread(target=heartbeat, daemon=True).start()
  try:
    while True:
      for asg in c.lease(lease_id, max_groups=1, wait_timeout_s=0.5):
        working["gids"] = [asg.group_id]
        log({"leased": asg.group_id})
        got = c.fetch_version(version, wait_timeout_s=0 if version >= asg.min_version else 30)
        if got is not None:
          version = got
        p = assignment_prompt(asg)
        rollouts = []
        for i in range(asg.group_size):
          comp = random_completion(rng, asg.prompt_id, int(rng.integers(4, 17)), version)
          time.sleep(a.sample_sleep_s)
          rollouts.append(codec.completion_to_rollout(
              comp, group_id=asg.group_id, sample_index=i, prompt_tokens=p.tokens,
              generator_id=a.gen_id))
        chunks = [[r] for r in rollouts] if a.per_sample else [rollouts]
        for ch in chunks:
          try:
            acks = c.push(ch)
          except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.FAILED_PRECONDITION:   # lease expired: drop group
              raise
            log({"gid": asg.group_id, "rejected": e.code().name, "t": time.time()})
            break
          log({"gid": asg.group_id, "ids": [x.rollout_id for x in acks if not x.duplicate],
               "dup": [x.rollout_id for x in acks if x.duplicate], "t": time.time()})
          if a.per_sample:
            time.sleep(a.sample_sleep_s)
  finally:
    stop.set()


if __name__ == "__main__":
  _main()
