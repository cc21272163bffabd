"""Learner train-step throughput: ours (jitted JAX step) vs HF PyTorch eager, same model and batch.

    python -m bench.learner                       # tiny_llama3, b16×s256, fp32, CISPO, AdamW
    python -m bench.learner --preset llama3_8b_slice --peak_tflops 989   # tokens/s + MFU

Both sides: identical weights (HF model → our params), identical rollout batch, float32, the CISPO
loss with prompt aggregation (per-prompt token weights computed once from the batch), global-norm
clip 1.0 and AdamW(lr, eps 1e-15, wd 0.01). Rounds alternate ours/peer so machine contention hits
both alike; the median round is reported (and the best round: `*_best`, less sensitive to other jobs
on a shared machine). Each side's process CPU seconds per step are reported too
(`tok_per_cpu_s_*`, `ratio_cpu`): with ``--threads 1`` that is the work a step takes, which a
loaded machine barely changes, so it compares runs (e.g. XLA flags) made under different load.
The last stdout line is one JSON object.

The 8B-width layer slice (d 4096, 2 layers, heads 32/8, ffn 14336, vocab 128256) does not fit a
small CPU box with AdamW state; on CPU it runs scaled down by ``--width_div`` (default 8: widths,
heads and vocab / 8, head_dim 128 kept) and reports tokens/s and MFU against ``--peak_tflops``
(default: bf16 dense peak of an H100 SXM, 989 TFLOP/s, on GPU; an estimate of the CPU's fp32 peak —
cores × 2.6 GHz × 32 FLOP/cycle — on CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time

import numpy as np


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--preset", default="tiny_llama3", help="tiny_llama3 | llama3_8b_slice")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seq", type=int, default=256)
  p.add_argument("--rounds", type=int, default=5, help="timed rounds per side")
  p.add_argument("--steps", type=int, default=2, help="train steps per timed round")
  p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                 help="CPUs for both sides: torch threads, and the process's affinity mask "
                      "(set before JAX is imported, so XLA's pools use as many)")
  p.add_argument("--width_div", type=int, default=0, help="8B slice: divide widths (0 = auto)")
  p.add_argument("--peak_tflops", type=float, default=0.0, help="peak FLOP/s for MFU (TFLOP/s)")
  p.add_argument("--no_peer", action="store_true", help="skip the PyTorch side")
  p.add_argument("--peer_attn", default="sdpa", help="HF attention implementation: sdpa | eager")
  p.add_argument("--attention", default="auto",
                 help="our attention_impl: auto | xla_einsum | blockwise | causal_blocks | cudnn | "
                      "splash (models/attention.py)")
  p.add_argument("--head_precision", default="fp32", choices=("fp32", "tf32", "bf16"),
                 help="LM-head matmul on BOTH sides: fp32 (ours Precision.HIGHEST; the peer's head "
                      "outside autocast, TF32 off), tf32 (ours HIGH; peer fp32 with TF32 on), bf16 "
                      "(ours bf16 operands, f32 accumulation; peer's head under bf16 autocast)")
  p.add_argument("--remat", default="none", help="our remat policy: none | dots | full")
  p.add_argument("--q_block", type=int, default=64, help="causal_blocks query-block size")
  return p.parse_args(argv)


def model_config(preset: str, width_div: int, backend: str, attention: str = "auto",
                 head_precision: str = "fp32", remat: str = "none", q_block: int = 64):
  from scalerl_jax import models
  kw = dict(attention_impl=attention, head_precision=head_precision, remat=remat,
            attention_q_block=q_block)
  if preset != "llama3_8b_slice":
    return models.get_preset(preset, dtype="float32", param_dtype="float32", **kw)
  div = width_div or (1 if backend == "gpu" else 8)
  return models.get_preset(
      "llama3_8b", num_layers=2, d_model=4096 // div, num_heads=32 // div,
      num_kv_heads=max(8 // div, 1), head_dim=128, ffn_dim=14336 // div,
      vocab_size=128256 // div, dtype="float32" if backend == "cpu" else "bfloat16",
      param_dtype="float32", scan_layers=False, bos_token_id=None, eos_token_id=None, **kw)


def make_batch(cfg, b: int, t: int, seed: int = 0, gens: int = 4) -> dict:
  """b = prompts × gens rows; first quarter of each row is prompt, the rest completion (ragged)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, cfg.vocab_size, (b, t)).astype(np.int32)
  mask = np.zeros((b, t), bool)
  for i in range(b):
    start = t // 4
    mask[i, start:start + rng.integers(t // 2, t - start + 1)] = True
  gen = np.minimum(-np.log(cfg.vocab_size) + 0.3 * rng.standard_normal((b, t)), -1e-3)
  rewards = rng.integers(0, 2, b).astype(np.float32)
  rewards[::gens] = 1.0; rewards[1::gens] = 0.0                  # no zero-variance group
  return dict(tokens=tokens, gen_logprobs=gen.astype(np.float32), loss_mask=mask,
              rewards=rewards, prompt_ids=np.repeat(np.arange(b // gens), gens).astype(np.int32))


def attention_flops(cfg, b: int, t: int, impl: str, q_block: int = 64) -> float:
  """Training FLOPs (forward + backward = 3x forward) of the score and probability-value
  matmuls as each kernel executes them: 'full' computes all T x T tiles (our xla_einsum /
  blockwise, HF eager), 'causal' only the lower triangle (HF sdpa's CPU flash kernel and cuDNN
  skip the masked blocks; modelled as T(T+1)/2), 'causal_blocks' the lower block triangle
  (query blocks of `q_block` slots see keys up to their block's end)."""
  per_pair = 2 * 2 * cfg.num_heads * cfg.head_dim            # QK^T and PV, 2 FLOPs per MAC
  if impl == "causal_blocks":
    pairs = sum(min(s + q_block, t) * (min(s + q_block, t) - s) for s in range(0, t, q_block))
  elif impl == "causal":
    pairs = t * (t + 1) // 2
  else:
    pairs = t * t
  return 3.0 * per_pair * pairs * b * cfg.num_layers


def flops_per_token(cfg, t: int) -> float:
  """Training FLOPs/token: 6·(matmul params) + 6·L·T·H·Dh (causal attention QK^T and AV, fwd+bwd)."""
  d, h, k, dh, f, v, layers = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                               cfg.ffn_dim, cfg.vocab_size, cfg.num_layers)
  per_layer = d * (h + 2 * k) * dh + h * dh * d + 3 * d * f
  n = layers * per_layer + d * v                                   # embedding lookup is free
  return 6.0 * n + 6.0 * layers * t * h * dh


def ours(cfg, params, batch, run):
  """Returns (step() -> loss, sync(), XLA's FLOPs of one compiled step or NaN off CPU) for the
  jitted JAX learner."""
  import jax
  import jax.numpy as jnp
  from scalerl_jax import models
  from scalerl_jax.learner import Learner
  learner = Learner.for_run(lambda p, tok, pos: models.forward_hidden(p, cfg, tok, pos),
                            jax.tree.map(jnp.asarray, params), run, with_entropy=False)
  dev_batch = learner.device_batch(batch)
  # XLA's own FLOP count of the compiled step. CPU only: on GPU the matmuls are cuBLAS / cuDNN
  # custom calls that cost analysis does not count (an H200 run read 91 GFLOP for a 96 TFLOP step).
  # The step's attention is guarded by a lax.cond (slot layout -> fast kernel, else blockwise)
  # that cost analysis counts as its costlier branch; the batch here is slot layout, so the count
  # is taken of the path that runs (attention.executed_branch_only), checked on the batch first.
  hlo_flops = float("nan")
  if jax.default_backend() == "cpu":
    from scalerl_jax.models import attention as attention_lib
    pos = np.broadcast_to(np.arange(batch["tokens"].shape[1], dtype=np.int32),
                          batch["tokens"].shape)
    assert bool(attention_lib.slot_layout(jnp.asarray(pos), jnp.asarray(pos)))
    # A learner of its own: its jitted step is another function, so the timed learner's trace
    # (with the cond) is never the one made here.
    counted = Learner.for_run(lambda p, tok, pos: models.forward_hidden(p, cfg, tok, pos),
                              jax.tree.map(jnp.asarray, params), run, with_entropy=False,
                              donate=False)
    with attention_lib.executed_branch_only():
      lowered = counted._step.lower(counted.state, dev_batch)
    del counted
    cost = lowered.compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo_flops = float(cost.get("flops", float("nan")))

  def step():
    learner.state, m = learner._step(learner.state, dev_batch)
    return m

  def sync(m):
    return float(m["loss"])
  return step, sync, hlo_flops


def peer(cfg, hf_model, batch, config, head_precision: str = "fp32"):
  """HF PyTorch eager train step with the same CISPO / prompt-aggregation loss.

  On GPU the body runs under bf16 autocast (fp32 master weights), like our bf16 compute; the LM
  head runs as `head_precision` says, matched to ours: fp32 = hidden and lm_head weight in float32
  outside autocast with TF32 off, tf32 = the same with TF32 on, bf16 = under autocast."""
  import torch
  o = config.optim
  opt = torch.optim.AdamW(hf_model.parameters(), lr=o.lr, betas=(o.b1, o.b2), eps=o.eps,
                          weight_decay=o.weight_decay)
  warm = max(int(o.warmup_steps), 1)                       # same warm-up as ours
  sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
  hf_model.train()
  dev = next(hf_model.parameters()).device
  tok = torch.as_tensor(batch["tokens"], dtype=torch.long, device=dev)
  gen = torch.as_tensor(batch["gen_logprobs"], device=dev)[:, 1:]
  mask = torch.as_tensor(batch["loss_mask"], device=dev)[:, 1:]
  r = torch.as_tensor(batch["rewards"], device=dev)
  pid = torch.as_tensor(batch["prompt_ids"], device=dev)
  # On GPU the peer computes in bf16 autocast with fp32 master weights, like our bf16 compute.
  autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda"
              else contextlib.nullcontext())
  same = (pid[:, None] == pid[None, :]).float()
  adv = r - same @ r / same.sum(1)
  adv = adv / (adv.std(unbiased=False) + 1e-6)
  group_tokens = same @ mask.float().sum(1)
  w = mask.float() / group_tokens[:, None]
  denom = w.sum()

  torch.backends.cuda.matmul.allow_tf32 = head_precision == "tf32"
  head_w = hf_model.get_output_embeddings().weight

  def step():
    opt.zero_grad(set_to_none=True)
    with autocast:
      hidden = hf_model.model(input_ids=tok).last_hidden_state
      if head_precision == "bf16":
        logits = hf_model.get_output_embeddings()(hidden)
    if head_precision != "bf16":
      logits = hidden.float() @ head_w.float().t()
    logits = logits.float()[:, :-1]
    logp = torch.log_softmax(logits, -1).gather(-1, tok[:, 1:, None])[..., 0]
    ratio = torch.exp(logp.detach() - gen)
    term = -torch.clamp(ratio, max=config.rl.cispo_eps_max) * adv[:, None] * logp
    loss = (w * term).sum() / denom
    loss.backward()
    torch.nn.utils.clip_grad_norm_(hf_model.parameters(), o.max_grad_norm)
    opt.step()
    sched.step()
    return loss.detach()

  return step, lambda m: float(m)


def _num(x: float, digits: int):
  """round(x, digits), or None for NaN (JSON has no NaN)."""
  return None if x != x else round(x, digits)


def _time(step, sync, steps):
  """(wall seconds, process CPU seconds) of `steps` steps."""
  t0, c0 = time.perf_counter(), time.process_time()
  m = None
  for _ in range(steps):
    m = step()
  sync(m)
  return time.perf_counter() - t0, time.process_time() - c0


def main(argv=None):
  args = _args(argv)
  # Both sides on the same `threads` CPUs: the affinity mask is set before JAX and torch are
  # imported (XLA:CPU sizes its thread pools from the schedulable CPUs, torch from
  # set_num_threads). The old `--threads 1` appended a malformed XLA flag that was ignored, so XLA
  # kept every core while torch had one (wall ratio 1.017 where the CPU-time ratio was 0.558).
  affinity = None
  if hasattr(os, "sched_setaffinity") and args.threads < len(os.sched_getaffinity(0)):
    affinity = sorted(os.sched_getaffinity(0))[:args.threads]
    os.sched_setaffinity(0, affinity)
  import jax
  import torch
  from scalerl_jax import config as common
  from scalerl_jax.models import testing
  torch.set_num_threads(args.threads)
  backend = jax.default_backend()
  cfg = model_config(args.preset, args.width_div, backend, args.attention, args.head_precision,
                     args.remat, args.q_block)
  config = common.resolve("configs/tiny.py", [   # the learner's chunked head reads head_precision
      "--config.optim.lr=5e-7", "--config.optim.warmup_steps=100", "--config.optim.microbatches=1",
      f"--config.model.head_precision={cfg.head_precision}"])
  batch = make_batch(cfg, args.batch, args.seq)
  hf_model = testing.random_hf_model(dataclasses.replace(cfg, dtype="float32"), seed=0)
  params = testing.params_from_torch(cfg, hf_model)
  n_params = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(params))
  tokens_per_step = args.batch * args.seq

  o_step, o_sync, hlo_flops = ours(cfg, params, batch, config)
  t0 = time.perf_counter()
  loss_ours = [o_sync(o_step())]                       # compile + first step
  t_compile = time.perf_counter() - t0
  loss_ours.append(o_sync(o_step()))
  sides = {"ours": (o_step, o_sync)}
  loss_peer = None
  if not args.no_peer:
    hf_model.set_attn_implementation(args.peer_attn)
    if backend == "gpu" and torch.cuda.is_available():
      hf_model.cuda()
    p_step, p_sync = peer(cfg, hf_model, batch, config, args.head_precision)
    loss_peer = [p_sync(p_step()), p_sync(p_step())]   # also warms up the allocator
    sides["peer"] = (p_step, p_sync)
  times = {k: [] for k in sides}
  cpu = {k: [] for k in sides}
  for _ in range(args.rounds):
    for name, (step, sync) in sides.items():           # interleaved: contention hits both
      wall, cpu_s = _time(step, sync, args.steps)
      times[name].append(wall / args.steps)
      cpu[name].append(cpu_s / args.steps)
  # CPU seconds per step: with --threads 1 the work done, nearly independent of other jobs' load
  # (a loaded box stretches wall time, not the CPU time a single-threaded step needs).
  cpu_tok_s = {k: tokens_per_step / statistics.median(v) for k, v in cpu.items()}
  tok_s = {k: tokens_per_step / statistics.median(v) for k, v in times.items()}
  best = {k: tokens_per_step / min(v) for k, v in times.items()}   # least-disturbed round
  fpt = flops_per_token(cfg, args.seq)
  from scalerl_jax.models import attention as attention_lib
  impl = attention_lib.resolve(cfg.attention_impl)
  if impl == "causal_blocks" and args.seq > attention_lib.CAUSAL_BLOCKS_MAX_T:
    impl = "blockwise"
  ours_kernel = {"cudnn": "causal", "splash": "causal"}.get(impl, impl)
  peer_kernel = "causal" if args.peer_attn == "sdpa" else "full"
  attn = {side: attention_flops(cfg, args.batch, args.seq, kern, cfg.attention_q_block)
          for side, kern in (("ours", ours_kernel), ("peer", peer_kernel))}
  six_nt = fpt * tokens_per_step
  peak = args.peak_tflops * 1e12 if args.peak_tflops else (
      989e12 if backend == "gpu" else args.threads * 2.6e9 * 32)
  load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
  res = dict(ours=round(tok_s["ours"], 1), peer=round(tok_s.get("peer", float("nan")), 1),
             unit="tok/s", ratio=round(tok_s["ours"] / tok_s["peer"], 3) if "peer" in tok_s else None,
             ours_best=round(best["ours"], 1), peer_best=round(best.get("peer", float("nan")), 1),
             ratio_best=round(best["ours"] / best["peer"], 3) if "peer" in best else None,
             preset=args.preset, batch=args.batch, seq=args.seq, params=n_params,
             backend=backend, threads=args.threads, cpus=affinity, loadavg_1m=load,
             step_s_ours=[round(x, 3) for x in times["ours"]],
             step_s_peer=[round(x, 3) for x in times.get("peer", [])],
             tok_per_cpu_s_ours=round(cpu_tok_s["ours"], 1),
             tok_per_cpu_s_peer=round(cpu_tok_s.get("peer", float("nan")), 1),
             ratio_cpu=(round(cpu_tok_s["ours"] / cpu_tok_s["peer"], 3) if "peer" in cpu_tok_s
                        else None),
             compile_and_first_step_s=round(t_compile, 2),
             loss_steps12_ours=loss_ours, loss_steps12_peer=loss_peer,
             peer_attn=None if args.no_peer else args.peer_attn, attention=impl,
             head_precision=args.head_precision, remat=cfg.remat,
             affinity_before_import=affinity is not None,
             hlo_gflop_per_step=_num(hlo_flops / 1e9, 2),
             six_nt_gflop_per_step=round(six_nt / 1e9, 2),
             hlo_over_6nt=_num(hlo_flops / six_nt, 3),
             attn_gflop_ours=round(attn["ours"] / 1e9, 2), attn_kernel_ours=ours_kernel,
             attn_gflop_peer=round(attn["peer"] / 1e9, 2),
             attn_kernel_peer=None if args.no_peer else peer_kernel,
             flops_per_token=fpt, peak_flops=peak,
             mfu_ours=round(tok_s["ours"] * fpt / peak, 4),
             mfu_peer=round(tok_s["peer"] * fpt / peak, 4) if "peer" in tok_s else None,
             model=dict(d=cfg.d_model, layers=cfg.num_layers, heads=cfg.num_heads,
                        kv_heads=cfg.num_kv_heads, ffn=cfg.ffn_dim, vocab=cfg.vocab_size))
  print(json.dumps(res))
  return res


if __name__ == "__main__":
  main(sys.argv[1:])
