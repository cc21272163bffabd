"""Continuous batching vs drain-per-lease on a length-tailed workload: occupancy and tokens/s.

  python -m bench.continuous [--backend jax|vllm] [--leases 6] [--groups 4] [--group-size 16]
                             [--capacity 64] [--think-min 16] [--think-max 128] [--answer 8]

Work: `leases` leases of `groups` prompts x `group-size` samples (the generator's lease: 4 x 16 =
64 sequences by default), thinking budgets drawn uniformly in [think-min, think-max] per sample
(interruption.think_budget, like the paper's 1k-12k: a 1:8 spread by default), then the 4
interruption tokens and `answer` answer tokens. Thinking never ends by itself and there are no
stop tokens, so both sides decode exactly the same number of tokens per sample.

  peer ("drain"): one `generate` per lease, as generation/worker.py's drain loop does: the
        lease's 64 sequences decode as one batch until its longest ends, then the next lease.
  ours ("continuous"): `capacity` slots fed from the same leases (a slot whose sample ends takes
        the next waiting sample): JAX `ContinuousDecoder` (its prompt prefilled between chunks),
        vLLM `VLLMSlots` (one engine request per sample).

Model: a random tiny Llama HF checkpoint (vocab 512, d 256, 4 layers, head_dim 64; as bench.sampler)
loaded by the JAX sampler (float32, chunk 16) or served by vLLM (float32 engine, FP32 head, eager).
Same process and machine; both sides warmed up first on the whole workload (compilation
excluded), then timed
alternately `--repeats` times, median reported. Occupancy = tokens / (slots x decode steps) for
the JAX sides and vLLM drain (its batch runs until its longest sample ends); vLLM continuous
reports the time-weighted requests in flight / capacity (VLLMSlots).
Last stdout line: {"ours": continuous tok/s, "peer": drain tok/s, "unit": "tok/s", "ratio", ...}.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from scalerl_jax.generation.slots import requests_for
from scalerl_jax.types import PromptSpec, SamplingSpec

INTERRUPT = (400, 401, 402, 403)
#: --memory-bound: a 1024-wide model (~46M params, 184 MB float32, 6x the 32 MB L3 here), one
#: group of 16 per lease and 16 slots.
MEMORY_BOUND = dict(hidden=1024, layers=4, groups=1, group_size=16, capacity=16, leases=12)


def workload(args, seed: int = 0):
  """The leases (lists of prompts of 8-24 random tokens) and the sampling spec."""
  rng = np.random.default_rng(seed)
  leases = [[PromptSpec(l * args.groups + g, rng.integers(3, 400, rng.integers(8, 25)).astype(
      np.int32)) for g in range(args.groups)] for l in range(args.leases)]
  spec = SamplingSpec(temperature=1.0, think_budget_min=args.think_min,
                      think_budget_max=args.think_max, answer_budget=args.answer,
                      interruption_tokens=INTERRUPT, seed=seed)
  return leases, spec


def run_drain(gen, leases, spec, n, chunk: int) -> dict:
  """generate() per lease; occupancy: the tokens each batch decoded vs its rows x its longest
  sample (rounded up to the decode chunk)."""
  t0 = time.perf_counter()
  tokens = slot_steps = 0
  for prompts in leases:
    lengths = [len(c.tokens) for g in gen.generate(prompts, n, spec) for c in g]
    tokens += sum(lengths)
    slot_steps += len(lengths) * -(-max(lengths) // chunk) * chunk
  dt = time.perf_counter() - t0
  return dict(seconds=dt, tokens=tokens, tok_s=tokens / dt, occupancy=tokens / slot_steps)


def run_continuous(make_decoder, leases, spec, n) -> dict:
  """All leases' samples through one continuous decoder (leased ahead: never runs dry)."""
  dec = make_decoder()
  reqs = [r for prompts in leases for r in requests_for(prompts, n, spec)]
  t0 = time.perf_counter()
  out = dec.run(reqs)
  dt = time.perf_counter() - t0
  tokens = sum(len(c.tokens) for _, c in out)
  assert tokens == dec.stats.tokens and len(out) == len(reqs)
  return dict(seconds=dt, tokens=tokens, tok_s=tokens / dt, occupancy=dec.stats.occupancy,
              compute_occupancy=dec.stats.compute_occupancy, moves=dec.stats.moves,
              insert_s=round(dec.stats.insert_s, 3))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--backend", choices=("jax", "vllm"), default="jax")
  ap.add_argument("--leases", type=int, default=6)
  ap.add_argument("--groups", type=int, default=4)
  ap.add_argument("--group-size", type=int, default=16)
  ap.add_argument("--capacity", type=int, default=64)
  ap.add_argument("--think-min", type=int, default=16)
  ap.add_argument("--think-max", type=int, default=128)
  ap.add_argument("--answer", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--chunk", type=int, default=16, help="JAX: decode steps per jitted chunk")
  ap.add_argument("--stop-after", type=int, default=-1,
                  help="JAX continuous: a chunk ends once this many samples finished in it, while "
                       "samples wait (0: whole chunks; -1: the decoder's default, capacity / 8)")
  ap.add_argument("--row-buckets", type=int, default=4,
                  help="JAX: decoded row-count buckets (1 = every slot every step)")
  ap.add_argument("--omp-bind", default="0-1", help="vLLM: OMP threads binding")
  ap.add_argument("--hidden", type=int, default=0,
                  help="model width (0: the tiny model's 256); intermediate = 2.75 x hidden")
  ap.add_argument("--layers", type=int, default=0, help="model depth (0: the tiny model's 4)")
  ap.add_argument("--memory-bound", action="store_true",
                  help=f"preset: {MEMORY_BOUND}: weights far past the CPU's caches and few enough "
                       "slots that a decode step streams the weights once (cost nearly flat in "
                       "the rows in it), as an accelerator's decode step does")
  a = ap.parse_args(argv)
  if a.memory_bound:                  # the preset's values, unless given on the command line
    ap.set_defaults(**MEMORY_BOUND)
    a = ap.parse_args(argv)
  from scalerl_jax.generation.vllm import parity as VP
  tmp = tempfile.mkdtemp(prefix="bench_continuous_")
  width = dict(hidden_size=a.hidden, intermediate_size=a.hidden * 11 // 4,
               num_attention_heads=a.hidden // 64,
               num_key_value_heads=max(1, a.hidden // 256)) if a.hidden else {}
  if a.layers:
    width["num_hidden_layers"] = a.layers
  model_dir = VP.make_tiny_llama(os.path.join(tmp, "model"), lm_head_std=0.02, **width)
  leases, spec = workload(a)
  n = a.group_size
  stop_after = None          # the vLLM side: its engine refills between tokens
  closer = None
  if a.backend == "jax":
    from scalerl_jax import models
    from scalerl_jax.generation.continuous import ContinuousDecoder, default_stop_after
    from scalerl_jax.generation.sampler import JaxSampler
    cfg, params = models.load_hf(model_dir)
    gen = JaxSampler(cfg, params, chunk_steps=a.chunk)
    chunk = gen.chunk_steps
    stop_after = default_stop_after(a.capacity) if a.stop_after < 0 else a.stop_after
    make = lambda: ContinuousDecoder(gen, a.capacity, spec, max_prompt_len=32,
                                     row_buckets=a.row_buckets, stop_after=stop_after)
  else:
    from scalerl_jax.generation.vllm.generator import VLLMGenerator, VLLMSlots
    gen = closer = VLLMGenerator(model_dir, dtype="float32", head_dtype="float32",
                                 enforce_eager=True, omp_threads_bind=a.omp_bind,
                                 max_model_len=32 + a.think_max + len(INTERRUPT) + a.answer + 16,
                                 max_num_seqs=max(a.capacity, a.groups * n))
    chunk = 1
    make = lambda: VLLMSlots(gen, a.capacity, spec)
  try:
    # warm-up: the whole workload once on each side, so that every shape the timed rounds meet
    # (row buckets, windows, prefill and insert sizes) is compiled before them
    run_drain(gen, leases, spec, n, chunk)
    run_continuous(make, leases, spec, n)
    runs = {"drain": [], "continuous": []}
    for _ in range(a.repeats):
      runs["drain"].append(run_drain(gen, leases, spec, n, chunk))
      runs["continuous"].append(run_continuous(make, leases, spec, n))
  finally:
    if closer is not None:
      closer.close()
  med = {k: sorted(v, key=lambda r: r["tok_s"])[len(v) // 2] for k, v in runs.items()}
  for k, v in med.items():
    print(f"[bench.continuous] {a.backend} {k}: {json.dumps(v)}", flush=True)
  ours, peer = med["continuous"], med["drain"]
  print(json.dumps(dict(
      ours=round(ours["tok_s"], 1), peer=round(peer["tok_s"], 1), unit="tok/s",
      ratio=round(ours["tok_s"] / peer["tok_s"], 3), backend=a.backend,
      occupancy_ours=round(ours["occupancy"], 3), occupancy_peer=round(peer["occupancy"], 3),
      tokens=ours["tokens"], workload=dict(leases=a.leases, groups=a.groups, group_size=n,
                                           capacity=a.capacity, chunk=a.chunk, stop_after=stop_after,
                                           think=[a.think_min, a.think_max],
                                           answer=a.answer,
                                           hidden=a.hidden or VP.TINY_LLAMA3["hidden_size"],
                                           layers=a.layers or VP.TINY_LLAMA3["num_hidden_layers"]),
      all_tok_s={k: [round(r["tok_s"], 1) for r in v] for k, v in runs.items()})))


if __name__ == "__main__":
  main()
