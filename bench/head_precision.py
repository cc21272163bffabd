"""LM-head precision: log-prob error of each `model.head_precision` against a float64 reference.

    python -m bench.head_precision                 # CPU: a 512 x 16,032 head (8B's / 8)
    python -m bench.head_precision --full          # the 8B head, 4096 x 128,256 (GPU)

The head multiplies the final hidden state h [N, D] (RMS-normalised, as the final norm leaves
it) by the kernel W [D, V] (std chosen so the logits have std `--logit_std`, default 3, a peaked
distribution as a trained model's). Targets are sampled from the float64 softmax (the tokens an RL
generator would emit). For each precision (models.layers.head_matmul: fp32 = Precision.HIGHEST,
tf32, bf16 operands with fp32 accumulation) it reports the max and mean |log p - log p_64| over
the N tokens, the largest importance-ratio error |exp(log p - log p_64) - 1| (what CISPO's ratio
sees) and the head's time (median of `--reps`, after a warm-up). The peer is PyTorch's float32
F.linear with TF32 off (the head HF runs when autocast is off) on the same inputs. On CPU the
three precisions differ only by bf16's operand rounding (XLA:CPU has no TF32). Last line: JSON,
ours/peer = mean |error| of our fp32 head / the peer's (ratio > 1: ours more accurate).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np

from bench.common import last_line


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--full", action="store_true", help="the 8B head (4096 x 128256)")
  p.add_argument("--tokens", type=int, default=0, help="rows N (0: 2048 full, 256 otherwise)")
  p.add_argument("--logit_std", type=float, default=3.0)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def reference(h: np.ndarray, w: np.ndarray, tgt: np.ndarray) -> np.ndarray:
  """log p(tgt) in float64, blockwise over rows (the [N, V] float64 logits of one block)."""
  out = np.empty(len(tgt))
  for i in range(0, len(tgt), 256):
    z = h[i:i + 256].astype(np.float64) @ w.astype(np.float64)
    m = z.max(1, keepdims=True)
    lse = (m + np.log(np.exp(z - m).sum(1, keepdims=True)))[:, 0]
    out[i:i + 256] = z[np.arange(len(z)), tgt[i:i + 256]] - lse
  return out


def _errors(lp, ref):
  d = np.asarray(lp, np.float64) - ref
  return dict(max_abs=float(np.abs(d).max()), mean_abs=float(np.abs(d).mean()),
              max_ratio_err=float(np.abs(np.expm1(d)).max()))


def _timed(fn, reps):
  fn()
  ts = []
  for _ in range(reps):
    t0 = time.perf_counter()
    fn()
    ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def main(argv=None):
  args = _args(argv)
  import jax
  import jax.numpy as jnp
  import torch
  from scalerl_jax.models.layers import head_matmul
  d, v = (4096, 128256) if args.full else (512, 16032)
  n = args.tokens or (2048 if args.full else 256)
  rng = np.random.default_rng(args.seed)
  h = rng.standard_normal((n, d)).astype(np.float32)
  h /= np.sqrt((h * h).mean(1, keepdims=True))
  w = (rng.standard_normal((d, v)) * args.logit_std / np.sqrt(d)).astype(np.float32)
  # Targets from the float64 distribution (Gumbel-max on the exact logits).
  tgt = np.empty(n, np.int64)
  for i in range(0, n, 256):
    z = h[i:i + 256].astype(np.float64) @ w.astype(np.float64)
    tgt[i:i + 256] = np.argmax(z + rng.gumbel(size=z.shape), axis=1)
  ref = reference(h, w, tgt)
  hj, wj, tj = jnp.asarray(h), jnp.asarray(w), jnp.asarray(tgt.astype(np.int32))
  rows = {}
  for prec in ("fp32", "tf32", "bf16"):
    @jax.jit
    def logp(hh, ww, prec=prec):
      z = head_matmul(hh, ww, prec)
      return jnp.take_along_axis(z, tj[:, None], 1)[:, 0] - jax.nn.logsumexp(z, axis=1)
    lp = np.asarray(logp(hj, wj))
    ms = _timed(lambda: logp(hj, wj).block_until_ready(), args.reps)
    rows[prec] = dict(_errors(lp, ref), ms=round(ms, 3))
  dev = "cuda" if torch.cuda.is_available() else "cpu"
  torch.backends.cuda.matmul.allow_tf32 = False
  ht, wt = torch.as_tensor(h, device=dev), torch.as_tensor(w.T.copy(), device=dev)
  tt = torch.as_tensor(tgt, device=dev)

  def peer():
    z = torch.nn.functional.linear(ht, wt)
    return z.gather(1, tt[:, None])[:, 0] - torch.logsumexp(z, 1)
  lp_peer = peer().cpu().numpy()
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  ms_peer = _timed(lambda: (peer(), sync()), args.reps)
  rows["peer_fp32"] = dict(_errors(lp_peer, ref), ms=round(ms_peer, 3))
  for name, r in rows.items():
    print(f"{name:10s} max|dlogp| {r['max_abs']:.3e}  mean|dlogp| {r['mean_abs']:.3e}  "
          f"max|ratio-1| {r['max_ratio_err']:.3e}  {r['ms']:.2f} ms", file=sys.stderr)
  return last_line(rows["fp32"]["mean_abs"], rows["peer_fp32"]["mean_abs"],
                   "mean |log p - log p_float64|", higher_is_better=False, head=[d, v], tokens=n,
                   logit_std=args.logit_std, backend=jax.default_backend(), precisions=rows)


if __name__ == "__main__":
  main(sys.argv[1:])
