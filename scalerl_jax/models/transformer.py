"""The decoder (`Transformer`), full forward, explicit KV cache and cached prefill / decode.

Masks are built from *positions*, never from slot indices: a token at position p may attend to
keys with 0 <= key_pos <= p (and, on chunked layers, key_pos // C == p // C). Padding has
position -1 and is never attended to. Hence left-padded prompts of different lengths decode
together with one shared cache write index: each row keeps its own positions (`next_pos`).
"""
from __future__ import annotations

from typing import Any, Literal, overload

import flax.linen as nn
import jax
import jax.numpy as jnp

from scalerl_jax.models import families
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.models.layers import (DecoderLayer, RMSNorm, constrain, dtype_of, head_matmul,
                                      param)

Params = Any
Cache = dict[str, Any]   # a pytree: k / v stacked [L,...] arrays or per-layer tuples (split_cache)

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _layer_cls(cfg: ModelConfig, scanned: bool):
  if cfg.remat == "none":
    return DecoderLayer
  return nn.remat(DecoderLayer, policy=_REMAT_POLICIES[cfg.remat], prevent_cse=not scanned)


def build_masks(cfg: ModelConfig, q_pos: jax.Array, kv_pos: jax.Array) -> dict[str, jax.Array]:
  """bool [B,T,S] masks {'full', 'chunked'} from query positions [B,T] and key positions [B,S]."""
  qp, kp = q_pos[:, :, None], kv_pos[:, None, :]
  full = (kp >= 0) & (qp >= 0) & (kp <= qp)
  masks = {"full": full}
  if cfg.attention_chunk_size is not None and families.get(cfg.family).nope_chunked:
    c = cfg.attention_chunk_size
    masks["chunked"] = full & (kp // c == qp // c)
  return masks


def _layer_mask(cfg: ModelConfig, masks, i: int):
  """Layer i's [B,T,S] decode mask (None on the cache-free training path)."""
  if masks is None:
    return None
  return masks["chunked"] if cfg.layer_is_chunked(i) else masks["full"]


class Block(nn.Module):
  """`period` consecutive layers of the repeating layer pattern (the unit nn.scan iterates)."""
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x, positions, masks, kv=None, index=None, routes=None):
    cfg, p = self.cfg, self.cfg.scan_period
    cls = _layer_cls(cfg, scanned=True)
    new_k, new_v = [], []
    r = 0
    for j in range(p):  # block b holds layers b*p + j; the layer pattern has period p
      i = j
      mask = _layer_mask(cfg, masks, i)
      layer_kv = None if kv is None else (kv[0][j], kv[1][j])
      layer_routes = None
      if routes is not None and cfg.layer_is_moe(i):   # routes [B,T,R_block,K]
        layer_routes, r = routes[:, :, r], r + 1
      x, nkv = cls(cfg, cfg.layer_uses_rope(i), cfg.layer_is_moe(i),
                   chunked=cfg.layer_is_chunked(i), name=f"layer_{j}")(
          x, positions, mask, layer_kv, index, layer_routes)
      if nkv is not None:
        new_k.append(nkv[0])
        new_v.append(nkv[1])
    out_kv = None if kv is None else (jnp.stack(new_k), jnp.stack(new_v))
    return x, out_kv


class Transformer(nn.Module):
  """Llama-3 / Llama-4 text decoder. Returns (logits [B,T,V], new (k, v) cache or None).

  Args of __call__: tokens int32 [B,T]; positions int32 [B,T] (-1 = padding); kv_pos int32 [B,S]
  positions of every key slot (S = T without cache); kv = (k, v) [L,B,S,K,H], or tuples of
  per-layer [B,K,S,H] / [B,K,H,S] k / v buffers (the sampler's split cache, unscanned models only), or None; index =
  cache slot where the T new tokens are written. Without a cache kv_pos must equal positions.
  hidden_only=True returns ((final hidden [B,T,D], LM head kernel [D,V]), kv), both in the head
  dtype, instead of the logits. routes = int [B,T,R,K] expert choices of the R MoE layers (in
  layer order) to replay (routing replay), or None.
  """
  cfg: ModelConfig

  @nn.compact
  def __call__(self, tokens, positions, kv_pos, kv=None, index=None, hidden_only=False,
               routes=None):
    cfg = self.cfg
    emb = param(self, "embed", (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
    x = constrain(jnp.take(emb, tokens, axis=0),
                  ("batch", "seq" if kv is not None else "act_seq", "act_embed"))
    # The cached-decode path takes [B,T,S] masks; the training path builds its masks per key
    # block from `positions` inside the attention kernel (models/attention.py).
    masks = None if kv is None else build_masks(cfg, positions, kv_pos)
    if routes is not None:
      check_routes_shape(cfg, routes.shape, tokens.shape)
    if cfg.scan_layers:
      x, new_kv = self._scanned(x, positions, masks, kv, index, routes)
    else:
      cls = _layer_cls(cfg, scanned=False)
      split = kv is not None and isinstance(kv[0], (list, tuple))
      ks, vs = [], []
      for i in range(cfg.num_layers):
        mask = _layer_mask(cfg, masks, i)
        layer_kv = None if kv is None else (kv[0][i], kv[1][i])
        layer_routes = None
        if routes is not None and cfg.layer_is_moe(i):
          layer_routes = routes[:, :, moe_layer_index(cfg, i)]
        x, nkv = cls(cfg, cfg.layer_uses_rope(i), cfg.layer_is_moe(i), split,
                     chunked=cfg.layer_is_chunked(i), name=f"layers_{i}")(
                         x, positions, mask, layer_kv, index, layer_routes)
        if nkv is not None:
          ks.append(nkv[0])
          vs.append(nkv[1])
      if kv is None:
        new_kv = None
      elif split:  # per-layer heads-major cache buffers (see `split_cache`)
        new_kv = (tuple(ks), tuple(vs))
      else:
        new_kv = (jnp.stack(ks), jnp.stack(vs))
    x = RMSNorm(cfg, name="final_norm")(x)
    if hidden_only:   # the learner's chunked LM head (learner/logprobs.py) applies w itself
      return self._head(emb, x), new_kv
    logits = head_matmul(*self._head(emb, x), cfg.head_precision)
    logits = constrain(logits, ("batch", "seq", "act_vocab"))
    return logits.astype(jnp.float32), new_kv

  def _head(self, emb, x):
    """(x [B,T,D], kernel [D,V]) in the head dtype (float32 with fp32_lm_head): the operands of
    `head_matmul` (the logits of `__call__`, and the learner's chunked head)."""
    cfg = self.cfg
    head_dtype = jnp.float32 if cfg.fp32_lm_head else dtype_of(cfg.dtype)
    if cfg.tie_embeddings:
      w = emb.astype(head_dtype).T
    else:
      w = param(self, "lm_head", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))
      w = w.astype(head_dtype)
    return x.astype(head_dtype), w

  def _scanned(self, x, positions, masks, kv, index, routes):
    cfg, p = self.cfg, self.cfg.scan_period
    n = cfg.num_layers // p
    if kv is not None:  # [L,...] -> [n, p, ...]: block b, in-block layer j = layer b*p + j
      kv = tuple(a.reshape(n, p, *a.shape[1:]) for a in kv)
    if routes is not None:  # [B,T,R,K] -> [n,B,T,R/n,K]: block b's MoE layers
      B, T, R, K = routes.shape
      routes = jnp.moveaxis(routes.reshape(B, T, n, R // n, K), 2, 0)
    scan = nn.scan(Block, variable_axes={"params": 0, "intermediates": 0},
                   split_rngs={"params": True},
                   # flax annotates in_axes as int; a tuple (one axis per argument) is documented
                   in_axes=(nn.broadcast, nn.broadcast, 0, nn.broadcast, 0),  # pyright: ignore[reportArgumentType]
                   length=n,
                   metadata_params={nn.PARTITION_NAME: "layers"})
    x, new_kv = scan(cfg, name="blocks")(x, positions, masks, kv, index, routes)
    if new_kv is not None:
      new_kv = tuple(a.reshape(cfg.num_layers, *a.shape[2:]) for a in new_kv)
    return x, new_kv


# ------------------------------------------------------------------ routing replay
def num_moe_layers(cfg: ModelConfig) -> int:
  """R: how many layers are MoE (the routes' layer axis)."""
  return sum(cfg.layer_is_moe(i) for i in range(cfg.num_layers))


def moe_layer_index(cfg: ModelConfig, i: int) -> int:
  """Position of MoE layer i on the routes' layer axis."""
  return sum(cfg.layer_is_moe(j) for j in range(i))


def check_routes_shape(cfg: ModelConfig, shape, tokens_shape) -> None:
  """routes must be [B,T,R,K] for tokens [B,T]; ValueError naming what differs."""
  want = (*tuple(tokens_shape), num_moe_layers(cfg), cfg.num_experts_per_tok)
  if not cfg.is_moe:
    raise ValueError("routes given to a dense (non-MoE) model")
  if tuple(shape) != want:
    raise ValueError(f"routes must have shape [B,T,R,K] = {want} (R = MoE layers, K = experts "
                     f"per token); got {tuple(shape)}")


def collect_routes(cfg: ModelConfig, intermediates, key: str = "routes") -> jax.Array:
  """The sown expert choices of an apply(..., mutable=['intermediates']) -> int32 [B,T,R,K]
  (`key` 'own_routes': the routers' own top-k, which differ from 'routes' under replay)."""
  if cfg.scan_layers:
    p = cfg.scan_period
    blocks = intermediates["blocks"]
    per = [blocks[f"layer_{j}"]["moe"][key][0] for j in range(p) if cfg.layer_is_moe(j)]
    r = jnp.stack(per, axis=1)                                   # [n, R_block, B, T, K]
    r = r.reshape(-1, *r.shape[2:])                              # [R, B, T, K] in layer order
  else:
    r = jnp.stack([intermediates[f"layers_{i}"]["moe"][key][0]
                   for i in range(cfg.num_layers) if cfg.layer_is_moe(i)])
  return jnp.moveaxis(r, 0, 2).astype(jnp.int32)


# ------------------------------------------------------------------ functional API
def _positions_from_mask(mask: jax.Array, start: jax.Array | int = 0) -> jax.Array:
  pos = start + jnp.cumsum(mask.astype(jnp.int32), axis=1) - 1
  return jnp.where(mask, pos, -1).astype(jnp.int32)


def init_params(cfg: ModelConfig, rng: jax.Array, *, boxed: bool = False) -> Params:
  """Random params (normal 0.02, norms 1). boxed=True keeps nn.Partitioned logical metadata."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  pos = jnp.zeros((1, 1), jnp.int32)
  variables = Transformer(cfg).init(rng, tokens, pos, pos)
  return variables["params"] if boxed else nn.unbox(variables["params"])


def _aux(inter, cfg: ModelConfig) -> dict:
  """{'moe_dropped': float32 total} from an apply's mutable 'intermediates'; for an MoE model
  also 'own_routes' int32 [B,T,R,K], each MoE layer's router's own top-k (router_disagree)."""
  dropped = [jnp.sum(v) for p, v in jax.tree_util.tree_flatten_with_path(inter)[0]
             if "moe_dropped" in jax.tree_util.keystr(p)]
  out = dict(moe_dropped=sum(dropped, jnp.zeros((), jnp.float32)).astype(jnp.float32))
  if cfg.is_moe:
    out["own_routes"] = collect_routes(cfg, inter["intermediates"], "own_routes")
  return out


def _forward_inputs(tokens, positions, mask):
  """(tokens [B,T], positions with -1 on padding) for `forward` / `forward_hidden`."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B,T], got shape {tokens.shape}")
  if mask is None:
    mask = jnp.ones(tokens.shape, bool)
  if positions is None:
    positions = _positions_from_mask(mask)
  else:
    positions = jnp.where(mask, positions, -1).astype(jnp.int32)
  return tokens, positions


@overload
def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
            mask: jax.Array | None = None, routes: jax.Array | None = None,
            return_aux: Literal[False] = False) -> jax.Array: ...
@overload
def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
            mask: jax.Array | None = None, routes: jax.Array | None = None, *,
            return_aux: Literal[True]) -> tuple[jax.Array, dict]: ...
def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None,
            mask: jax.Array | None = None, routes: jax.Array | None = None,
            return_aux: bool = False) -> jax.Array | tuple[jax.Array, dict]:
  """Full (training / scoring) forward: float32 logits [B,T,V].

  tokens int32 [B,T]; mask bool [B,T] (False = padding, default all True); positions default to
  cumsum(mask) - 1 (so left and right padding both work); routes int [B,T,R,K]: replay these
  expert choices (MoE only). Not jitted: wrap in jax.jit with cfg static (e.g.
  `jax.jit(forward, static_argnums=1)`). `return_aux`: returns (logits, aux) with
  aux['moe_dropped'] = float32 token-expert copies dropped by capacity-mode MoE layers (all layers)
  and, for an MoE model, aux['own_routes'] int32 [B,T,R,K] (each router's own top-k).
  """
  tokens, positions = _forward_inputs(tokens, positions, mask)
  if return_aux:
    (logits, _), inter = Transformer(cfg).apply({"params": params}, tokens, positions, positions,
                                                routes=routes, mutable=["intermediates"])
    return logits, _aux(inter, cfg)
  logits, _ = Transformer(cfg).apply({"params": params}, tokens, positions, positions,
                                     routes=routes)
  return logits


def forward_hidden(params: Params, cfg: ModelConfig, tokens: jax.Array,
                   positions: jax.Array | None = None, mask: jax.Array | None = None,
                   routes: jax.Array | None = None, return_aux: bool = False) -> tuple[Any, ...]:
  """`forward` without the LM head: (hidden [B,T,D], kernel [D,V]), both in the head dtype
  (float32 with fp32_lm_head); logits = hidden @ kernel. For the learner's sequence-chunked
  log-probs (learner/logprobs.py), so [B,T,V] logits never exist whole. routes, return_aux: as
  `forward` (with return_aux: (hidden, kernel, aux); aux['own_routes'] for an MoE model)."""
  tokens, positions = _forward_inputs(tokens, positions, mask)
  if return_aux:
    (out, _), inter = Transformer(cfg).apply({"params": params}, tokens, positions, positions,
                                             hidden_only=True, routes=routes,
                                             mutable=["intermediates"])
    return (*out, _aux(inter, cfg))
  out, _ = Transformer(cfg).apply({"params": params}, tokens, positions, positions,
                                  hidden_only=True, routes=routes)
  return out


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype: str | None = None) -> Cache:
  """Empty KV cache pytree (a plain dict, jit-friendly).

  k, v: [L,B,S,K,H] (compute dtype unless `dtype`); pos: int32 [B,S] position of each slot
  (-1 = empty / padding); index: int32 [] next write slot (shared by all rows);
  next_pos: int32 [B] position the next token of each row gets.
  """
  if batch <= 0 or max_len <= 0:
    raise ValueError(f"batch and max_len must be positive, got {batch}, {max_len}")
  shape = (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
  dt = dtype_of(dtype or cfg.dtype)
  return dict(k=jnp.zeros(shape, dt), v=jnp.zeros(shape, dt),
              pos=jnp.full((batch, max_len), -1, jnp.int32), index=jnp.zeros((), jnp.int32),
              next_pos=jnp.zeros((batch,), jnp.int32))


CACHE_LOGICAL_AXES = dict(
    k=("layers", "cache_batch", "cache_seq", "act_kv_heads", "head_dim"),
    v=("layers", "cache_batch", "cache_seq", "act_kv_heads", "head_dim"),
    pos=("cache_batch", "cache_seq"), index=(), next_pos=("cache_batch",))


@overload
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: Cache,
            mask: jax.Array | None = None, return_routes: Literal[False] = False
            ) -> tuple[jax.Array, Cache]: ...
@overload
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: Cache,
            mask: jax.Array | None = None, *, return_routes: Literal[True]
            ) -> tuple[jax.Array, Cache, jax.Array]: ...
def prefill(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: Cache,
            mask: jax.Array | None = None, return_routes: bool = False
            ) -> tuple[jax.Array, Cache] | tuple[jax.Array, Cache, jax.Array]:
  """Runs T tokens [B,T] through the model, appending them to the cache at slot `index`.

  mask bool [B,T] marks real tokens (False = padding; use left padding for prompts so the last
  column is every row's last prompt token). Returns float32 logits [B,T,V] and the new cache.
  The caller must keep index + T <= max_len (slots beyond the end are clamped by XLA).
  With `return_routes` (MoE) also returns each token's chosen experts, int32 [B,T,R,K].
  """
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B,T], got shape {tokens.shape}")
  if tokens.shape[0] != cache["pos"].shape[0]:
    raise ValueError(f"batch {tokens.shape[0]} != cache batch {cache['pos'].shape[0]}")
  if tokens.shape[1] > cache["pos"].shape[1]:
    raise ValueError(f"{tokens.shape[1]} tokens do not fit a cache of {cache['pos'].shape[1]}")
  if mask is None:
    mask = jnp.ones(tokens.shape, bool)
  positions = _positions_from_mask(mask, cache["next_pos"][:, None])
  index = cache["index"]
  kv_pos = jax.lax.dynamic_update_slice(cache["pos"], positions, (0, index))
  model = Transformer(cfg)
  args = ({"params": params}, tokens, positions, kv_pos, (cache["k"], cache["v"]), index)
  if return_routes:
    (logits, (k, v)), inter = model.apply(*args, mutable=["intermediates"])
  else:
    logits, (k, v) = model.apply(*args)
  new_cache = dict(k=k, v=v, pos=kv_pos, index=index + tokens.shape[1],
                   next_pos=cache["next_pos"] + jnp.sum(mask, axis=1).astype(jnp.int32))
  if return_routes:
    return logits, new_cache, collect_routes(cfg, inter["intermediates"])
  return logits, new_cache


@overload
def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: Cache,
                return_routes: Literal[False] = False) -> tuple[jax.Array, Cache]: ...
@overload
def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: Cache, *,
                return_routes: Literal[True]) -> tuple[jax.Array, Cache, jax.Array]: ...
def decode_step(params: Params, cfg: ModelConfig, tokens: jax.Array, cache: Cache,
                return_routes: bool = False
                ) -> tuple[jax.Array, Cache] | tuple[jax.Array, Cache, jax.Array]:
  """One decoding step for every row: tokens int32 [B] -> (float32 logits [B,V], new cache)
  (+ the fed tokens' chosen experts int32 [B,R,K] with `return_routes`)."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 1:
    raise ValueError(f"decode_step takes tokens [B], got shape {tokens.shape}")
  if return_routes:
    logits, cache, routes = prefill(params, cfg, tokens[:, None], cache, return_routes=True)
    return logits[:, 0], cache, routes[:, 0]
  logits, cache = prefill(params, cfg, tokens[:, None], cache)
  return logits[:, 0], cache
