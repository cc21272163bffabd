"""Decoder building blocks (flax.linen): RMSNorm, RoPE, GQA attention, SwiGLU MLP, Llama-4 MoE.

Shape letters in einsum strings: B batch, T query positions, S key positions (cache slots),
D d_model, N query heads, K kv heads, G query heads per kv head, H head_dim, F ffn width,
E experts, V vocab.

Every parameter carries logical axis names (nn.with_logical_partitioning) and the main
activations carry logical constraints; the rules table (scalerl_jax/config/) maps them to mesh axes.
"""
from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from scalerl_jax.models import families
from scalerl_jax.models import attention as attention_lib
from scalerl_jax.models import moe
from scalerl_jax.models.config import ModelConfig, rope_inv_freq

INIT_STD = 0.02  # HF initializer_range
_MASKED = float(np.finfo(np.float32).min)


def dtype_of(name: str) -> Any:
  """'float32' | 'bfloat16' | ... -> jnp dtype."""
  return jnp.dtype(name)


def param(mod: nn.Module, name: str, shape: tuple[int, ...], axes: tuple[str | None, ...],
          init=None) -> jax.Array:
  """Creates a parameter with logical axis names, cast to the compute dtype."""
  if len(shape) != len(axes):
    raise ValueError(f"{name}: shape {shape} and logical axes {axes} differ in rank")
  init = init or nn.initializers.normal(INIT_STD)
  p = mod.param(name, nn.with_logical_partitioning(init, axes), shape,
                dtype_of(mod.cfg.param_dtype))
  # Module.param unboxes the LogicallyPartitioned (unbox=True): p is the array
  return p.astype(dtype_of(mod.cfg.dtype))  # pyright: ignore[reportAttributeAccessIssue]


def constrain(x: jax.Array, axes: tuple[str | None, ...]) -> jax.Array:
  """Logical sharding constraint on an activation.

  No-op without logical-axis rules or without a mesh (`sharding.use_mesh` sets both).
  """
  # nn.spmd's: flax.linen re-exports it without `as` (not public to a type checker)
  return nn.spmd.with_logical_constraint(x, axes)


def _sharded() -> bool:
  """True inside a mesh of more than one device (`sharding.use_mesh` / `jax.set_mesh`)."""
  m = moe.current_mesh()
  return m is not None and m.size > 1


def linear(x: jax.Array, w: jax.Array, **dot_kw) -> jax.Array:
  """x [..., D] @ w [D, F] -> [..., F]: ONE 2-D matmul on x.reshape(-1, D) on a single device
  (`dot_kw`: jnp.dot's precision / preferred_element_type).

  The 3-D einsum form ("BTD,DF->BTF") made XLA:CPU write a transposed copy of the activation
  gradient for every weight gradient and run that dot off its fast path (issue #26: the MLP block's
  forward + backward 764 ms as einsums, 456 ms as 2-D matmuls, HF 461 ms). The reshapes are
  bitcasts (row-major, leading dims merged). Under a multi-device mesh the einsum form stays: the
  merged [B*T] axis carries both the batch and the sequence sharding, which the SPMD partitioner
  could not map onto the weight gradient's layout ("involuntary full rematerialization" of
  [B*T/8, D] activations, 7 times in the 8B h100_16 plan) where the einsum compiles cleanly.
  """
  if _sharded():
    return jnp.einsum("...D,DF->...F", x, w, **dot_kw)
  lead = x.shape[:-1]
  return jnp.dot(x.reshape(-1, x.shape[-1]), w, **dot_kw).reshape(*lead, w.shape[-1])


_HEAD_PRECISION = {"fp32": jax.lax.Precision.HIGHEST, "tf32": jax.lax.Precision.HIGH,
                   "bf16": jax.lax.Precision.DEFAULT}


def head_matmul(x: jax.Array, w: jax.Array, precision: str = "fp32") -> jax.Array:
  """LM-head logits x [..., D] @ w [D, V] -> float32 [..., V] through `linear`.

  `precision` (ModelConfig.head_precision, docs/LEARNER.md "Head precision"): 'fp32' multiplies
  the operands as given at full precision (Precision.HIGHEST: no TF32 / bf16 passes on GPU and
  TPU); 'tf32' lets the GPU use TensorFloat-32 (TPU: 3-pass bf16); 'bf16' rounds both operands to
  bfloat16 and accumulates in float32. CPU computes all three in float32, except that 'bf16'
  still rounds the operands.
  """
  if precision not in _HEAD_PRECISION:
    raise ValueError(f"head_precision must be one of {tuple(_HEAD_PRECISION)}, got {precision!r}")
  if precision == "bf16":
    x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  return linear(x, w, precision=_HEAD_PRECISION[precision], preferred_element_type=jnp.float32)


@jax.custom_vjp
def swiglu(g: jax.Array, u: jax.Array) -> jax.Array:
  """silu(g) * u with a backward that keeps only the pre-activations g and u.

  Autodiff of `jax.nn.silu(g) * u` keeps sigmoid(g), silu(g) and u (three [B*T, F] tensors per
  layer); this VJP recomputes sigmoid(g) from g instead: d/dg = dh * u * s * (1 + g * (1 - s)),
  d/du = dh * g * s, s = sigmoid(g). Checked against autodiff in tests/models/test_hf_parity.py.
  """
  return jax.nn.silu(g) * u


def _swiglu_fwd(g, u):
  return jax.nn.silu(g) * u, (g, u)


def _swiglu_bwd(res, dh):
  g, u = res
  gf = g.astype(jnp.float32)
  s = jax.nn.sigmoid(gf)
  dhf = dh.astype(jnp.float32)
  dg = dhf * u.astype(jnp.float32) * s * (1.0 + gf * (1.0 - s))
  du = dhf * gf * s
  return dg.astype(g.dtype), du.astype(u.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class RMSNorm(nn.Module):
  """RMSNorm as HF: normalize in float32, cast back, multiply by weight."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    w = param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones)
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.cfg.norm_eps)
    return xf.astype(x.dtype) * w


def l2_norm(x: jax.Array, eps: float) -> jax.Array:
  """Llama-4 QK norm: weightless RMS normalization over head_dim, in float32."""
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def apply_rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Rotary embedding of x [B,T,N,H] at positions [B,T] (float32 math, HF conventions).

  llama3: rotate-half layout (HF LlamaForCausalLM); llama4: interleaved pairs (HF Llama4 complex).
  """
  inv = jnp.asarray(rope_inv_freq(cfg))                              # [H/2]
  freqs = positions.astype(jnp.float32)[..., None] * inv             # [B,T,H/2]
  cos, sin = jnp.cos(freqs)[:, :, None, :], jnp.sin(freqs)[:, :, None, :]
  xf = x.astype(jnp.float32)
  if families.get(cfg.family).rope_layout == "pairs":
    pairs = xf.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    x0, x1 = pairs[..., 0], pairs[..., 1]
    out = jnp.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], axis=-1).reshape(x.shape)
  else:
    half = x.shape[-1] // 2
    x0, x1 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nn.Module):
  """GQA self-attention: a training path (no cache) and a cached-decode path.

  Training / scoring (`kv is None`): `attention.attention` with masks from positions (causal, and
  chunked-local when `chunked`), backend `cfg.attention_impl` (blockwise flash attention on CPU,
  cuDNN on GPU, splash on TPU; see models/attention.py); `mask` is unused.

  Cached decode (`kv` given): mask [B,T,S] says which key slots each query may see (built from
  positions by the caller); the new keys are written at slot `index` of the cache (k,v [B,S,K,H];
  or when `heads_major`, k [B,K,S,H] and v [B,K,H,S]). The heads-major layout (the sampler's
  per-layer cache) lets decode attention run as two batched matmuls over (B,K) that read the cache
  in place: both contract the stored last axis (H for keys, S for the transposed values).
  """
  cfg: ModelConfig
  use_rope: bool = True
  heads_major: bool = False
  chunked: bool = False   # Llama-4 chunked-local layer (training path; decode gets it in `mask`)

  @nn.compact
  def __call__(self, x, positions, mask, kv=None, index=None):
    cfg = self.cfg
    D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    wq = param(self, "q", (D, N, H), ("embed", "heads", "head_dim"))
    wk = param(self, "k", (D, K, H), ("embed", "kv_heads", "head_dim"))
    wv = param(self, "v", (D, K, H), ("embed", "kv_heads", "head_dim"))
    wo = param(self, "o", (N, H, D), ("heads", "head_dim", "embed"))
    q, k, v = self._qkv(x, positions, wq, wk, wv)
    if kv is None:
      out, new_kv = self._train(q, k, v, positions), None
    elif self.heads_major:
      out, new_kv = self._decode_heads_major(q, k, v, mask, kv, index)
    else:
      out, new_kv = self._decode(q, k, v, mask, kv, index)
    out = constrain(out, ("batch", "seq", "act_heads", "head_dim"))
    B, T = out.shape[:2]
    return linear(out.reshape(B, T, N * H), wo.reshape(N * H, D)), new_kv

  def _qkv(self, x, positions, wq, wk, wv):
    """q, k, v projections [B,T,N|K,H], then RoPE + QK-norm or NoPE temperature."""
    cfg = self.cfg
    B, T, D = x.shape
    H = cfg.head_dim
    # Three 2-D matmuls on [B*T, D] (see `linear`): no concatenated weight, no sliced output.
    q, k, v = (linear(x, w.reshape(D, -1)).reshape(B, T, -1, H) for w in (wq, wk, wv))
    q = constrain(q, ("batch", "seq", "act_heads", "head_dim"))
    k = constrain(k, ("batch", "seq", "act_kv_heads", "head_dim"))
    v = constrain(v, ("batch", "seq", "act_kv_heads", "head_dim"))
    if self.use_rope:
      q, k = apply_rope(q, positions, cfg), apply_rope(k, positions, cfg)
      if cfg.use_qk_norm:
        q, k = l2_norm(q, cfg.norm_eps), l2_norm(k, cfg.norm_eps)
    elif cfg.attn_temperature_tuning:
      pos = positions.astype(jnp.float32)
      scale = jnp.log1p(jnp.floor((pos + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0
      q = (q.astype(jnp.float32) * scale[:, :, None, None]).astype(q.dtype)
    return q, k, v

  def _train(self, q, k, v, positions):
    """Cache-free attention over the T tokens themselves (keys = queries = `positions`)."""
    cfg = self.cfg
    chunk = cfg.attention_chunk_size if self.chunked else None
    return attention_lib.attention(q, k, v, positions, positions, impl=cfg.attention_impl,
                                   chunk_size=chunk, block=cfg.attention_block,
                                   q_block=cfg.attention_q_block)

  def _decode_heads_major(self, q, k, v, mask, kv, index):
    """Cache k [B,K,S,H], v [B,K,H,S] (the sampler's per-layer buffers), updated at `index`."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    k_cache, v_cache = kv                                              # [B,K,S,H], [B,K,H,S]
    k = jax.lax.dynamic_update_slice(
        k_cache, jnp.swapaxes(k, 1, 2).astype(k_cache.dtype), (0, 0, index, 0))
    v = jax.lax.dynamic_update_slice(
        v_cache, jnp.transpose(v, (0, 2, 3, 1)).astype(v_cache.dtype), (0, 0, 0, index))
    new_kv = (k, v)
    # (XLA:CPU has no bf16 x bf16 -> f32 dot: a bf16 cache is upcast, as in the stacked path.)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    # Both dots contract the cache's last axis in its stored layout (no per-step cache copy):
    # scores [B,K,S,G*T] = K . q, out [B,K,H,G*T] = V^T . probs.
    qc = jnp.transpose(qg, (0, 2, 4, 3, 1)).reshape(B, K, H, -1)       # [B,K,H,G*T]
    scores = jnp.einsum("BKSH,BKHM->BKSM", k, qc).astype(jnp.float32) * (H ** -0.5)
    m = jnp.transpose(mask, (0, 2, 1))[:, None, :, None, :]           # [B,1,S,1,T]
    scores = jnp.where(m, scores.reshape(B, K, -1, N // K, T), _MASKED)
    probs = jax.nn.softmax(scores, axis=2).astype(v.dtype).reshape(B, K, -1, N // K * T)
    out = jnp.einsum("BKHS,BKSM->BKHM", v, probs).reshape(B, K, H, N // K, T)
    return jnp.transpose(out, (0, 4, 1, 3, 2)).reshape(B, T, N, H), new_kv

  def _decode(self, q, k, v, mask, kv, index):
    """Stacked cache k, v [B,S,K,H] updated at `index`; T == 1 is the one-token decode step."""
    B, T, N, H = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, N // K, H)
    k_cache, v_cache = kv
    k = jax.lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), (0, index, 0, 0))
    v = jax.lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), (0, index, 0, 0))
    new_kv = (k, v)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    if T == 1:
      # Decode (one query per row): broadcast-multiply + reduce reads the cache once in its
      # [B,S,K,H] layout; XLA:CPU lowers the batched einsum below with a transpose of the cache.
      q1 = qg[:, 0]                                                          # [B,K,G,H]
      scores = jnp.sum(q1[:, None] * k[:, :, :, None], axis=-1).astype(jnp.float32) * (H ** -0.5)
      scores = jnp.where(mask[:, 0, :, None, None], scores, _MASKED)         # [B,S,K,G]
      probs = jax.nn.softmax(scores, axis=1).astype(v.dtype)
      out = jnp.sum(probs[..., None] * v[:, :, :, None], axis=1)             # [B,K,G,H]
      return out.reshape(B, T, N, H), new_kv
    scores = jnp.einsum("BTKGH,BSKH->BKGTS", qg, k).astype(jnp.float32) * (H ** -0.5)
    scores = jnp.where(mask[:, None, None, :, :], scores, _MASKED)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, T, N, H), new_kv


class MLP(nn.Module):
  """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""
  cfg: ModelConfig
  ffn_dim: int

  @nn.compact
  def __call__(self, x):
    D, F = self.cfg.d_model, self.ffn_dim
    wg = param(self, "gate", (D, F), ("embed", "mlp"))
    wu = param(self, "up", (D, F), ("embed", "mlp"))
    wd = param(self, "down", (F, D), ("mlp", "embed"))
    h = swiglu(linear(x, wg), linear(x, wu))
    h = constrain(h, ("batch", "seq", "act_mlp"))
    return linear(h, wd)


class MoE(nn.Module):
  """Llama-4 MoE (HF Llama4TextMoe): sigmoid(top-k router logits) scales each chosen expert's
  *input*; routed outputs are summed and the shared expert is added (scalerl_jax/models/moe.py).

  moe_impl='dense': all experts on all tokens (exact as HF; the reference). 'dispatch' (default):
  expert-parallel dispatch at active FLOPs (moe.dispatch_experts). `routes` int [B,T,K] replays
  given expert choices (routing replay); the chosen experts are sown as
  intermediates['routes'] ([B,T,K]), the router's own top-k as intermediates['own_routes'] (=
  'routes' without replay) and dropped copies (capacity mode) as
  intermediates['moe_dropped'] when the 'intermediates' collection is mutable.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, routes=None):
    cfg = self.cfg
    D, E, F = cfg.d_model, cfg.num_experts, cfg.expert_ffn_dim
    wr = param(self, "router", (D, E), ("embed", None))
    top_idx, gates, own = moe.route(x, wr, cfg.num_experts_per_tok, routes)
    self.sow("intermediates", "routes", top_idx)
    self.sow("intermediates", "own_routes", own)   # the router's own top-k (router_disagree)
    wg = param(self, "gate", (E, D, F), ("expert", "expert_embed", "expert_mlp"))
    wu = param(self, "up", (E, D, F), ("expert", "expert_embed", "expert_mlp"))
    wd = param(self, "down", (E, F, D), ("expert", "expert_mlp", "expert_embed"))
    shared = MLP(cfg, F, name="shared")(x)
    routed, dropped = moe.routed_experts(cfg, x, top_idx, gates, wg, wu, wd, constrain)
    if dropped is not None:
      self.sow("intermediates", "moe_dropped", jnp.sum(dropped))
    return shared + routed


class DecoderLayer(nn.Module):
  """Pre-norm block: x + attn(norm(x)); then + ffn(norm(.)). FFN is MoE or dense per layer."""
  cfg: ModelConfig
  use_rope: bool = True
  is_moe: bool = False
  heads_major: bool = False  # KV-cache layout k [B,K,S,H], v [B,K,H,S] (see Attention)
  chunked: bool = False      # chunked-local attention (training path; decode gets it in `mask`)

  @nn.compact
  def __call__(self, x, positions, mask, kv=None, index=None, routes=None):
    """routes: int [B,T,K] expert choices to replay on an MoE layer (None: the router's top-k)."""
    cfg = self.cfg
    h, new_kv = Attention(cfg, self.use_rope, self.heads_major, self.chunked, name="attn")(
        RMSNorm(cfg, name="attn_norm")(x), positions, mask, kv, index)
    # Training path: the residual's sequence dim is `act_seq` (sequence-sharded between layers in
    # tensor-parallel layouts); cached decode keeps `seq`.
    res = ("batch", "seq" if kv is not None else "act_seq", "act_embed")
    x = constrain(x + h, res)
    y = RMSNorm(cfg, name="ffn_norm")(x)
    y = MoE(cfg, name="moe")(y, routes) if self.is_moe else MLP(cfg, cfg.ffn_dim, name="mlp")(y)
    return constrain(x + y, res), new_kv
