"""Weight-push bandwidth: learner params -> JAX sampler / vLLM (learner-hosted, via the buffer).

  python -m bench.weights [--d-model 1024] [--layers 8] [--ffn 1280] [--vocab 8192] [--repeats 3]
                          [--stream-chunk-mb 8] [--skip-vllm] [--vllm-eager] [--in-process-buffer]

Model: a random `tiny_llama3`-shaped Llama (defaults: d 1024, 8 layers, 16 heads, 8 KV heads,
head_dim 64, ffn 1280, vocab 8192: ~73M parameters, ~290 MB float32), learner params as jax arrays.
The buffer (`scalerl_jax.buffer.server`, with an auth token) runs as its own process on loopback.
Weight versions travel one way, as streamed versions (the one-payload safetensors "blob" chain this
bench once compared against was removed; docs/results/bench_weights_*quiet.json keep its numbers).

Streamed path through the buffer (weights/stream.py), stage by stage (reference rows):
  stream_publish  `StreamPublisher.publish`: per-shard chunks of the jax params (zero-copy host views
                  on CPU), CRC-32C each, client-streamed; the buffer verifies and keeps the raw messages
  stream_fetch    `StreamFetcher.fetch`: raw messages forwarded by the buffer, checksum checked,
                  copied straight into preallocated 64-byte aligned arrays (the params pytree)
  stream_load_jax `JaxSampler.set_params` + the swap (no layout change; zero-copy device_put)
  stream_pipelined  publish and a long-polling fetch as threads of ONE process (shared GIL).
  *_cpu_s rows: CPU seconds (all threads) of this process plus the buffer process.

ours = the deployed layout (`measure_deployed`): this process is the learner, the buffer its own
       process, the generator a THIRD process that long-polls like `worker._watch_weights`. The
       learner publishes with its `WeightSource` (weights/source.py: chunks staged on the learner,
       the buffer only announces the version, the generator fetches them from the learner in one
       hop while they are being staged). MB/s = model MB / wall seconds from the start of the
       publish to the generator's JaxSampler holding the new params (one host, one clock),
       median of --repeats after one untimed warm-up version; every version is checked
       bit-exact (sha256) in the generator.
peer = `via_buffer`: the same measurement with the chunks going through the buffer (2 hops).
vLLM: the streamed params -> `models.hf_named_arrays` (views) -> `VLLMGenerator.load_weights`
(`--skip-vllm` to skip): transports "shm" (chunks of whole layers written once into reused
/dev/shm files that vLLM's worker maps; the default) and "socket" (frames + vLLM's RPC), float32
and bf16 (cast on our side); MB/s of float32 model bytes. `vllm_MBps` = shm + bf16, what a bf16
fleet engine uses; `vllm_chain_MBps` = learner -> generator process (ours) then -> vLLM, sequential
(the worker loads a version into vLLM once it is complete).
Last stdout line: {"ours", "peer", "unit": "MB/s", "ratio", "vllm_MBps", "stages": {...}}.

`--fanout 1,2,4,8 [--delta]`: weight sync at fleet scale instead (bench/weights_sync.py: relay
fan-out source egress per G, exact deltas on a real learner trajectory, per-stream GB/s vs memcpy).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import tempfile
import time

import numpy as np

from bench.common import cpu_seconds
from harness.procs import buffer_knobs


class _BufferProcess:
  """`python -m scalerl_jax.buffer.server` as its own process (the deployed layout)."""

  def __init__(self, token: str, max_message_bytes: int):
    import subprocess
    self._dir = tempfile.mkdtemp(prefix="bench_weights_buf_")
    prompts = os.path.join(self._dir, "prompts.jsonl")
    with open(prompts, "w") as f:
      f.write(json.dumps({"prompt_id": 0, "tokens": [1, 2], "answer": ""}) + "\n")
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "scalerl_jax.buffer.server", "--prompts", prompts,
         *buffer_knobs(1, 1, 1, buffer__max_message_bytes=max_message_bytes)],
        env=dict(os.environ, SCALERL_BUFFER_TOKEN=token), stdout=subprocess.PIPE, text=True)
    self.address = json.loads(self.proc.stdout.readline())["address"]
    _SERVER_PID[0] = self.proc.pid

  def stop(self):
    self.proc.terminate()
    self.proc.wait(30)


_SERVER_PID = [None]   # the buffer process, whose CPU seconds count too


def cpu_s() -> float:
  """CPU seconds (user + system, all threads) of this process plus the buffer process."""
  t = time.process_time()
  if _SERVER_PID[0]:
    t += cpu_seconds(_SERVER_PID[0])
  return t


def _t(st: dict, name: str, fn):
  """Runs fn; st[name] = wall seconds, st[name + "_cpu_s"] = CPU seconds (cpu_s)."""
  t0, c0 = time.perf_counter(), cpu_s()
  out = fn()
  st[name], st[name + "_cpu_s"] = time.perf_counter() - t0, cpu_s() - c0
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description="weight push MB/s into the JAX sampler and vLLM")
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--ffn", type=int, default=1280)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--stream-chunk-mb", type=int, default=8, help="streamed chunk size")
  ap.add_argument("--skip-vllm", action="store_true")
  ap.add_argument("--in-process-buffer", action="store_true",
                  help="run the buffer in this process (default: its own process, as deployed)")
  ap.add_argument("--vllm-eager", action="store_true", default=True)
  ap.add_argument("--fanout", default="", help="e.g. 1,2,4,8: weight sync at fleet scale "
                  "(bench/weights_sync.py: relay fan-out, per-stream GB/s vs memcpy)")
  ap.add_argument("--delta", action="store_true", help="with --fanout: exact deltas on a real "
                  "learner trajectory, bit identity after every version")
  ap.add_argument("--steps", type=int, default=52, help="--delta: learner steps (versions)")
  ap.add_argument("--stream-d-model", type=int, default=2048, help="--fanout: the per-stream "
                  "rate's model width (default: 721.5 MB bf16 with --stream-ffn; fixed per-fetch "
                  "costs small against its transfer, as for a real model)")
  ap.add_argument("--stream-ffn", type=int, default=5632, help="--fanout: the per-stream "
                  "rate's model FFN width")
  ap.add_argument("--relay-fanout", type=int, default=2, help="--fanout: the relay tree's fan-out")
  ap.add_argument("--write-rate", default="", help="--fanout: write the measured per-stream "
                  "rate and delta fraction here for launch.preflight (launch/weight_rate.json)")
  ap.add_argument("--rate-note", default="shared with concurrent work", help="--write-rate: "
                  "how loaded the machine was (e.g. 'quiet box'), written into the rate file")
  args = ap.parse_args(argv)
  if args.fanout or args.delta:
    from bench import weights_sync
    if args.repeats < 5:
      args.repeats = 5
    print(json.dumps(weights_sync.run(args)))
    return

  import jax
  from scalerl_jax import models
  from scalerl_jax.buffer.server import BufferServer
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.types import PromptSpec
  from scalerl_jax.generation.sampler import JaxSampler

  cfg_kw = dict(d_model=args.d_model, num_layers=args.layers, num_heads=args.heads,
                num_kv_heads=args.kv_heads, head_dim=64, ffn_dim=args.ffn, vocab_size=args.vocab,
                dtype="float32")
  cfg = models.get_preset("tiny_llama3", **cfg_kw)
  params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  jax.block_until_ready(params)
  mb = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1e6
  print(f"[bench.weights] model {mb:.1f} MB float32, "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params", flush=True)

  from scalerl_jax.buffer.server import tune_malloc
  tune_malloc()   # what the buffer process does; multi-MB messages are then recycled, not re-faulted
  token = secrets.token_hex(16)
  max_bytes = int(mb * 1e6 * 1.1) + (64 << 20)
  msg_bytes = max(64, 2 * args.stream_chunk_mb) << 20
  if args.in_process_buffer:
    server = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=token,
                          prompts_per_step=1, group_size=1, max_lag=1,
                          max_message_bytes=msg_bytes, max_weight_bytes=max_bytes).start()
  else:
    server = _BufferProcess(token, msg_bytes)
  client = BufferClient(server.address, token, max_message_bytes=max(256 << 20, 64 << 20))
  sampler = JaxSampler(cfg, params, version=0)
  runs = []
  try:
    for rep in range(args.repeats):
      st = measure_stream(client, sampler, params, 10 * rep + 2, args.stream_chunk_mb << 20)
      runs.append({"stages_s": st, "named": None})
      print(f"[bench.weights] rep {rep}: " + json.dumps({k: round(x, 4) for k, x in st.items()}),
            flush=True)
    from scalerl_jax.weights.stream import StreamFetcher
    newest = StreamFetcher(client).fetch(-1)          # the newest streamed version, for vLLM
    assert newest is not None
    streamed = newest.params
    deployed = measure_deployed(server, token, params, cfg_kw, args.stream_chunk_mb << 20,
                                args.repeats, 10 * args.repeats + 1)
    print(f"[bench.weights] deployed layout (s per version): {json.dumps(deployed)}", flush=True)
  finally:
    client.close()
    server.stop()

  med = lambda xs: float(np.median(xs))
  stream = ("stream_publish", "stream_fetch", "stream_load_jax")
  ours = mb / med(deployed["learner_hosted"])
  via_buffer = mb / med(deployed["via_buffer"])
  stream_summed = mb / med([sum(r["stages_s"][k] for k in stream) for r in runs])
  cpu_total = lambda r, ks: sum(r["stages_s"][k + "_cpu_s"] for k in ks)
  stream_cpu = mb / med([cpu_total(r, stream) for r in runs])
  pipelined = mb / med([r["stages_s"]["stream_pipelined"] for r in runs])
  stages = {k: {"s": round(med([r["stages_s"][k] for r in runs]), 4)} for k in runs[0]["stages_s"]}
  for k, v in stages.items():
    v["MBps"] = round(mb / v["s"], 1) if v["s"] > 0 and not k.endswith("cpu_s") else None

  vllm = None
  if not args.skip_vllm:
    vllm = measure_vllm(cfg, streamed, mb, args)
    print(f"[bench.weights] vllm: {json.dumps(vllm)}", flush=True)
  print(json.dumps({
      "ours": ours, "peer": via_buffer, "unit": "MB/s", "ratio": ours / via_buffer,
      "vllm_MBps": (vllm or {}).get("e2e_bf16_MBps"), "vllm": vllm, "stages": stages,
      "vllm_chain_MBps": (1 / (1 / ours + 1 / vllm["e2e_bf16_MBps"])) if vllm else None,
      "ours_best": mb / min(deployed["learner_hosted"]),
      "ours_rounds_MBps": [round(mb / x, 1) for x in deployed["learner_hosted"]],
      "via_buffer_MBps": via_buffer,
      "via_buffer_rounds_MBps": [round(mb / x, 1) for x in deployed["via_buffer"]],
      "publish_s_learner_hosted": med(deployed["publish_s_learner_hosted"]),
      "publish_s_via_buffer": med(deployed["publish_s_via_buffer"]),
      "fetched_s_learner_hosted": med(deployed["fetched_s_learner_hosted"]),
      "fetched_s_via_buffer": med(deployed["fetched_s_via_buffer"]),
      "stream_pipelined_one_process_MBps": pipelined,
      "stream_summed_stages_MBps": stream_summed,
      "stream_MB_per_cpu_s": stream_cpu,
      "repeats": args.repeats,
      "model_MB": mb, "stream_chunk_MB": args.stream_chunk_mb,
      "ours_impl": "jax params->per-shard CRC-32C chunks staged on the learner's WeightSource->"
                   "gRPC (one hop, pipelined) to a generator process->aligned arrays->JaxSampler "
                   "(zero-copy device_put); wall time publish start -> sampler holds it",
      "peer_impl": "the same chunks published to the buffer, fetched from it (two hops)",
      "cpus": os.cpu_count(), "loadavg": os.getloadavg()}))


def measure_stream(client, sampler, params, version: int, chunk_bytes: int) -> dict:
  """Streamed path, sequential (publish, then fetch, then load) and pipelined (fetcher waiting)."""
  import threading
  import jax
  from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher
  st, clock, cpu = {}, time.perf_counter, cpu_s
  w0, c0 = clock(), cpu()
  StreamPublisher(client, version, params, chunk_bytes).publish()
  w1, c1 = clock(), cpu()
  v, tree = StreamFetcher(client).fetch(version - 1)
  w2, c2 = clock(), cpu()
  sampler.set_params(tree, v)
  sampler.apply_pending()   # pylint: disable=protected-access
  jax.block_until_ready(sampler.params)
  w3, c3 = clock(), cpu()
  st.update(stream_publish=w1 - w0, stream_fetch=w2 - w1, stream_load_jax=w3 - w2,
            stream_publish_cpu_s=c1 - c0, stream_fetch_cpu_s=c2 - c1, stream_load_jax_cpu_s=c3 - c2)
  assert sampler.version == version and all(
      np.array_equal(np.asarray(a), np.asarray(b))
      for a, b in zip(jax.tree.leaves(sampler.params), jax.tree.leaves(params)))   # bit-exact
  del tree
  out = {}

  def fetch():
    got = StreamFetcher(client).fetch(version, wait_timeout_s=60)
    sampler.set_params(got[1], got[0])
    sampler.apply_pending()   # pylint: disable=protected-access
    jax.block_until_ready(sampler.params)
    out["done"] = clock()
  t = threading.Thread(target=fetch)
  t.start()
  time.sleep(0.3)              # the fetcher long-polls before the learner publishes
  w0, c0 = clock(), cpu()
  StreamPublisher(client, version + 1, params, chunk_bytes).publish()
  t.join()
  st.update(stream_pipelined=out["done"] - w0, stream_pipelined_cpu_s=cpu() - c0)
  assert sampler.version == version + 1
  return st


def _generator_proc(address, token, cfg_kw, conn):
  """Generator process of `measure_deployed`: long-polls for each new version, installs it into a
  JaxSampler, reports (version, wall clock when the sampler holds it), then the params' sha256."""
  import hashlib
  import jax
  from scalerl_jax import models
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.generation.sampler import JaxSampler
  from scalerl_jax.weights.stream import StreamFetcher
  from scalerl_jax.protocol.wire import tune_malloc
  tune_malloc()        # as the worker process does
  cfg = models.get_preset("tiny_llama3", **cfg_kw)
  sampler = JaxSampler(cfg, jax.jit(models.init_params, static_argnums=0)(
      cfg, jax.random.PRNGKey(1)), version=0)
  f = StreamFetcher(BufferClient(address, token, max_message_bytes=256 << 20))
  conn.send("ready")
  have = -1           # first: the version visible now (untimed warm-up), then each new one
  while True:
    got = f.fetch(have, wait_timeout_s=120)
    if got is None:
      continue
    have, tree = got
    fetched = time.time()
    sampler.set_params(tree, have)
    sampler.apply_pending()   # what generate() does between chunks
    jax.block_until_ready(sampler.params)
    done = time.time()
    digest = hashlib.sha256(b"".join(np.asarray(x).tobytes()
                                     for x in jax.tree.leaves(sampler.params))).hexdigest()
    conn.send((have, done, digest, fetched))
    if conn.poll() and conn.recv() == "stop":
      return


def measure_deployed(server, token, params, cfg_kw, chunk_bytes, repeats, first_version):
  """Learner params -> JAX sampler in ANOTHER process (the deployed layout): this process is the
  learner, the buffer its own process, the generator a third one that long-polls (as
  `worker._watch_weights` does). Per version: wall seconds from the start of the publish to the
  generator holding the new params (clocks of one host), and a sha256 check (bit-exact).
  Learner-hosted (`source=`: one hop, pipelined) and through-buffer (two hops) alternate."""
  import hashlib
  import multiprocessing as mp
  import jax
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.weights.source import WeightSource
  from scalerl_jax.weights.stream import StreamPublisher
  want = hashlib.sha256(b"".join(np.asarray(x).tobytes() for x in jax.tree.leaves(params))
                        ).hexdigest()
  ctx = mp.get_context("spawn")
  here, there = ctx.Pipe()
  gen = ctx.Process(target=_generator_proc, args=(server.address, token, cfg_kw, there),
                    daemon=True)
  gen.start()
  assert here.recv() == "ready"
  here.recv()          # the generator's warm-up fetch of the version visible now
  client = BufferClient(server.address, token, max_message_bytes=256 << 20)
  src = WeightSource(token, max_message_bytes=256 << 20)
  out = {"learner_hosted": [], "via_buffer": [], "publish_s_learner_hosted": [],
         "publish_s_via_buffer": [], "fetched_s_learner_hosted": [], "fetched_s_via_buffer": []}
  try:
    v = first_version
    for rep in range(repeats + 1):          # round 0: untimed warm-up (channels, heap growth)
      for kind in ("learner_hosted", "via_buffer"):
        time.sleep(0.5)
        t0 = time.time()
        StreamPublisher(client, v, params, chunk_bytes,
                        source=src if kind == "learner_hosted" else None).publish()
        if rep:
          out[f"publish_s_{kind}"].append(time.time() - t0)
        got_v, done, digest, fetched = here.recv()
        assert got_v == v and digest == want, (got_v, v, digest, want)
        if rep:
          out[kind].append(done - t0)
          out[f"fetched_s_{kind}"].append(fetched - t0)
        v += 1
  finally:
    here.send("stop")
    gen.join(30)
    if gen.is_alive():
      gen.kill()
    src.stop()
    client.close()
  return out


def measure_vllm(cfg, tree, mb: float, args) -> dict:
  """Streamed params (our layout, as fetched) -> `models.hf_named_arrays` (views) ->
  VLLMGenerator.load_weights, float32 and bf16 on the wire."""
  from scalerl_jax import models
  from scalerl_jax.generation.vllm import parity as VP
  from scalerl_jax.generation.vllm.generator import VLLMGenerator
  tmp = tempfile.mkdtemp(prefix="bench_weights_")
  d = VP.make_tiny_llama(os.path.join(tmp, "model"), vocab_size=cfg.vocab_size,
                         hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         lm_head_std=0.02)
  out = {}
  with VLLMGenerator(d, enforce_eager=args.vllm_eager, max_model_len=256,
                     kv_cache_bytes=64 << 20) as gen:
    for transport in ("shm", "socket"):
      for wire in (None, "bfloat16"):
        times, stats = [], []
        for _ in range(3):
          t0 = time.perf_counter()
          st = gen.load_weights(models.hf_named_arrays(cfg, tree), gen.version + 1,
                                wire_dtype=wire, transport=transport)
          times.append(time.perf_counter() - t0)
          stats.append(st)
        i = int(np.argsort(times)[len(times) // 2])       # the median repeat
        key = ("fp32" if wire is None else "bf16") + ("" if transport == "shm" else "_socket")
        out[f"e2e_{key}_MBps"] = mb / times[i]    # float32-model MB per second of convert + load
        out[f"{key}_wire_MBps"] = stats[i]["mb_per_s"]
        out[f"{key}_wall_s"] = stats[i]["wall_s"]
        out[f"{key}_load_s"] = stats[i]["load_s"]
  return out


if __name__ == "__main__":
  main()
