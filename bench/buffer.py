"""Rollout-buffer throughput: our gRPC buffer vs Redis streams, identical serialized rollouts.

  python -m bench.buffer [--rounds 3] [--rollouts 2048] [--producers 2] [--tokens 16384] [--floor]

What is measured (both systems, same work): P producer processes build and push serialized rollouts
(16k-token completions with float32 log-probs, int32 versions and a bit-packed policy mask, ~200 KB
each; the same bytes for both systems), each acknowledged individually, while one consumer (the
learner, this process) pulls them out. Every payload byte makes two hops through the store: producer
-> store (push in) and store -> consumer (pull out). Throughput = payload bytes that reached the
consumer / wall time from the producers' start to the last byte pulled (each byte counted once, not
once per hop).
  ours: buffer server in its own process (PipelineRL-k admission on, k=4, G=16, every field
        validated, no WAL), producers lease groups and stream rollouts over PushRollouts (~4 MB per
        PushRequest); the learner pulls complete groups with PullBatch (raw BatchItem bytes, not
        parsed) and publishes a (tiny) new weight version every step.
  peer: `redis-server` (no persistence, loopback) started here; producers XADD one entry per rollout
        (the returned id is its ack), pipelined in batches of the same ~4 MB; the consumer XREADs
        blocks of 64 entries (not parsed) and XTRIMs what it read.
  Every bench process (both systems) raises glibc's mmap threshold (wire.tune_malloc).
Rounds alternate ours/peer (the machine is shared: wall-clock numbers are noisy); the JSON reports
per-round values, medians and bests. Also reported: CPU seconds of all processes of each system and
MB per CPU-second (less sensitive to other load), and with --floor the same two hops through a
bare gRPC forwarder (bench.grpc_floor: identity serializers, no validation or storage): the ceiling
for ours.
Last stdout line: {"ours": median MB/s, "peer": median MB/s, "unit": "MB/s", "ratio": ..., ...}
(MB = 1e6 B).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import cpu_of, cpu_seconds, free_port
from harness.procs import buffer_knobs

TOKEN = "bench-token"


def _rollout_parts(tokens: int, prompt_len: int, seed: int = 0):
  from scalerl_jax.protocol import codec
  from scalerl_jax.protocol import rollout_pb2 as pb
  rng = np.random.default_rng(seed)
  return dict(
      prompt=codec.encode(np.arange(prompt_len, dtype=np.int32), pb.INT32),
      toks=codec.encode(rng.integers(0, 128000, tokens, dtype=np.int32), pb.INT32),
      lps=codec.encode(-rng.exponential(1.0, tokens).astype(np.float32), pb.FLOAT32),
      mask=codec.encode(np.ones(tokens, bool), pb.BITS), tokens=tokens)


def _make_rollout(parts, version_tensor, rid, prompt_id, group_id, sample, gen_id):
  from scalerl_jax.protocol import rollout_pb2 as pb
  return pb.Rollout(rollout_id=rid, prompt_id=prompt_id, group_id=group_id, sample_index=sample,
                    prompt_tokens=parts["prompt"], completion_tokens=parts["toks"],
                    logprobs=parts["lps"], versions=version_tensor, policy_mask=parts["mask"],
                    rewards=[1.0], finish_reason=pb.FINISH_STOP, generator_id=gen_id,
                    timing=pb.Timing(start_unix_s=1.0, end_unix_s=2.0)).SerializeToString()


# ---- ours ------------------------------------------------------------------------------------------
def _tune():
  from scalerl_jax.protocol.wire import tune_malloc
  tune_malloc()


def _our_producer(address, idx, tokens, prompt_len, stop_evt, ready, go, push_bytes):
  _tune()
  from scalerl_jax.protocol import codec
  from scalerl_jax.protocol import rollout_pb2 as pb
  from scalerl_jax.protocol.client import BufferClient
  parts = _rollout_parts(tokens, prompt_len, idx)
  vcache = {}
  c = BufferClient(address, TOKEN)
  c.status()
  ready.put(idx)
  go.wait()
  gen = f"gen{idx}"
  n = 0
  while not stop_evt.is_set():
    got = c.lease(gen, max_groups=2, wait_timeout_s=0.5)
    if not got:
      continue
    msgs = []
    for a in got:
      v = a.min_version
      if v not in vcache:
        vcache = {v: codec.encode(np.full(tokens, v, np.int32), pb.INT32)}
      for i in range(a.group_size):
        msgs.append(_make_rollout(parts, vcache[v], f"{gen}-{a.group_id}-{i}", a.prompt_id,
                                  a.group_id, i, gen))
        n += 1
    try:
      c.push(msgs, batch_bytes=push_bytes)
    except Exception:      # the run is over (server stopped)
      break
  c.close()


def _bench_ours(n_rollouts, producers, tokens, prompt_len, G=16, B=4, k=4, extra_args=(),
                push_bytes=4 << 20):
  extra_args = list(extra_args)
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.weights.stream import StreamPublisher      # imports JAX (this process only)
  weights = {"w": np.zeros(256, np.float32)}   # the tiny (1 KiB) version published every step
  tmp = tempfile.mkdtemp()
  ppath = os.path.join(tmp, "prompts.jsonl")
  with open(ppath, "w") as f:
    for i in range(64):
      f.write(json.dumps({"prompt_id": i, "tokens": list(range(prompt_len)), "answer": "x"}) + "\n")
  env = dict(os.environ, SCALERL_BENCH_TOKEN=TOKEN)
  srv = subprocess.Popen(
      [sys.executable, "-m", "scalerl_jax.buffer.server", "--port", "0", "--prompts", ppath,
       *buffer_knobs(B, G, k, max_completion_tokens=tokens,
                     buffer__auth_token_env="SCALERL_BENCH_TOKEN")] + extra_args,
      stdout=subprocess.PIPE, env=env, text=True)
  try:
    port = json.loads(srv.stdout.readline())["port"]
    address = f"127.0.0.1:{port}"
    c = BufferClient(address, TOKEN)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    ready, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_our_producer,
                         args=(address, i, tokens, prompt_len, stop, ready, go, push_bytes))
             for i in range(producers)]
    for p in procs:
      p.start()
    for _ in procs:
      ready.get(timeout=120)
    c.status()
    pids = [os.getpid(), srv.pid] + [p.pid for p in procs]
    cpu0 = cpu_of(pids)
    base = [cpu_seconds(p) for p in pids]
    go.set()
    t0 = time.perf_counter()
    got_bytes = got = step = 0
    lat = []
    while got < n_rollouts:
      t = time.perf_counter()
      for item in c.pull_raw(step, timeout_s=120):
        got_bytes += len(item)
      lat.append(time.perf_counter() - t)
      got += B * G
      step += 1
      StreamPublisher(c, step, weights, process_index=0).publish()
    wall = time.perf_counter() - t0
    cpu = cpu_of(pids) - cpu0
    per = {name: round(cpu_seconds(pid) - b, 2) for name, pid, b in
           zip(["learner", "server"] + [f"producer{i}" for i in range(producers)], pids, base)}
    st = c.status()
    stop.set()
    for p in procs:
      p.join(timeout=10)
      if p.is_alive():
        p.terminate()
    return dict(wall_s=wall, cpu_s=cpu, cpu_by_process=per, rollouts=got, bytes=got_bytes, steps=step,
                max_lag=st.lag_total.max_lag, server_bytes_in=st.bytes_in,
                pull_wait_median_s=float(np.median(lat)))
  finally:
    srv.terminate()
    srv.wait(timeout=10)
    shutil.rmtree(tmp, ignore_errors=True)


# ---- redis -----------------------------------------------------------------------------------------
def _redis_producer(port, idx, count, tokens, prompt_len, ready, go, batch):
  _tune()
  import redis
  from scalerl_jax.protocol import codec
  from scalerl_jax.protocol import rollout_pb2 as pb
  parts = _rollout_parts(tokens, prompt_len, idx)
  v = codec.encode(np.zeros(tokens, np.int32), pb.INT32)
  r = redis.Redis(port=port)
  r.ping()
  ready.put(idx)
  go.wait()
  for start in range(0, count, batch):       # one round trip per batch, one id (ack) per rollout
    pipe = r.pipeline(transaction=False)
    for i in range(start, min(count, start + batch)):
      blob = _make_rollout(parts, v, f"r{idx}-{i}", i % 64, i // 16, i % 16, f"gen{idx}")
      pipe.xadd("rollouts", {"r": blob})
    ids = pipe.execute()
    assert len(ids) == min(count, start + batch) - start
  r.close()


def _bench_redis(n_rollouts, producers, tokens, prompt_len, batch):
  import redis
  exe = shutil.which("redis-server")
  if exe is None:
    raise SystemExit("redis-server not found (Debian package `redis-server`)")
  port = free_port()
  srv = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--protected-mode", "no"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    r = redis.Redis(port=port)
    for _ in range(100):
      try:
        r.ping()
        break
      except redis.ConnectionError:
        time.sleep(0.05)
    ctx = mp.get_context("spawn")
    per = n_rollouts // producers
    ready, go = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_redis_producer,
                         args=(port, i, per, tokens, prompt_len, ready, go, batch))
             for i in range(producers)]
    for p in procs:
      p.start()
    for _ in procs:
      ready.get(timeout=120)
    pids = [os.getpid(), srv.pid] + [p.pid for p in procs]
    cpu0 = cpu_of(pids)
    base = [cpu_seconds(p) for p in pids]
    go.set()
    t0 = time.perf_counter()
    last, got, got_bytes = "0-0", 0, 0
    while got < per * producers:
      resp = r.xread({"rollouts": last}, count=64, block=5000)
      if not resp:
        continue
      for eid, fields in resp[0][1]:
        got_bytes += len(fields[b"r"])
        got += 1
        last = eid
      r.xtrim("rollouts", minid=last)     # the consumer frees what it read (bounded memory)
    wall = time.perf_counter() - t0
    cpu = cpu_of(pids) - cpu0
    per = {name: round(cpu_seconds(pid) - b, 2) for name, pid, b in
           zip(["consumer", "redis-server"] + [f"producer{i}" for i in range(producers)], pids, base)}
    for p in procs:
      p.join()
    return dict(wall_s=wall, cpu_s=cpu, cpu_by_process=per, rollouts=got, bytes=got_bytes)
  finally:
    srv.terminate()
    srv.wait(timeout=10)


def _round(a, size):
  """One ours/peer round: (ours result, peer result), each with MB/s."""
  ours = _bench_ours(a.rollouts, a.producers, a.tokens, a.prompt_len,
                     extra_args=a.server_args.split(), push_bytes=a.push_mb << 20)
  ours["MB_per_s"] = ours["bytes"] / ours["wall_s"] / 1e6
  print(f"ours: {ours}  -> {ours['MB_per_s']:.0f} MB/s", flush=True)
  if a.skip_redis:
    return ours, dict(wall_s=float("nan"), cpu_s=float("nan"), rollouts=0, bytes=0,
                      MB_per_s=float("nan"))
  # Same batching as ours: our client packs ~4 MB of rollouts per PushRequest (acks per rollout).
  peer = _bench_redis(a.rollouts, a.producers, a.tokens, a.prompt_len,
                      batch=max(1, -(-(a.push_mb << 20) // size)))
  peer["MB_per_s"] = peer["bytes"] / peer["wall_s"] / 1e6
  print(f"redis: {peer}  -> {peer['MB_per_s']:.0f} MB/s", flush=True)
  return ours, peer


def main(argv=None):
  ap = argparse.ArgumentParser(description="rollout buffer vs Redis streams throughput")
  ap.add_argument("--rounds", type=int, default=3, help="alternating ours/peer rounds")
  ap.add_argument("--rollouts", type=int, default=2048)
  ap.add_argument("--producers", type=int, default=2)
  ap.add_argument("--tokens", type=int, default=16384)
  ap.add_argument("--prompt-len", type=int, default=256)
  ap.add_argument("--skip-redis", action="store_true")
  ap.add_argument("--floor", action="store_true",
                  help="also run the bare gRPC two-hop forwarder (bench.grpc_floor) each round")
  ap.add_argument("--push-mb", type=int, default=4, help="MiB of rollouts per PushRequest / XADD batch")
  ap.add_argument("--server-args", default="--switch-interval-s 0.0005",
                  help="extra buffer server flags, space-separated")
  a = ap.parse_args(argv)
  _tune()
  size = len(_make_rollout(_rollout_parts(a.tokens, a.prompt_len),
                           _rollout_parts(a.tokens, a.prompt_len)["toks"], "gen0-1-0", 0, 1, 0,
                           "gen0"))
  print(f"serialized rollout: {size} bytes ({size / 1e3:.1f} KB)", flush=True)
  rounds, floors, loads = [], [], []
  for _ in range(max(1, a.rounds)):
    rounds.append(_round(a, size))
    loads.append(os.getloadavg()[0])
    if a.floor:
      from bench import grpc_floor
      f = grpc_floor.run_two_hops(a.rollouts * size, a.push_mb << 20, a.producers)
      print(f"floor (bare gRPC, two hops): {f}", flush=True)
      floors.append(f["MB_per_s"])
  med = lambda xs: round(float(np.median(xs)), 1)
  best = lambda xs: round(float(np.max(xs)), 1)
  o = [r[0]["MB_per_s"] for r in rounds]
  p = [r[1]["MB_per_s"] for r in rounds]
  ratio = [x / y for x, y in zip(o, p)]
  per_cpu = lambda r: r["bytes"] / r["cpu_s"] / 1e6 if r["bytes"] else float("nan")
  out = {"ours": med(o), "peer": med(p), "unit": "MB/s", "ratio": round(float(np.median(ratio)), 3),
         "ours_best": best(o), "peer_best": best(p), "ratio_best": round(float(np.max(ratio)), 3),
         "ours_rounds": [round(x, 1) for x in o], "peer_rounds": [round(x, 1) for x in p],
         "rollouts_per_s_ours": round(med(o) * 1e6 / size, 1),
         "rollouts_per_s_peer": round(med(p) * 1e6 / size, 1),
         "ours_MB_per_cpu_s": med([per_cpu(r[0]) for r in rounds]),
         "peer_MB_per_cpu_s": med([per_cpu(r[1]) for r in rounds]),
         "ours_cpu_utilization": med([r[0]["cpu_s"] / r[0]["wall_s"] for r in rounds]),
         "peer_cpu_utilization": med([r[1]["cpu_s"] / r[1]["wall_s"] for r in rounds]),
         "loadavg_1m": [round(x, 2) for x in loads],
         "rollout_bytes": size, "rollouts": a.rollouts, "producers": a.producers,
         "ours_max_token_lag": max(r[0]["max_lag"] for r in rounds), "cpus": os.cpu_count(),
         "measured": "payload bytes pushed in and pulled out (2 hops), counted once"}
  if a.floor:
    out.update(floor=med(floors), floor_best=best(floors), floor_rounds=floors)
  print(json.dumps(out))


if __name__ == "__main__":
  main()
