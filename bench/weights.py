"""Weight-push bandwidth: learner params -> gRPC buffer -> JAX sampler / vLLM, stage by stage.

  python -m bench.weights [--d-model 1024] [--layers 8] [--ffn 1280] [--vocab 8192] [--repeats 2]
                          [--skip-vllm] [--vllm-eager]

Model: a random `tiny_llama3`-shaped Llama (defaults: d 1024, 8 layers, 16 heads, 8 KV heads,
head_dim 64, ffn 1280, vocab 8192: ~73M parameters, ~290 MB float32), learner params as jax arrays.
The buffer (`BufferServer`, with an auth token) runs in this process on loopback.

Stages of the real path (each timed separately; MB = float32 payload bytes / 1e6):
  to_host   learner params (jax) -> HF-named numpy arrays (`models.hf_named_arrays`, contiguous)
  encode    -> safetensors payload (`runtime.params_to_payload`'s format)
  publish   `BufferClient.publish_weights` (sha256 + client-streamed chunks; visible once verified)
  fetch     `BufferClient.fetch_weights` (server-streamed chunks, join, sha256 check)
  decode    payload -> {name: array}: `runtime.payload_to_named` (safetensors.numpy.load, copies)
            and `sampler.named_from_safetensors` (zero-copy views; what `JaxSampler.load_payload`
            uses)
  load_jax  `JaxSampler.load_weights` (HF layout -> our params, host -> device) + the swap
  load_vllm `VLLMGenerator.load_weights` (socket to the vLLM worker, float32 and bf16 on the wire)
Reference rows (not part of the path): `encode_direct_proposed` (same format in one copy, a
proposed runtime.params_to_payload; checked to decode to the same tensors) and `sha256_once_ref`
(one sha256 pass over the payload: publish hashes twice (client + server), fetch once).

ours = end-to-end MB/s into the JAX sampler on the fast path: to_host + encode + publish + fetch +
       zero-copy decode + load_jax (one number: payload MB / the summed stage seconds, best repeat).
peer = the same chain with the naive baseline decode (`runtime.payload_to_named`): the path as it
       was before this bench (worker.py: payload_to_named -> load_weights).
Last stdout line: {"ours", "peer", "unit": "MB/s", "ratio", "vllm_MBps", "stages": {...}}.
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


_ST_NAMES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int32): "I32",
             np.dtype(np.int64): "I64", np.dtype(np.float64): "F64"}


def encode_direct(named) -> bytearray:
  """Proposed `runtime.params_to_payload`: the same safetensors format, built with ONE copy per
  tensor (source array -> its slot of a preallocated buffer; transposed views are copied straight
  into place), instead of ascontiguousarray copies + safetensors' serialize + bytes copies.
  Tensors in name order, 8-byte aligned header (as safetensors writes)."""
  import struct
  named = sorted(named, key=lambda kv: kv[0])
  header, off = {}, 0
  for name, a in named:
    header[name] = {"dtype": _ST_NAMES[np.dtype(a.dtype)], "shape": list(a.shape),
                    "data_offsets": [off, off + a.nbytes]}
    off += a.nbytes
  h = json.dumps(header, separators=(",", ":")).encode()
  h += b" " * (-len(h) % 8)
  buf = bytearray(8 + len(h) + off)
  buf[:8] = struct.pack("<Q", len(h))
  buf[8:8 + len(h)] = h
  base = 8 + len(h)
  for name, a in named:
    b, e = header[name]["data_offsets"]
    dst = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=base + b).reshape(a.shape)
    np.copyto(dst, a)
  return buf


def _t(fn):
  t0 = time.perf_counter()
  out = fn()
  return out, time.perf_counter() - t0


def main(argv=None):
  ap = argparse.ArgumentParser(description="weight push MB/s into the JAX sampler and vLLM")
  ap.add_argument("--d-model", type=int, default=1024)
  ap.add_argument("--layers", type=int, default=8)
  ap.add_argument("--ffn", type=int, default=1280)
  ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--chunk-mb", type=int, default=4, help="PublishWeights chunk size")
  ap.add_argument("--fetch-chunk-mb", type=int, default=4,
                  help="FetchWeights chunk size (BufferServer weight_chunk_bytes)")
  ap.add_argument("--skip-vllm", action="store_true")
  ap.add_argument("--vllm-eager", action="store_true", default=True)
  args = ap.parse_args(argv)

  import jax
  from scalerl_jax import models, runtime
  from scalerl_jax.rollout.buffer_server import BufferServer
  from scalerl_jax.rollout.client import BufferClient
  from scalerl_jax.rollout.generator import PromptSpec
  from scalerl_jax.rollout.sampler import JaxSampler, named_from_safetensors

  cfg = models.get_preset("tiny_llama3", d_model=args.d_model, num_layers=args.layers,
                          num_heads=args.heads, num_kv_heads=args.kv_heads, head_dim=64,
                          ffn_dim=args.ffn, vocab_size=args.vocab, dtype="float32")
  params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.PRNGKey(0))
  jax.block_until_ready(params)
  mb = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params)) / 1e6
  print(f"[bench.weights] model {mb:.1f} MB float32, "
        f"{sum(x.size for x in jax.tree.leaves(params)) / 1e6:.1f}M params", flush=True)

  token = secrets.token_hex(16)
  max_bytes = int(mb * 1e6 * 1.1) + (64 << 20)
  server = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=token,
                        prompts_per_step=1, group_size=1, max_lag=1,
                        max_message_bytes=max(64, 2 * args.chunk_mb) << 20,
                        weight_chunk_bytes=args.fetch_chunk_mb << 20,
                        max_weight_bytes=max_bytes).start()
  client = BufferClient(server.address, token, max_message_bytes=max(256 << 20, 64 << 20))
  sampler = JaxSampler(cfg, params, version=0)
  runs = []
  try:
    for rep in range(args.repeats):
      version = rep + 1
      st = {}
      named, st["to_host"] = _t(lambda: [(k, np.ascontiguousarray(v))
                                         for k, v in models.hf_named_arrays(cfg, params)])
      from safetensors.numpy import save
      payload, st["encode"] = _t(lambda: save(dict(named)))
      # Proposed encoder (same format, checked below): views of the learner params, one copy.
      direct, st["encode_direct_proposed"] = _t(lambda: encode_direct(
          [(k, v) for k, v in models.hf_named_arrays(cfg, params)]))
      from safetensors.numpy import load as st_load
      ref = st_load(payload)
      dec = named_from_safetensors(direct)
      assert ref.keys() == dec.keys() and all(np.array_equal(ref[k], dec[k]) for k in ref)
      del named, direct, dec, ref
      import hashlib
      _, st["sha256_once_ref"] = _t(lambda: hashlib.sha256(payload).hexdigest())
      _, st["publish"] = _t(lambda: client.publish_weights(
          version, payload, fmt=runtime.WEIGHTS_FORMAT, chunk_bytes=args.chunk_mb << 20))
      got, st["fetch"] = _t(lambda: client.fetch_weights(have_version=version - 1))
      v, fetched, fmt = got
      assert v == version and len(fetched) == len(payload)
      naive, st["decode_naive"] = _t(lambda: runtime.payload_to_named(fetched, fmt))
      fast, st["decode_zero_copy"] = _t(lambda: named_from_safetensors(fetched))
      assert naive.keys() == fast.keys()
      for k in fast:   # zero-copy views hold the same values as the safetensors decode
        assert fast[k].dtype == naive[k].dtype and np.array_equal(fast[k], naive[k]), k
      def load(named):
        sampler.load_weights(named, version)
        sampler._swap_if_pending()   # what generate() does between chunks  pylint: disable=protected-access
        jax.block_until_ready(sampler.params)
      _, st["load_jax_naive"] = _t(lambda: load(naive))
      del naive
      _, st["load_jax_zero_copy"] = _t(lambda: load(fast))
      assert sampler.version == version
      del fast
      runs.append({"stages_s": st, "named": None})
      print(f"[bench.weights] rep {rep}: " + json.dumps({k: round(x, 4) for k, x in st.items()}),
            flush=True)
  finally:
    client.close()
    server.stop()

  common = ("to_host", "encode", "publish", "fetch")   # the real path (reference rows excluded)
  def total(st, kind):
    return sum(st[k] for k in common) + st[f"decode_{kind}"] + st[f"load_jax_{kind}"]
  best_fast = min(runs, key=lambda r: total(r["stages_s"], "zero_copy"))["stages_s"]
  best_naive = min(runs, key=lambda r: total(r["stages_s"], "naive"))["stages_s"]
  ours = mb / total(best_fast, "zero_copy")
  peer = mb / total(best_naive, "naive")
  stages = {k: {"s": round(v, 4), "MBps": round(mb / v, 1) if v > 0 else None}
            for k, v in best_fast.items()}

  vllm = None
  if not args.skip_vllm:
    vllm = measure_vllm(cfg, params, payload, args)
    print(f"[bench.weights] vllm: {json.dumps(vllm)}", flush=True)
  print(json.dumps({
      "ours": ours, "peer": peer, "unit": "MB/s", "ratio": ours / peer,
      "vllm_MBps": (vllm or {}).get("e2e_bf16_MBps"), "vllm": vllm, "stages": stages,
      "model_MB": mb, "publish_chunk_MB": args.chunk_mb, "fetch_chunk_MB": args.fetch_chunk_mb, "ours_impl": "params->safetensors->gRPC buffer->zero-copy decode->JaxSampler",
      "peer_impl": "same, decode with runtime.payload_to_named (safetensors.numpy.load)",
      "cpus": os.cpu_count(), "loadavg": os.getloadavg()}))


def measure_vllm(cfg, params, payload, args) -> dict:
  """Fetched payload -> zero-copy decode -> VLLMGenerator.load_weights (fp32 and bf16 wire)."""
  from scalerl_jax.rollout import vllm_parity as VP
  from scalerl_jax.rollout.sampler import named_from_safetensors
  from scalerl_jax.rollout.vllm_generator import VLLMGenerator
  tmp = tempfile.mkdtemp(prefix="bench_weights_")
  d = VP.make_tiny_llama(os.path.join(tmp, "model"), vocab_size=cfg.vocab_size,
                         hidden_size=cfg.d_model, intermediate_size=cfg.ffn_dim,
                         num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                         num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                         lm_head_std=0.02)
  mb = len(payload) / 1e6
  out = {}
  with VLLMGenerator(d, enforce_eager=args.vllm_eager, max_model_len=256,
                     kv_cache_bytes=64 << 20) as gen:
    for wire in (None, "bfloat16"):
      best = None
      for _ in range(2):
        t0 = time.perf_counter()
        named = named_from_safetensors(payload)
        stats = gen.load_weights(named, gen.version + 1, wire_dtype=wire)
        dt = time.perf_counter() - t0
        if best is None or dt < best[0]:
          best = (dt, stats)
      key = "fp32" if wire is None else "bf16"
      out[f"e2e_{key}_MBps"] = mb / best[0]    # float32-payload MB per second of decode + load
      out[f"{key}_wire_MBps"] = best[1]["mb_per_s"]
      out[f"{key}_wall_s"] = best[1]["wall_s"]
      out[f"{key}_load_s"] = best[1]["load_s"]
  return out


if __name__ == "__main__":
  main()
