"""Attention kernels of the cache-free (training / scoring) forward, one API, several backends.

    out = attention(q, k, v, q_pos, kv_pos, impl="auto", chunk_size=None, block=512)

q [B,T,N,H]; k, v [B,S,K,H] (GQA: N = K*G); q_pos int32 [B,T], kv_pos int32 [B,S] (-1 = padding).
A query at position p sees keys with 0 <= pos_k <= p and, when `chunk_size` C is set (Llama-4
chunked-local layers), pos_k // C == p // C. NoPE temperature tuning and QK-norm act on q / k
before the kernel, so every backend handles them. A query that sees no key (a padding query)
returns 0 in `blockwise` (and has no gradient); its value is unspecified in the other backends:
callers never use it (the loss masks padding).

Backends (`ModelConfig.attention_impl`, `config.model.attention_impl`):

  xla_einsum  reference: the [B,N,T,S] f32 scores materialised (O(T*S) memory per head).
  blockwise   pure JAX flash attention: online softmax over key blocks of `block` slots, with a
              custom_vjp whose backward recomputes each block's probabilities from the saved
              log-sum-exp (memory O(T*block) per head, forward and backward). Any platform.
  causal_blocks  heads-major, queries cut into blocks of `q_block` slots; block i attends only to
              key slots [0, end of block i): the tiles above the diagonal are never computed
              (about half the score work at 8 blocks). Per block a plain masked softmax whose
              probabilities autodiff keeps for the backward (no recompute; O(T^2/2) per head
              saved, so T > CAUSAL_BLOCKS_MAX_T takes the blockwise path). Exact only in slot
              order (below); otherwise it takes the blockwise path. The CPU default.
  cudnn       jax.nn.dot_product_attention(implementation="cudnn"): cuDNN flash attention (GPU).
  splash      Pallas splash attention (jax.experimental.pallas.ops.tpu.splash_attention, TPU).
  auto        cudnn on GPU, splash on TPU, causal_blocks elsewhere.

causal_blocks, cudnn and splash express the causal structure in *slot* coordinates (causal by slot, chunks counted from slot
0, right padding as sequence lengths / segment ids). That equals the position mask only when every
row has positions 0..len-1 followed by padding (the learner's layout). Each call checks this on the
device and otherwise takes the blockwise path (lax.cond): never a wrong answer, only a slower one.

Shape letters: B batch, T query slots, S key slots, N query heads, K kv heads, G = N/K, H head_dim,
C chunk index, J query slots of one chunk.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from typing import Literal, cast

import jax
import jax.numpy as jnp
import numpy as np

from scalerl_jax.models.config import ATTENTION_IMPLS as IMPLS

# causal_blocks keeps each query block's probabilities for the backward (O(T^2/2) per head);
# longer sequences take the blockwise (flash) path, whose memory is O(T * block).
CAUSAL_BLOCKS_MAX_T = 4096
_MASKED = float(np.finfo(np.float32).min)
_FAST_PATH_ONLY = [False]   # executed_branch_only(): trace the slot-layout path without the cond


@contextlib.contextmanager
def executed_branch_only():
  """While tracing inside this context, `attention` emits only its slot-layout path, without the
  lax.cond that guards it. For XLA cost analysis alone: cost analysis counts a cond as its costlier
  branch, so a causal_blocks step's HLO FLOPs included the blockwise fallback that a learner batch
  (always slot layout) never runs. The caller must check `slot_layout` on its batch; never train
  inside it."""
  _FAST_PATH_ONLY[0] = True
  try:
    yield
  finally:
    _FAST_PATH_ONLY[0] = False
# Which platform each accelerator-only backend needs.
_NEEDS = {"cudnn": "gpu", "splash": "tpu"}


# ------------------------------------------------------------------ backend choice
def installed_platform() -> str:
  """The platform JAX will use, WITHOUT initialising a backend (safe before jax.distributed).

  $JAX_PLATFORMS / jax_platforms (first entry) if set, else 'tpu' when libtpu is installed, 'gpu'
  when a CUDA/ROCm plugin is installed, else 'cpu'.
  """
  names = os.environ.get("JAX_PLATFORMS") or jax.config.values["jax_platforms"] or ""
  first = names.split(",")[0].strip().lower()
  if first:
    return {"cuda": "gpu", "rocm": "gpu"}.get(first, first)
  if importlib.util.find_spec("libtpu") is not None:
    return "tpu"
  for plugin in ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin"):
    if importlib.util.find_spec(plugin) is not None:
      return "gpu"
  return "cpu"


def check_available(impl: str, platform: str) -> None:
  """ValueError when `impl` is unknown or needs another platform (e.g. cudnn on CPU)."""
  if impl not in IMPLS:
    raise ValueError(f"attention_impl={impl!r}; expected one of {IMPLS}")
  need = _NEEDS.get(impl)
  if need is not None and platform != need:
    raise ValueError(f"attention_impl={impl!r} needs a {need.upper()} (JAX platform "
                     f"{need!r}); this process runs on {platform!r}. Use 'auto' or 'blockwise'.")


def resolve(impl: str, platform: str | None = None) -> str:
  """The concrete backend of `impl` on `platform` (default: the running backend)."""
  platform = platform or jax.default_backend()
  check_available(impl, platform)
  if impl == "auto":
    return {"gpu": "cudnn", "tpu": "splash"}.get(platform, "causal_blocks")
  return impl


# ------------------------------------------------------------------ the one entry point
def attention(q, k, v, q_pos, kv_pos, *, impl: str = "auto", chunk_size: int | None = None,
              block: int = 512, scale: float | None = None, q_block: int = 64):
  """Causal (optionally chunked-local) GQA attention with masks from positions; see module doc."""
  scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
  impl = resolve(impl)
  if impl == "causal_blocks" and (q.shape[1] > CAUSAL_BLOCKS_MAX_T or q.shape[1] != k.shape[1]):
    impl = "blockwise"
  if impl == "xla_einsum":
    return einsum_attention(q, k, v, q_pos, kv_pos, chunk_size=chunk_size, scale=scale)
  if impl == "blockwise":
    return blockwise_attention(q, k, v, q_pos, kv_pos, chunk_size=chunk_size, block=block,
                               scale=scale)
  slow = lambda *a: blockwise_attention(*a, chunk_size=chunk_size, block=block, scale=scale)
  if impl == "causal_blocks":
    fast = lambda *a, **kw: causal_block_attention(*a, q_block=q_block, **kw)
  elif impl == "cudnn":
    fast = functools.partial(dot_product_attention_slots, implementation="cudnn")
  else:
    fast = splash_attention_slots
  run_fast = lambda *a: fast(*a, chunk_size=chunk_size, scale=scale).astype(q.dtype)
  if _FAST_PATH_ONLY[0]:
    return run_fast(q, k, v, q_pos, kv_pos)
  return jax.lax.cond(slot_layout(q_pos, kv_pos), run_fast, slow, q, k, v, q_pos, kv_pos)


def position_mask(q_pos, kv_pos, chunk_size: int | None):
  """bool [B,T,S]: key s visible to query t (causal by position, chunked-local, no padding)."""
  qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
  m = (kp >= 0) & (qp >= 0) & (kp <= qp)
  if chunk_size is not None:
    m &= (kp // chunk_size) == (qp // chunk_size)
  return m


def slot_layout(q_pos, kv_pos):
  """bool []: every row is positions 0..len-1 then padding (-1), and keys = queries."""
  if q_pos.shape != kv_pos.shape:
    return jnp.asarray(False)
  slots = jnp.arange(q_pos.shape[1], dtype=q_pos.dtype)[None]
  valid = q_pos >= 0
  prefix = jnp.all(valid[:, 1:] <= valid[:, :-1])
  return prefix & jnp.all(jnp.where(valid, q_pos == slots, True)) & jnp.all(q_pos == kv_pos)


# ------------------------------------------------------------------ xla_einsum (reference)
def einsum_attention(q, k, v, q_pos, kv_pos, *, chunk_size=None, scale=None):
  """The reference: f32 scores [B,K,G,T,S] materialised, masked softmax, probs in v.dtype."""
  B, T, N, H = q.shape
  K = k.shape[2]
  scale = H ** -0.5 if scale is None else scale
  qg = q.reshape(B, T, K, N // K, H)
  scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k).astype(jnp.float32) * scale
  mask = position_mask(q_pos, kv_pos, chunk_size)
  scores = jnp.where(mask[:, None, None], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
  return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, T, N, H)


# ------------------------------------------------------------------ causal_blocks (slot order)
def causal_block_attention(q, k, v, q_pos, kv_pos, *, chunk_size=None, scale=None, q_block=64):
  """Heads-major attention over query blocks, skipping the key tiles above the diagonal.

  Query block i (slots [i*Q, (i+1)*Q)) attends to key slots [0, (i+1)*Q) only: exact when a key
  after a query's slot is never visible to it, which `slot_layout` guarantees (`attention` checks
  it and otherwise takes the blockwise path). Within that range the position mask (padding,
  chunked-local) applies as everywhere. Scores f32 [B,K,G,Q,S_i]; a padding query's output is
  unspecified (the loss masks it). q [B,T,N,H]; k, v [B,T,K,H] (keys = queries).
  """
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  scale = float(H ** -0.5 if scale is None else scale)
  Q = int(max(1, min(q_block, T)))
  # [B,K,T,G,H]: a query block's T-slice is contiguous with its G heads, so each block's two
  # products are plain batched matmuls over (B,K) with M = Q*G rows ("BKMH,BKSH->BKMS").
  qh = jnp.einsum("BTKGH->BKTGH", q.reshape(B, T, K, G, H))
  kh, vh = jnp.einsum("BSKH->BKSH", k), jnp.einsum("BSKH->BKSH", v)
  outs = []
  for start in range(0, T, Q):
    end = min(start + Q, T)
    rows = (end - start) * G
    s = jnp.einsum("BKMH,BKSH->BKMS", qh[:, :, start:end].reshape(B, K, rows, H), kh[:, :, :end],
                   preferred_element_type=jnp.float32) * scale
    m = position_mask(q_pos[:, start:end], kv_pos[:, :end], chunk_size)      # [B,Q,S_i]
    s = jnp.where(m[:, None, :, None], s.reshape(B, K, end - start, G, end), _MASKED)
    p = jax.nn.softmax(s, axis=-1).astype(v.dtype).reshape(B, K, rows, end)
    outs.append(jnp.einsum("BKMS,BKSH->BKMH", p, vh[:, :, :end]).reshape(B, K, end - start, G, H))
  out = jnp.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]        # [B,K,T,G,H]
  return jnp.einsum("BKTGH->BTKGH", out).reshape(B, T, N, H)


# ------------------------------------------------------------------ blockwise (flash, pure JAX)
def blockwise_attention(q, k, v, q_pos, kv_pos, *, chunk_size=None, block=512, scale=None):
  """Flash attention in pure JAX: online softmax over key blocks, recompute backward.

  Memory per head: O(T*block) for the score tile in both passes, plus the O(T) log-sum-exp saved
  for the backward; the [T,S] scores never exist.
  """
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  scale = float(H ** -0.5 if scale is None else scale)
  block = int(min(block, S))
  pad = -S % block
  if pad:   # padded key slots carry position -1: never visible
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    kv_pos = jnp.pad(kv_pos, ((0, 0), (0, pad)), constant_values=-1)
  qg = q.reshape(B, T, K, N // K, H)
  # cast: custom_vjp applied through functools.partial loses _flash's return type
  out = cast(jax.Array, _flash(qg, k, v, q_pos.astype(jnp.int32), kv_pos.astype(jnp.int32),
                               chunk_size, block, scale))
  return out.reshape(B, T, N, H)


def _key_blocks(x, block):
  """[B,S,...] -> [S/block, B, block, ...] (the scanned axis first)."""
  b, s = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, s // block, block, *x.shape[2:]), 1, 0)


def _tile_mask(qp, kv_pos, i, block, chunk_size):
  """bool [B,1,1,T,block] of key block i (broadcast over K, G). The block's positions are sliced
  with the carried index i, so XLA cannot precompute every block's mask as one [nb,...,T,block]
  array outside the loop (it did when they came in as scanned inputs)."""
  kp = jax.lax.dynamic_slice_in_dim(kv_pos, i * block, block, axis=1)
  return position_mask(qp, kp, chunk_size)[:, None, None]


def _flash_fwd_impl(qg, k, v, q_pos, kv_pos, chunk_size, block, scale):
  """(out [B,T,K,G,H] in q.dtype, lse [B,K,G,T] f32; +inf where a query sees no key)."""
  B, T, K, G, H = qg.shape
  f32 = jnp.float32

  def step(carry, xs):
    i, m, l, acc = carry
    kb, vb = xs
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kb, preferred_element_type=f32) * scale
    s = jnp.where(_tile_mask(q_pos, kv_pos, i, block, chunk_size), s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(s - m_safe[..., None])                                   # masked -> 0
    corr = jnp.exp(m - m_safe)                                           # m = -inf -> 0
    l = l * corr + jnp.sum(p, axis=-1)
    pv = jnp.einsum("BKGTS,BSKH->BKGTH", p.astype(vb.dtype), vb, preferred_element_type=f32)
    return (i + 1, m_new, l, acc * corr[..., None] + pv), None

  init = (jnp.zeros((), jnp.int32), jnp.full((B, K, G, T), -jnp.inf, f32),
          jnp.zeros((B, K, G, T), f32), jnp.zeros((B, K, G, T, H), f32))
  xs = (_key_blocks(k, block), _key_blocks(v, block))
  (_, m, l, acc), _ = jax.lax.scan(step, init, xs)
  seen = l > 0
  out = acc / jnp.where(seen, l, 1.0)[..., None]
  lse = jnp.where(seen, jnp.where(jnp.isfinite(m), m, 0.0) + jnp.log(jnp.where(seen, l, 1.0)),
                  jnp.inf)
  return jnp.einsum("BKGTH->BTKGH", out).astype(qg.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _flash(qg, k, v, q_pos, kv_pos, chunk_size, block, scale) -> jax.Array:
  return _flash_fwd_impl(qg, k, v, q_pos, kv_pos, chunk_size, block, scale)[0]


def _flash_fwd(qg, k, v, q_pos, kv_pos, chunk_size, block, scale):
  out, lse = _flash_fwd_impl(qg, k, v, q_pos, kv_pos, chunk_size, block, scale)
  return out, (qg, k, v, q_pos, kv_pos, out, lse)


def _flash_bwd(chunk_size, block, scale, res, dout):
  """FlashAttention-2 backward: per key block recompute p = exp(s - lse); dq accumulates over
  blocks, dk / dv of each block are the scan's outputs."""
  qg, k, v, q_pos, kv_pos, out, lse = res
  f32 = jnp.float32
  do = dout.astype(f32)
  delta = jnp.einsum("BTKGH,BTKGH->BKGT", do, out.astype(f32))          # rowsum(dO * O)
  do_c = dout.astype(v.dtype)

  def step(carry, xs):
    i, dq = carry
    kb, vb = xs
    s = jnp.einsum("BTKGH,BSKH->BKGTS", qg, kb, preferred_element_type=f32) * scale
    p = jnp.where(_tile_mask(q_pos, kv_pos, i, block, chunk_size), jnp.exp(s - lse[..., None]),
                  0.0)
    dv = jnp.einsum("BKGTS,BTKGH->BSKH", p.astype(do_c.dtype), do_c, preferred_element_type=f32)
    dp = jnp.einsum("BTKGH,BSKH->BKGTS", do_c, vb, preferred_element_type=f32)
    ds = (p * (dp - delta[..., None])).astype(qg.dtype)
    dq = dq + jnp.einsum("BKGTS,BSKH->BTKGH", ds, kb, preferred_element_type=f32) * scale
    dk = jnp.einsum("BKGTS,BTKGH->BSKH", ds, qg, preferred_element_type=f32) * scale
    return (i + 1, dq), (dk, dv)

  xs = (_key_blocks(k, block), _key_blocks(v, block))
  (_, dq), (dk, dv) = jax.lax.scan(step, (jnp.zeros((), jnp.int32), jnp.zeros(qg.shape, f32)), xs)
  unblock = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)
  return (dq.astype(qg.dtype), unblock(dk).astype(k.dtype), unblock(dv).astype(v.dtype),
          None, None)


_flash.defvjp(_flash_fwd, _flash_bwd)


# ------------------------------------------------------------------ cudnn (slot layout)
def _chunk_split(x, chunk_size):
  """[B,T,...] -> [B*T/C, C, ...] after right-padding T to a multiple of C."""
  pad = -x.shape[1] % chunk_size
  x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
  return x.reshape(-1, chunk_size, *x.shape[2:])


def dot_product_attention_slots(q, k, v, q_pos, kv_pos, *, chunk_size=None, scale=None,
                                implementation: Literal["xla", "cudnn"] = "cudnn"):
  """jax.nn.dot_product_attention in slot coordinates (valid only when `slot_layout` holds).

  Causal by slot; right padding as sequence lengths; chunked-local attention by folding each chunk
  of C slots into the batch. Lengths are clamped to >= 1 so an all-padding (chunk) row stays
  finite. `implementation` 'cudnn' on GPU; 'xla' (any platform) lets tests check this wrapper.
  """
  del kv_pos   # slot layout: equal to q_pos
  B, T = q.shape[:2]
  lengths = jnp.sum(q_pos >= 0, axis=1).astype(jnp.int32)                # [B]
  if chunk_size is not None and chunk_size < T:
    nc = -(-T // chunk_size)
    starts = jnp.arange(nc, dtype=jnp.int32)[None] * chunk_size         # [1,C]
    lengths = jnp.clip(lengths[:, None] - starts, 1, chunk_size).reshape(-1)
    q, k, v = (_chunk_split(x, chunk_size) for x in (q, k, v))
  lengths = jnp.maximum(lengths, 1)
  out = jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True,
                                     query_seq_lengths=lengths, key_value_seq_lengths=lengths,
                                     implementation=implementation)
  return out.reshape(B, -1, *out.shape[2:])[:, :T]


# ------------------------------------------------------------------ splash (TPU, slot layout)
def splash_attention_slots(q, k, v, q_pos, kv_pos, *, chunk_size=None, scale=None,
                           interpret: bool = False):
  """Pallas splash attention (TPU) in slot coordinates (valid only when `slot_layout` holds).

  Causal (or chunked-causal) mask by slot, padding as segment ids (padding = segment 0, which
  only sees padding); GQA as one MQA kernel per kv head. T is padded to a multiple of 128.
  Single-program: under a device mesh it needs a shard_map over batch / heads (not done).
  """
  from jax.experimental.pallas.ops.tpu import splash_attention as sa  # local: TPU-only kernel module
  del kv_pos
  B, T, N, H = q.shape
  K = k.shape[2]
  scale = H ** -0.5 if scale is None else scale
  Tp = T + (-T % 128)
  seg = jnp.pad((q_pos >= 0).astype(jnp.int32), ((0, 0), (0, Tp - T)))
  pad = lambda x: jnp.pad(x, ((0, 0), (0, Tp - T), (0, 0), (0, 0)))
  q, k, v = pad(q * jnp.asarray(scale, q.dtype)), pad(k), pad(v)
  if chunk_size is None:
    mask = sa.CausalMask((Tp, Tp))
  else:
    idx = np.arange(Tp)
    mask = sa.NumpyMask((idx[None] <= idx[:, None]) & (idx[None] // chunk_size ==
                                                        idx[:, None] // chunk_size))
  G = N // K
  kernel = sa.make_splash_mqa_single_device(sa.MultiHeadMask([mask] * G), interpret=interpret)
  qg = jnp.einsum("BTKGH->BKGTH", q.reshape(B, Tp, K, G, H))
  kk, vv = jnp.einsum("BTKH->BKTH", k), jnp.einsum("BTKH->BKTH", v)
  segs = sa.SegmentIds(q=seg, kv=seg)
  per_row = lambda qr, kr, vr, s: jax.vmap(kernel, in_axes=(0, 0, 0, None))(qr, kr, vr, s)
  out = jax.vmap(per_row)(qg, kk, vv, segs)                               # [B,K,G,Tp,H]
  return jnp.einsum("BKGTH->BTKGH", out).reshape(B, Tp, N, H)[:, :T]
