"""Weight sync at fleet scale (issue 44): relay fan-out, exact deltas, per-stream rate vs memcpy.

    python -m bench.weights --fanout 1,2,4,8 --delta [--steps 52] [--repeats 5]

One process, loopback gRPC, a learner WeightSource and G generator fetchers (threads), each with
its relay (weights/relay.py, tree fan-out `--relay-fanout`, default 2).

* fanout: per G, the learner source's egress for one full bf16 version divided by the model's
  bf16 bytes: ours = with relays (goal <= 1.2 at G = 8), peer = every generator fetching from the
  source (G by construction, measured too).
* delta: a real learner (scalerl_jax.learner.Learner, configs/tiny.py's loss settings, the
  tiny_llama3 preset) takes `--steps` RL steps with configs/8b.py's optimizer at
  its post-warm-up rate (AdamW lr 5e-7, b1 0.9, b2 0.999, eps 1e-15, wd 0.01, global-norm clip
  1.0; warm-up 0 so every step is at 5e-7). The rollout batches are synthetic (random tokens,
  rewards 0/1 per group, generator log-probs near uniform): the gradient is the real CISPO
  gradient of the real model, but not of sampled rollouts. Every version is published with a bf16
  wire and a DeltaEncoder (full refresh beyond --steps) and fetched by one generator fetcher;
  delta bytes per version / model bf16 bytes per step (median, max); after every version the
  fetched bits are compared with numpy's (ml_dtypes) bf16 cast of the learner's fp32 params.
* stream (`measure_stream`): one full bf16 version of the stream model (--stream-d-model /
  --stream-ffn, default 721.5 MB) from the publisher's host buffer to the generator's host arrays
  (the fetcher a process of its own, as deployed): staged first, then fetched and timed in the
  fetcher, over TCP (`stream_GBps`, launch.preflight's per-stream rate), the local Unix socket
  (`stream_local_GBps`), its shared-memory ring (`stream_ring_GBps`) and gRPC
  (`stream_GBps_grpc`); the same after the first chunk (`transfer_GBps`); the staging alone
  (`stage_GBps`) and the pipelined version (`version_GBps`: publish start to held). Modes
  interleaved, --repeats each, medians; memcpy of the same bytes after every version (into a
  buffer written before: `memcpy_GBps`, the ratios' denominator; into a fresh one:
  `memcpy_fresh_GBps`) and the bare kernel pairs (`tcp_ceiling_GBps`, `local_ceiling_GBps`,
  `tcp_ceiling_2streams_GBps`), in the same run. The fetcher reads each version into reused
  arrays (weights/pool.py; `fetch_arrays_reused`).

Last stdout line: {"ours", "peer", "unit": "source bytes / model bf16 bytes at max G", "ratio",
"source_bytes_per_version_over_model": {G: ...}, "no_relay": {G: ...},
"delta_bytes_per_version_over_model": median, "delta_max", "stream_GBps", "memcpy_GBps",
"stream_over_memcpy", "stream_local_over_memcpy", "stream_ring_over_memcpy", "version_GBps",
"tcp_ceiling_GBps", "tcp_ceiling_over_memcpy", "stream_over_tcp_ceiling",
"tcp_ceiling_2streams_GBps", "stream_GBps_grpc", "grpc_over_memcpy", "memcpy_fresh_GBps",
"bit_identical", "deltas"}. `--write-rate F` without `--delta` keeps F's delta fraction;
`--rate-note` says how loaded the machine was (written into F's "machine").
"""
from __future__ import annotations

import dataclasses
import secrets
import statistics
import threading
import time

import numpy as np


def _bf16_params(params):
  import ml_dtypes
  import jax
  return jax.tree.map(lambda x: np.asarray(x, np.float32).astype(ml_dtypes.bfloat16), params)


def _nbytes(tree) -> int:
  import jax
  return sum(int(np.asarray(x).nbytes) for x in jax.tree.leaves(tree))


def _serving(token):
  from scalerl_jax.buffer.server import BufferServer
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.types import PromptSpec
  from scalerl_jax.weights.source import WeightSource
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=token,
                     prompts_per_step=1, group_size=1, max_lag=1,
                     max_message_bytes=256 << 20).start()
  return srv, BufferClient(srv.address, token, max_message_bytes=256 << 20), \
      WeightSource(token, max_message_bytes=256 << 20)


def measure_fanout(params16, gs, relay_fanout: int, chunk_bytes: int) -> tuple[dict, dict]:
  """{G: source egress / model bytes} with relays (tree of relay_fanout) and without."""
  from scalerl_jax.protocol.weight_chunks import tree_parents
  from scalerl_jax.weights.relay import start_relay
  from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher
  token = secrets.token_hex(8)
  model = _nbytes(params16)
  ours, peer = {}, {}
  srv, c, src = _serving(token)
  try:
    v = 0
    for relays_on, out in ((True, ours), (False, peer)):
      for g in gs:
        relays = [start_relay(token, host="127.0.0.1") for _ in range(g)] if relays_on else []
        addrs = [r.address for r in relays]
        fetchers = []
        for j in range(g):
          f = StreamFetcher(c, delta=False)
          if relays_on:
            f.relay, f.parents = relays[j], (lambda j=j: tree_parents(j, relay_fanout, addrs))
          fetchers.append(f)
        got = {}
        ts = [threading.Thread(target=lambda j=j, f=f: got.update({j: f.fetch(v - 1, 60)}))
              for j, f in enumerate(fetchers)]
        for t in ts:
          t.start()
        before = src.served_bytes
        StreamPublisher(c, v, params16, chunk_bytes, source=src).publish()
        for t in ts:
          t.join(300)
        assert all(got[j] is not None and got[j].version == v for j in range(g)), got
        out[g] = round((src.served_bytes - before) / model, 4)
        for r in relays:
          r.stop()
        v += 1
  finally:
    src.stop()
    c.close()
    srv.stop()
  return ours, peer


def _learner(steps: int):
  """The tiny model's learner with configs/8b.py's optimizer at its post-warm-up rate."""
  import jax
  import jax.numpy as jnp
  from bench.learner import make_batch
  from scalerl_jax import config as common
  from scalerl_jax import models
  from scalerl_jax.learner import Learner
  big = common.resolve("configs/8b.py").optim
  run = common.resolve("configs/tiny.py", [      # the 8B optimizer, every step at the post-warm-up lr
      *(f"--config.optim.{k}={getattr(big, k)}" for k in ("lr", "b1", "b2", "eps", "weight_decay",
                                                           "max_grad_norm")),
      "--config.optim.warmup_steps=0", "--config.optim.microbatches=1"])
  o = run.optim
  assert (o.lr, o.b1, o.b2, o.eps, o.weight_decay, o.max_grad_norm) == (
      5e-7, 0.9, 0.999, 1e-15, 0.01, 1.0), o
  cfg = models.get_preset("tiny_llama3", dtype="float32", param_dtype="float32")
  params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  learner = Learner.for_run(lambda p, tok, pos: models.forward_hidden(p, cfg, tok, pos),
                            jax.tree.map(jnp.asarray, params), run, with_entropy=False)
  batches = [learner.device_batch(make_batch(cfg, 16, 128, seed=s)) for s in range(4)]

  def step(k):
    learner.state, m = learner._step(learner.state, batches[k % len(batches)])
    return float(m["loss"])
  return learner, step, cfg


def measure_deltas(steps: int, chunk_bytes: int) -> dict:
  """Delta bytes per version over a real learner trajectory; bit identity after every version."""
  import jax
  from scalerl_jax.weights.delta import DeltaEncoder
  from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher, flatten
  learner, step, _ = _learner(steps)
  token = secrets.token_hex(8)
  srv, c, src = _serving(token)
  enc = DeltaEncoder(full_every=steps + 1000)       # no full refresh within the run
  f = StreamFetcher(c)
  fractions, identical, changed = [], True, []
  try:
    prev16 = None
    for v in range(steps + 1):
      if v:
        step(v)
      host = jax.device_get(learner.state.params)
      d0 = enc.delta_bytes
      StreamPublisher(c, v, learner.state.params, chunk_bytes, source=src,
                      wire_dtype="bfloat16", delta=enc).publish()
      got = f.fetch(v - 1, wait_timeout_s=60)
      assert got is not None, f"version {v} did not arrive"
      ref = _bf16_params(host)
      model = _nbytes(ref)
      same = all(np.array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
                 for (_, a), (_, b) in zip(flatten(got.params), flatten(ref)))
      identical = identical and same and got.version == v
      if v:
        fractions.append((enc.delta_bytes - d0) / model)
        changed.append(sum(int(np.count_nonzero(np.asarray(a).view(np.uint16)
                                                != np.asarray(b).view(np.uint16)))
                           for a, b in zip(jax.tree.leaves(prev16), jax.tree.leaves(ref)))
                       / (model / 2))
      prev16 = ref
      print(f"[bench.weights] version {v}: delta {fractions[-1] if v else 0:.4f} of the model, "
            f"bit-identical {same}", flush=True)
  finally:
    src.stop()
    c.close()
    srv.stop()
  return {"delta_bytes_per_version_over_model": round(statistics.median(fractions), 5),
          "delta_max": round(max(fractions), 5),
          "changed_elements_median": round(statistics.median(changed), 5),
          "deltas": len(fractions), "delta_fallbacks": f.delta_fallbacks,
          "delta_chunks": f.delta_chunks, "bit_identical": bool(identical)}


MODES = ("tcp", "local", "ring", "grpc", "pipelined")


def _fetch_proc(address, token, conn):
  """The generator side of `measure_stream`, a process of its own with one StreamFetcher (as a
  generator has), reading each version into host arrays (its ArrayPool: it drops each version
  before the next, so from the second one on they are reused). Per ("fetch", mode) command it
  fetches the next version: "tcp" over the source's bulk channel on TCP, "local" over its local
  (same network namespace) socket, "ring" through that socket's shared-memory ring, "grpc" over
  its FetchWeights stream, "pipelined" over TCP long-polling before the version is published.
  Reports (version, wall clock of the fetch call, wall clock when it holds all of it, wall clock
  and bytes received so far when it held its first chunk, bytes received so far, bulk streams,
  local streams, versions read into reused arrays)."""
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.protocol.wire import tune_malloc
  from scalerl_jax.weights.stream import StreamFetcher
  tune_malloc()
  c = BufferClient(address, token, max_message_bytes=256 << 20)
  f = StreamFetcher(c, delta=False)
  conn.send("ready")
  have = -1
  while True:
    cmd = conn.recv()
    if cmd == "stop":
      return
    _, mode = cmd
    f.bulk, f.bulk_local, f.bulk_ring = mode != "grpc", mode in ("local", "ring"), mode == "ring"
    t_call, first = time.time(), []
    f.on_chunk = lambda i: first or first.append((time.time(), f.received_bytes))
    got = f.fetch(have, wait_timeout_s=120)
    if got is None:
      conn.send(None)
      continue
    have = got.version
    conn.send((have, t_call, time.time(), *first[0], f.received_bytes, f.bulk_streams,
               f.local_streams, f.pool.reused))
    del got


def _memcpy_GBps(flat: np.ndarray, dst: np.ndarray) -> tuple[float, float]:
  """np.copyto of `flat` (GB/s) into `dst`, a buffer already written once (the machine's copy
  rate: the ratio's denominator), and into a fresh buffer (its pages faulted in on the way, as
  the fetcher's fresh arrays are)."""
  out = []
  for d in (dst, np.empty_like(flat)):
    t0 = time.perf_counter()
    np.copyto(d, flat)
    out.append(flat.nbytes / (time.perf_counter() - t0) / 1e9)
  return out[0], out[1]


def _recv_all(rx, out: memoryview, chunk_bytes: int) -> None:
  """Fills `out` from `rx` in chunk_bytes recv_into calls (blocking, MSG_WAITALL)."""
  import socket
  got, n = 0, len(out)
  while got < n:
    k = rx.recv_into(out[got:got + chunk_bytes], min(chunk_bytes, n - got), socket.MSG_WAITALL)
    if not k:
      raise ConnectionError("the reference TCP pair closed early")
    got += k


def _ceiling_GBps(flat: np.ndarray, dst: np.ndarray, chunk_bytes: int, streams: int = 1,
                  local: bool = False) -> float:
  """What the kernel allows for the same bytes: bare socket pairs, loopback TCP (fresh
  connections, as each fetch has, default auto-tuned socket buffers, TCP_NODELAY) or, `local`, a
  Unix stream pair with the bulk channel's local send buffer (bulk.LOCAL_SNDBUF); per pair a
  sender thread `sendall`s its share of `flat` as one memoryview and a receiver thread
  `recv_into`s chunk_bytes slices of its share of `dst` (reused, written before); GB/s from the
  first byte sent to the last one received. `streams` > 1: that many pairs in parallel."""
  import socket
  from scalerl_jax.weights import bulk
  pairs = []
  for _ in range(streams):
    if local:
      tx, rx = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
      tx.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, bulk.LOCAL_SNDBUF)
    else:
      srv = socket.create_server(("127.0.0.1", 0))
      tx = socket.create_connection(srv.getsockname())
      rx, _ = srv.accept()
      srv.close()
      for s in (tx, rx):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pairs.append((tx, rx))
  src, out, n = memoryview(flat), memoryview(dst.reshape(-1).view(np.uint8)), flat.nbytes
  cuts = [n * k // streams for k in range(streams + 1)]
  threads = [threading.Thread(target=tx.sendall, args=(src[a:b],), daemon=True)
             for (tx, _), a, b in zip(pairs, cuts, cuts[1:])] + [
      threading.Thread(target=_recv_all, args=(rx, out[a:b], chunk_bytes), daemon=True)
      for (_, rx), a, b in zip(pairs, cuts, cuts[1:])]
  t0 = time.perf_counter()
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  dt = time.perf_counter() - t0
  for tx, rx in pairs:
    tx.close()
    rx.close()
  return n / dt / 1e9


def measure_stream(params16, repeats: int, chunk_bytes: int) -> dict:
  """One full bf16 version from the publisher's host buffer to the generator's host arrays (the
  generator a process of its own, as deployed), `repeats` times per transport, modes interleaved
  so that load changes hit all alike: staged (the fetch starts once the version is staged in the
  learner's WeightSource; GB/s = model bytes / (fetch return - fetch call), both in the fetcher)
  over TCP (`stream_GBps`, what crosses hosts: launch.preflight's per-stream rate), over the
  local socket (`stream_local_GBps`, a fetcher in the source's network namespace), through its
  shared-memory ring (`stream_ring_GBps`) and over gRPC (`stream_GBps_grpc`); the same streams
  after their first chunk (`transfer_GBps`: the bytes of chunks 2..n over the time from holding
  the first chunk to holding all: the stream without its fixed start, a gRPC long-poll and the
  connection); the staging alone (`stage_GBps`: model bytes / the publish's seconds in those
  modes: chunk copies and CRC-32C into the source, nothing reading); and pipelined
  (`version_GBps`: the fetcher long-polls, GB/s from the start of the publish, staging on the
  same cores included, as on a CPU learner). After every
  version, in this process: memcpy of the same bytes (into a buffer written before:
  `memcpy_GBps`, the ratios' denominator; into a fresh one: `memcpy_fresh_GBps`) and the bare
  kernel ceilings (`tcp_ceiling_GBps`, `local_ceiling_GBps`, `tcp_ceiling_2streams_GBps`).
  Medians."""
  import multiprocessing as mp
  import jax
  from scalerl_jax.protocol.wire import tune_malloc
  from scalerl_jax.weights.stream import StreamPublisher
  tune_malloc()                  # as the learner process does when it serves weights (trainer.py)
  token = secrets.token_hex(8)
  model = _nbytes(params16)
  flat = np.concatenate([np.asarray(x).reshape(-1).view(np.uint8)
                         for x in jax.tree.leaves(params16)])
  srv, c, src = _serving(token)
  ctx = mp.get_context("spawn")
  here, there = ctx.Pipe()
  proc = ctx.Process(target=_fetch_proc, args=(srv.address, token, there), daemon=True)
  proc.start()
  if not here.poll(300) or here.recv() != "ready":
    proc.kill()
    raise RuntimeError("the fetcher process did not start")
  rates: dict = {m: [] for m in MODES}
  transfer: dict = {m: [] for m in MODES if m != "pipelined"}
  mem, fresh, tcp, local, tcp2, stage = [], [], [], [], [], []
  streams = (0, 0, 0)
  warm = flat.copy()
  try:
    for v in range(len(MODES) * (repeats + 1)):     # the first round: untimed warm-ups
      mode = MODES[v % len(MODES)]
      if mode == "pipelined":
        here.send(("fetch", mode))
        time.sleep(0.5)                            # the fetcher long-polls before the publish
      t0 = time.time()
      StreamPublisher(c, v, params16, chunk_bytes, source=src).publish()
      staged = time.time() - t0
      if mode != "pipelined":
        here.send(("fetch", mode))
      if not here.poll(300):
        raise TimeoutError(f"the fetcher process did not report version {v} within 300 s")
      got = here.recv()
      assert got is not None and got[0] == v, (got, v)
      _, t_call, done, t_first, at_first, n_bytes, *streams = got
      if v >= len(MODES):
        rates[mode].append(model / (done - (t0 if mode == "pipelined" else t_call)) / 1e9)
        if mode != "pipelined":         # after the first chunk: the stream alone; and the
          transfer[mode].append((n_bytes - at_first) / (done - t_first) / 1e9)
          stage.append(model / staged / 1e9)      # staging, nothing reading the version
        m, f = _memcpy_GBps(flat, warm)
        mem.append(m)
        fresh.append(f)
        tcp.append(_ceiling_GBps(flat, warm, chunk_bytes))
        local.append(_ceiling_GBps(flat, warm, chunk_bytes, local=True))
        tcp2.append(_ceiling_GBps(flat, warm, chunk_bytes, streams=2))
  finally:
    here.send("stop")
    proc.join(30)
    if proc.is_alive():
      proc.kill()
    src.stop()
    c.close()
    srv.stop()
  bulk_streams, local_streams, reused = streams
  n_bulk = 4 * (repeats + 1)
  assert bulk_streams == n_bulk, f"{bulk_streams} of {n_bulk} bulk streams (fell back to gRPC?)"
  assert local_streams == 2 * (repeats + 1), f"{local_streams} local streams of {2 * (repeats + 1)}"
  assert src.ring_streams == repeats + 1, f"{src.ring_streams} ring streams"
  med = {k: statistics.median(x) for k, x in rates.items()}
  m, k, kl = (statistics.median(x) for x in (mem, tcp, local))
  r = lambda x: round(x, 3)
  return {"stream_GBps": r(med["tcp"]), "memcpy_GBps": r(m),
          "stream_over_memcpy": r(med["tcp"] / m), "tcp_ceiling_GBps": r(k),
          "tcp_ceiling_over_memcpy": r(k / m), "stream_over_tcp_ceiling": r(med["tcp"] / k),
          "stream_local_GBps": r(med["local"]), "stream_local_over_memcpy": r(med["local"] / m),
          "stream_ring_GBps": r(med["ring"]), "stream_ring_over_memcpy": r(med["ring"] / m),
          "local_ceiling_GBps": r(kl), "local_ceiling_over_memcpy": r(kl / m),
          "stream_local_over_local_ceiling": r(med["local"] / kl),
          "transfer_GBps": {k: r(statistics.median(x)) for k, x in transfer.items()},
          "stage_GBps": r(statistics.median(stage)), "stage_over_memcpy": r(
              statistics.median(stage) / m),
          "version_GBps": r(med["pipelined"]), "version_over_memcpy": r(med["pipelined"] / m),
          "tcp_ceiling_2streams_GBps": r(statistics.median(tcp2)),
          "stream_GBps_grpc": r(med["grpc"]), "grpc_over_memcpy": r(med["grpc"] / m),
          "memcpy_fresh_GBps": r(statistics.median(fresh)),
          "fetch_arrays_reused": f"{reused} of {len(MODES) * (repeats + 1)} versions",
          "repeats": {k: [r(x) for x in v] for k, v in rates.items()},
          "memcpy_repeats": [r(x) for x in mem],
          "tcp_ceiling_repeats": [r(x) for x in tcp],
          "local_ceiling_repeats": [r(x) for x in local]}


def run(args) -> dict:
  """The --fanout / --delta measurements (see module docstring); returns the JSON line's dict."""
  import jax
  from scalerl_jax import models
  gs = [int(g) for g in args.fanout.split(",")] if args.fanout else [1]
  cfg = models.get_preset("tiny_llama3", d_model=args.d_model, num_layers=args.layers,
                          num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=64,
                          ffn_dim=args.ffn, vocab_size=args.vocab, dtype="float32")
  params16 = _bf16_params(jax.jit(models.init_params, static_argnums=0)(
      cfg, jax.random.PRNGKey(0)))
  chunk = args.stream_chunk_mb << 20
  print(f"[bench.weights] model {_nbytes(params16) / 1e6:.1f} MB bf16", flush=True)
  ours, peer = measure_fanout(params16, gs, args.relay_fanout, chunk)
  out = {"ours": ours[max(gs)], "peer": peer[max(gs)],
         "unit": "source bytes per version / model bf16 bytes at the largest G",
         "ratio": round(peer[max(gs)] / max(ours[max(gs)], 1e-9), 3),
         "relay_fanout": args.relay_fanout,
         "source_bytes_per_version_over_model": ours, "no_relay": peer}
  if (args.stream_d_model, args.stream_ffn) != (args.d_model, args.ffn):
    cfg = dataclasses.replace(cfg, d_model=args.stream_d_model, ffn_dim=args.stream_ffn)
    del params16                      # the fan-out model, no longer needed
    params16 = _bf16_params(jax.jit(models.init_params, static_argnums=0)(
        cfg, jax.random.PRNGKey(1)))
  out["stream_model_MB"] = round(_nbytes(params16) / 1e6, 1)
  print(f"[bench.weights] stream model {out['stream_model_MB']} MB bf16", flush=True)
  out.update(measure_stream(params16, args.repeats, chunk))
  if args.delta:
    out.update(measure_deltas(args.steps, 1 << 20))
  if args.write_rate:
    write_rate(args.write_rate, out, args.rate_note)
  return out


def _cpu_name() -> str:
  """The CPU model (Linux /proc/cpuinfo), "" where unknown."""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return ""


def write_rate(path: str, out: dict, note: str = "shared with concurrent work") -> None:
  """The rates launch.preflight reads (launch/sizing.py RATE_FILE): per-stream GB/s and the
  delta fraction, with the date, commit and machine they were measured on."""
  import json
  import os
  import platform
  import subprocess
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  rate = {"stream_GBps": out["stream_GBps"], "version_GBps": out.get("version_GBps"),
          "stream_local_GBps": out.get("stream_local_GBps"), "stage_GBps": out.get("stage_GBps"),
          "memcpy_GBps": out["memcpy_GBps"],
          "tcp_ceiling_GBps": out.get("tcp_ceiling_GBps"),
          "local_ceiling_GBps": out.get("local_ceiling_GBps"),
          "stream_GBps_grpc": out.get("stream_GBps_grpc"),
          "delta_fraction": out.get("delta_bytes_per_version_over_model"),
          "date": time.strftime("%Y-%m-%d"), "commit": commit or "?",
          "machine": f"{os.cpu_count()}-core {_cpu_name() or platform.machine()}, "
                     f"loopback, {note}"}
  if rate["delta_fraction"] is None:   # no --delta: keep the last measured fraction, say whence
    try:
      with open(path) as f:
        old = json.load(f)
      rate["delta_fraction"] = old["delta_fraction"]
      rate["delta_from"] = old.get("delta_from") or f"{old.get('date')} commit {old.get('commit')}"
    except (OSError, ValueError, KeyError) as e:
      raise SystemExit(f"--write-rate without --delta needs {path} with a measured "
                       f"delta_fraction ({e})") from None
  with open(path, "w") as f:
    json.dump(rate, f, indent=1)
    f.write("\n")
