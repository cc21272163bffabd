"""Forward throughput: our jitted flax forward vs HF PyTorch eager, same tiny Llama, same weights.

Run: python -m bench.forward [--batch 16 --seq 256 --reps 5]
Last stdout line: {"ours": tok/s, "peer": tok/s, "unit": "tok/s", "ratio": ours/peer, ...}.
Both sides compute float32 logits [B,T,V] for the full batch; timings are medians after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import numpy as np


def _median_times(fns, reps: int) -> list[float]:
  """Median wall time of each fn; reps are interleaved so both sides see the same machine load."""
  ts = [[] for _ in fns]
  cpu = [[] for _ in fns]
  for _ in range(reps):
    for i, fn in enumerate(fns):
      t0, c0 = time.perf_counter(), time.process_time()
      fn()
      ts[i].append(time.perf_counter() - t0)
      cpu[i].append(time.process_time() - c0)
  return [statistics.median(t) for t in ts] + [statistics.median(c) for c in cpu]


def main(argv=None) -> dict:
  """Runs the benchmark; prints progress and, last, one JSON object. Returns that object."""
  ap = argparse.ArgumentParser()
  ap.add_argument("--preset", default="tiny_llama3")
  ap.add_argument("--batch", type=int, default=16)
  ap.add_argument("--seq", type=int, default=256)
  ap.add_argument("--reps", type=int, default=7)
  ap.add_argument("--warmup", type=int, default=2)
  args = ap.parse_args(argv)

  import torch
  from scalerl_jax import models
  from scalerl_jax.models.testing import params_from_torch, random_hf_model, rel_err

  cfg = models.get_preset(args.preset, dtype="float32", param_dtype="float32", scan_layers=False,
                          remat="none")
  hf = random_hf_model(cfg, seed=0)
  hf.config._attn_implementation = "sdpa"  # HF's default (fastest eager) attention on CPU
  params = jax.device_put(params_from_torch(cfg, hf))
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (args.batch, args.seq))
  ttok = torch.as_tensor(tokens, dtype=torch.long)
  ntok = args.batch * args.seq

  fwd = jax.jit(models.forward, static_argnums=1)

  def ours():
    return fwd(params, cfg, tokens).block_until_ready()

  def peer():
    with torch.inference_mode():
      return hf(input_ids=ttok).logits

  for _ in range(args.warmup):
    out_ours, out_peer = ours(), peer()
  err = rel_err(np.asarray(out_ours), out_peer.float().numpy())
  t_ours, t_peer, cpu_ours, cpu_peer = _median_times([ours, peer], args.reps)
  res = dict(ours=ntok / t_ours, peer=ntok / t_peer, unit="tok/s", ratio=t_peer / t_ours,
             preset=args.preset, batch=args.batch, seq=args.seq, reps=args.reps,
             ours_s=t_ours, peer_s=t_peer, ours_cpu_s=cpu_ours, peer_cpu_s=cpu_peer,
             logits_rel_err=err,
             torch_threads=torch.get_num_threads(), cpu_count=os.cpu_count(),
             jax_backend=jax.default_backend(), peer_impl="transformers eager (sdpa), fp32")
  print(f"ours {t_ours * 1e3:.1f} ms, peer {t_peer * 1e3:.1f} ms, rel err {err:.2e}")
  print(json.dumps(res))
  return res


if __name__ == "__main__":
  main()
