"""The floor under bench.buffer on this machine: raw gRPC-Python byte throughput, memcpy speed.

  python -m bench.grpc_floor [--mb 400] [--msg-kb 4096] [--producers 2]

Same shape as bench.buffer, nothing else: P producer processes stream opaque `bytes` messages
(identity serializers, no protobuf, no validation, no storage) into a server process over
127.0.0.1, which acks each with 2 bytes and forwards the same bytes objects (no copy in Python) to
one consumer process (this process) over a server-streaming call. So every byte makes the same two
gRPC hops as a rollout through the buffer; anything the buffer adds is on top of this.
Also reported: one hop alone (producers -> server, server discards), the pull hop alone (server ->
consumer, one stream), the same two hops as raw TCP with no protocol (`raw_tcp_two_hops`: what the
kernel alone costs any server), single-thread memcpy GB/s and CPU-seconds per GB of every process.
Env FLOOR_GRPC_OPTIONS='[["grpc.some_arg", value], ...]' adds channel options (experiments).
Last stdout line is JSON (MB = 1e6 B).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing as mp
import os
import queue
import subprocess
import sys
import threading
import time

import numpy as np

from bench.common import cpu_seconds

SERVICE = "floor.Floor"


def _opts():
  from scalerl_jax.protocol.rpc import channel_options
  extra = json.loads(os.environ.get("FLOOR_GRPC_OPTIONS", "[]"))   # experiments: [[key, value]]
  return channel_options(256 << 20) + [tuple(x) for x in extra]


def _ident(x):
  return x


def serve(forward: bool) -> None:
  """Server process: prints its port, then serves until killed."""
  import grpc
  from scalerl_jax.protocol.wire import tune_malloc
  tune_malloc()
  q: "queue.Queue[bytes]" = queue.Queue(maxsize=64)

  def push(it, ctx):
    for m in it:
      if forward:
        q.put(m)
      yield b"ok"

  def pull(req, ctx):
    n, size = (int(x) for x in req.split(b","))
    if size:                       # pull-only: the same pre-made message n times
      m = np.random.default_rng(0).bytes(size)
      for _ in range(n):
        yield m
      return
    for _ in range(n):
      yield q.get()

  h = grpc.method_handlers_generic_handler(SERVICE, {
      "Push": grpc.stream_stream_rpc_method_handler(push, _ident, _ident),
      "Pull": grpc.unary_stream_rpc_method_handler(pull, _ident, _ident)})
  srv = grpc.server(concurrent.futures.ThreadPoolExecutor(16), options=_opts())
  srv.add_generic_rpc_handlers([h])
  port = srv.add_insecure_port("127.0.0.1:0")
  srv.start()
  print(json.dumps({"port": port}), flush=True)
  srv.wait_for_termination()


def _producer(address, count, size, ready, go):
  import grpc
  from scalerl_jax.protocol.wire import tune_malloc
  tune_malloc()
  ch = grpc.insecure_channel(address, options=_opts())
  call = ch.stream_stream(f"/{SERVICE}/Push", _ident, _ident)
  msgs = [np.random.default_rng(i).bytes(size) for i in range(4)]
  ready.put(1)
  go.wait()
  c0 = time.process_time()
  for _ in call(iter(msgs[i % 4] for i in range(count))):
    pass
  ready.put(time.process_time() - c0)
  ch.close()


def _start_producers(ctx, target, args, n: int, ready, timeout: float = 120):
  """Starts n producer processes target(*args) and waits until each has put its "ready" mark."""
  procs = [ctx.Process(target=target, args=args) for _ in range(n)]
  for p in procs:
    p.start()
  for _ in procs:
    ready.get(timeout=timeout)
  return procs


def _run(count, size, producers, forward):
  import grpc
  srv = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve",
                          "--forward" if forward else "--no-forward"], stdout=subprocess.PIPE,
                         text=True)
  try:
    port = json.loads(srv.stdout.readline())["port"]
    address = f"127.0.0.1:{port}"
    ctx = mp.get_context("spawn")
    ready, go = ctx.Queue(), ctx.Event()
    per = count // producers
    procs = _start_producers(ctx, _producer, (address, per, size, ready, go), producers, ready)
    ch = grpc.insecure_channel(address, options=_opts())
    pull = ch.unary_stream(f"/{SERVICE}/Pull", _ident, _ident)
    pids = [os.getpid(), srv.pid]
    base = [cpu_seconds(p) for p in pids]
    go.set()
    t0 = time.perf_counter()
    got = 0
    if forward:
      for m in pull(f"{per * producers},0".encode()):
        got += len(m)
    pcpu = [ready.get(timeout=600) for _ in procs]
    wall = time.perf_counter() - t0
    for p in procs:
      p.join()
    if not forward:
      got = per * producers * size
    cpu = {n: round(cpu_seconds(p) - b, 2) for n, p, b in zip(["consumer", "server"], pids, base)}
    cpu.update({f"producer{i}": round(c, 2) for i, c in enumerate(pcpu)})
    ch.close()
    return dict(MB_per_s=round(got / wall / 1e6, 1), wall_s=round(wall, 3), cpu_s=cpu,
                cpu_s_per_GB=round(sum(cpu.values()) / (got / 1e9), 2))
  finally:
    srv.kill()
    srv.wait()


def _pull_only(count, size, streams):
  import grpc
  srv = subprocess.Popen([sys.executable, "-m", "bench.grpc_floor", "--serve"],
                         stdout=subprocess.PIPE, text=True)
  try:
    port = json.loads(srv.stdout.readline())["port"]
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=_opts())
    pull = ch.unary_stream(f"/{SERVICE}/Pull", _ident, _ident)
    for _ in pull(b"1,1024"):
      pass
    base = [cpu_seconds(os.getpid()), cpu_seconds(srv.pid)]
    got = [0] * streams

    def one(i):
      for m in pull(f"{count // streams},{size}".encode()):
        got[i] += len(m)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in ts:
      t.start()
    for t in ts:
      t.join()
    wall = time.perf_counter() - t0
    cpu = dict(consumer=round(cpu_seconds(os.getpid()) - base[0], 2),
               server=round(cpu_seconds(srv.pid) - base[1], 2))
    ch.close()
    return dict(MB_per_s=round(sum(got) / wall / 1e6, 1), wall_s=round(wall, 3), cpu_s=cpu,
                cpu_s_per_GB=round(sum(cpu.values()) / (sum(got) / 1e9), 2))
  finally:
    srv.kill()
    srv.wait()


def _tcp_producer(port, nbytes, chunk, ready, go):
  import socket
  s = socket.create_connection(("127.0.0.1", port))
  buf = np.random.default_rng(0).bytes(chunk)
  ready.put(1)
  go.wait()
  c0 = time.process_time()
  for _ in range(nbytes // chunk):
    s.sendall(buf)
  s.close()
  ready.put(time.process_time() - c0)


def _tcp_relay(port_q, chunk, producers, cpu_q):
  """Accepts the consumer, then the producers; forwards every byte received to the consumer."""
  import selectors
  import socket
  ls = socket.socket()
  ls.bind(("127.0.0.1", 0))
  ls.listen(producers + 1)
  port_q.put(ls.getsockname()[1])
  out = ls.accept()[0]
  ins = [ls.accept()[0] for _ in range(producers)]
  sel = selectors.DefaultSelector()
  for s in ins:
    sel.register(s, selectors.EVENT_READ)
  view, left = memoryview(bytearray(chunk)), producers
  c0 = time.process_time()
  while left:
    for key, _ in sel.select():
      n = key.fileobj.recv_into(view)
      if n == 0:
        sel.unregister(key.fileobj)
        left -= 1
        continue
      out.sendall(view[:n])
  out.close()
  cpu_q.put(time.process_time() - c0)


def raw_tcp_two_hops(total_bytes: int, producers: int = 2, chunk: int = 4 << 20) -> dict:
  """The same two hops with no protocol at all: producer processes write raw bytes over TCP to a
  relay process that forwards them to this process (recv_into / sendall, 4 MiB buffers). What any
  server, in any language, pays in the kernel on this machine; CPU-s of every process."""
  import socket
  ctx = mp.get_context("spawn")
  port_q, cpu_q, ready, go = ctx.Queue(), ctx.Queue(), ctx.Queue(), ctx.Event()
  relay = ctx.Process(target=_tcp_relay, args=(port_q, chunk, producers, cpu_q))
  relay.start()
  port = port_q.get(timeout=60)
  sink = socket.create_connection(("127.0.0.1", port))
  per = total_bytes // producers
  procs = _start_producers(ctx, _tcp_producer, (port, per, chunk, ready, go), producers, ready,
                          timeout=60)
  view, got = memoryview(bytearray(chunk)), 0
  c0, t0 = time.process_time(), time.perf_counter()
  go.set()
  while True:
    n = sink.recv_into(view)
    if not n:
      break
    got += n
  wall, ccpu = time.perf_counter() - t0, time.process_time() - c0
  cpu = {"consumer": round(ccpu, 2), "relay": round(cpu_q.get(timeout=60), 2)}
  cpu.update({f"producer{i}": round(ready.get(timeout=60), 2) for i in range(producers)})
  for p in procs + [relay]:
    p.join(30)
  sink.close()
  return dict(MB_per_s=round(got / wall / 1e6, 1), wall_s=round(wall, 3), cpu_s=cpu,
              cpu_s_per_GB=round(sum(cpu.values()) / (got / 1e9), 2))


def run_two_hops(total_bytes: int, msg_bytes: int, producers: int) -> dict:
  """Bare two-hop forwarding of `total_bytes` in `msg_bytes` messages (see the module docstring)."""
  return _run(max(producers, total_bytes // msg_bytes), msg_bytes, producers, True)


def memcpy_gbps(mb: int = 256) -> float:
  """Single-thread memcpy GB/s (numpy copyto of a buffer much larger than cache)."""
  a = np.ones(mb << 20, np.uint8)
  b = np.empty_like(a)
  best = float("inf")
  for _ in range(5):
    t = time.perf_counter()
    np.copyto(b, a)
    best = min(best, time.perf_counter() - t)
  return round(a.nbytes / best / 1e9, 2)


def main(argv=None):
  ap = argparse.ArgumentParser(description="raw gRPC-Python byte throughput on this machine")
  ap.add_argument("--mb", type=int, default=400)
  ap.add_argument("--msg-kb", type=int, default=4096)
  ap.add_argument("--producers", type=int, default=2)
  ap.add_argument("--serve", action="store_true")
  ap.add_argument("--forward", action=argparse.BooleanOptionalAction, default=True)
  a = ap.parse_args(argv)
  if a.serve:
    return serve(a.forward)
  from scalerl_jax.protocol.wire import tune_malloc
  tune_malloc()
  size = a.msg_kb << 10
  count = max(a.producers, (a.mb << 20) // size)
  two = _run(count, size, a.producers, True)
  print("two hops (producers -> server -> consumer):", two, flush=True)
  one = _run(count, size, a.producers, False)
  print("one hop (producers -> server):", one, flush=True)
  pull1 = _pull_only(count, size, 1)
  print("one hop (server -> consumer, 1 stream):", pull1, flush=True)
  tcp = raw_tcp_two_hops(count * size, a.producers)
  print("raw TCP two hops (no protocol, relay process):", tcp, flush=True)
  print(json.dumps({"two_hops_MB_per_s": two["MB_per_s"], "one_hop_MB_per_s": one["MB_per_s"],
                    "two_hops_cpu_s_per_GB": two["cpu_s_per_GB"],
                    "one_hop_cpu_s_per_GB": one["cpu_s_per_GB"],
                    "pull_hop_MB_per_s": pull1["MB_per_s"],
                    "pull_hop_cpu_s_per_GB": pull1["cpu_s_per_GB"],
                    "raw_tcp_two_hops_MB_per_s": tcp["MB_per_s"],
                    "raw_tcp_two_hops_cpu_s_per_GB": tcp["cpu_s_per_GB"],
                    "memcpy_GB_per_s": memcpy_gbps(),
                    "msg_bytes": size, "producers": a.producers, "cpus": os.cpu_count(),
                    "loadavg_1m": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
  main()
