"""Mixture-of-experts routing and dispatch (Llama-4 `Llama4TextMoe` semantics).

Routing: router logits -> top-k experts per token (or the `routes` given: routing replay) ->
sigmoid of the chosen logits scales each chosen expert's *input*; the routed outputs are summed.

Three ways to run the routed experts, all with the same math:

* `dense_experts`: every expert on every token with gate 0 for unchosen experts (as HF; the
  reference). E/k times the active FLOPs.
* `dispatch_experts` with `capacity_factor=0` (dropless): inside `shard_map`, tokens are
  all-gathered over the expert mesh axes, each expert shard sorts the token copies routed to its
  local experts into contiguous groups and runs `jax.lax.ragged_dot` (a grouped GEMM on GPU/TPU;
  XLA:CPU expands it into one masked dense dot per local expert), and the partial outputs are
  reduce-scattered back. No token is ever dropped.
* `dispatch_experts` with `capacity_factor=c > 0`: GShard-style buffers of C = ceil(c * N / E)
  rows per expert (N = token copies on the shard), `all_to_all` over the expert mesh axes, a
  batched einsum over local experts (c times the active FLOPs, exactly), `all_to_all` back.
  Copies beyond an expert's capacity are dropped (their routed output is 0) and counted per token.

The mesh axes come from the logical-axis rules (`expert`, `expert_mlp`, `batch`, `seq`), never
named here. Tensor parallelism splits the expert FFN width; its partial sums are psum'ed.

Shape letters: B batch, T tokens, D d_model, F expert ffn width, E experts, L local experts
(E / expert shards), S expert shards, C capacity rows per expert, N token copies (tokens * k),
K experts per token.
"""
from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P


def route(x: jax.Array, wr: jax.Array, k: int, routes: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Router: (top_idx int32 [B,T,K], gates [B,T,K] in x.dtype, own int32 [B,T,K]).

  routes [B,T,K] (routing replay) replaces the top-k choice; the gates are still the sigmoid of
  the router's own logits at those experts, so gradients reach the router as usual. `own` is the
  router's own top-k (= top_idx without replay): the learner's router_disagree metric.
  """
  logits = jnp.einsum("BTD,DE->BTE", x, wr)
  top_vals, own = jax.lax.top_k(logits, k)
  if routes is None:
    top_idx = own
  else:
    top_idx = routes.astype(jnp.int32)
    top_vals = jnp.take_along_axis(logits, top_idx, axis=-1)
  gates = jax.nn.sigmoid(top_vals.astype(jnp.float32)).astype(x.dtype)
  return top_idx.astype(jnp.int32), gates, own.astype(jnp.int32)


def dense_experts(x, top_idx, gates, wg, wu, wd, constrain=lambda a, _: a) -> jax.Array:
  """Reference: all experts on all tokens; x [B,T,D], kernels [E,D,F] / [E,F,D] -> [B,T,D]."""
  E = wg.shape[0]
  scores = jnp.einsum("BTK,BTKE->BTE", gates, jax.nn.one_hot(top_idx, E, dtype=x.dtype))
  xe = constrain(jnp.einsum("BTD,BTE->EBTD", x, scores),
                 ("act_expert", "batch", "seq", "act_embed"))
  g = jnp.einsum("EBTD,EDF->EBTF", xe, wg)
  u = jnp.einsum("EBTD,EDF->EBTF", xe, wu)
  h = constrain(jax.nn.silu(g) * u, ("act_expert", "batch", "seq", "act_mlp"))
  return jnp.einsum("EBTF,EFD->BTD", h, wd)


# ------------------------------------------------------------------ mesh layout from the rules
def current_mesh() -> jax.sharding.AbstractMesh | None:
  """The mesh of the enclosing `jax.set_mesh` / `sharding.use_mesh` block, or None outside one
  (public JAX API only; the legacy `with mesh:` block, deprecated since JAX 0.8.2, is not seen)."""
  m = jax.sharding.get_abstract_mesh()
  return None if m.empty else m


def _axes(name: str, rules, mesh) -> tuple[str, ...]:
  """Mesh axes (size > 1) the logical axis `name` maps to under `rules`."""
  # nn.spmd's: flax.linen re-exports it without `as` (not public to a type checker)
  axes = nn.spmd.logical_to_mesh_axes((name,), rules)
  assert axes is not None                # None only for array_dim_names=None
  spec = axes[0]
  if spec is None:
    return ()
  spec = spec if isinstance(spec, (tuple, list)) else (spec,)
  return tuple(a for a in spec if a is not None and mesh.shape[a] > 1)


def expert_shards(num_experts: int, mesh_shape: dict, rules) -> int:
  """How many ways `rules` split the experts on a mesh of `mesh_shape`; ValueError unless it
  divides `num_experts` (called at config time and at trace time)."""
  spec = dict(rules).get("expert")
  axes = () if spec is None else (spec if isinstance(spec, (tuple, list)) else (spec,))
  n = math.prod(int(mesh_shape.get(a, 1)) for a in axes if a is not None)
  if num_experts % n:
    raise ValueError(f"the expert mesh axes {axes} split the experts {n} ways, which does not "
                     f"divide num_experts={num_experts}")
  return n


# ------------------------------------------------------------------ local expert computations
def _ragged_local(xr, er, gr, wg, wu, wd, first):
  """Dropless FFN of the copies routed to local experts [first, first+L).

  xr [N,D] token rows, er [N] expert ids, gr [N] gates; kernels [L,D,F] / [L,F,D].
  Returns [N,D] (zero for copies of non-local experts).
  """
  L = wg.shape[0]
  local = er - first
  key = jnp.where((local >= 0) & (local < L), local, L)          # non-local copies sort last
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=L + 1)[:L].astype(jnp.int32)
  xs = xr[order] * gr[order][:, None]
  h = jax.nn.silu(jax.lax.ragged_dot(xs, wg, sizes)) * jax.lax.ragged_dot(xs, wu, sizes)
  ys = jax.lax.ragged_dot(h, wd, sizes)                          # rows past sum(sizes) are 0
  return jnp.zeros_like(ys).at[order].set(ys)


def _slots(er, num_experts: int, capacity: int):
  """Rank of each copy within its expert (stable, in token order) and whether it fits."""
  n = er.shape[0]
  order = jnp.argsort(er, stable=True)
  counts = jnp.bincount(er, length=num_experts)
  starts = jnp.cumsum(counts) - counts
  rank = jnp.zeros((n,), jnp.int32).at[order].set(
      jnp.arange(n, dtype=jnp.int32) - starts[er[order]].astype(jnp.int32))
  return rank, rank < capacity


def _capacity_ffn(buf, wg, wu, wd):
  """buf [...,L,C,D] through local experts [L,D,F] / [L,F,D]."""
  g = jnp.einsum("...LCD,LDF->...LCF", buf, wg)
  u = jnp.einsum("...LCD,LDF->...LCF", buf, wu)
  return jnp.einsum("...LCF,LFD->...LCD", jax.nn.silu(g) * u, wd)


def capacity(num_copies: int, num_experts: int, capacity_factor: float) -> int:
  """Rows per expert buffer: ceil(factor * copies / experts), at most all copies."""
  return max(1, min(num_copies, math.ceil(capacity_factor * num_copies / num_experts)))


def _local_moe(x, top_idx, gates, wg, wu, wd, *, num_experts, capacity_factor, expert_axes,
               tokens_over_experts, tensor_axes):
  """Per-device body (inside shard_map, or alone without a mesh). x [b,t,D] -> (y [b,t,D],
  dropped copies per token [b,t])."""
  b, t, D = x.shape
  K = top_idx.shape[-1]
  L = wg.shape[0]
  S = num_experts // L
  shard = jax.lax.axis_index(expert_axes) if expert_axes else 0
  first = shard * L
  xr = x.reshape(b * t, D)
  er = top_idx.reshape(-1)                                       # [N], copy n = token n // K
  gr = gates.reshape(-1)
  tok = jnp.arange(b * t * K, dtype=jnp.int32) // K
  if capacity_factor <= 0:                                       # dropless, ragged
    dropped = jnp.zeros((b, t), jnp.int32)
    if expert_axes and tokens_over_experts:                      # every shard sees all tokens
      xa = jax.lax.all_gather(xr, expert_axes, axis=0, tiled=True)          # [S*M,D]
      ea = jax.lax.all_gather(er, expert_axes, axis=0, tiled=True)
      ga = jax.lax.all_gather(gr, expert_axes, axis=0, tiled=True)
      toka = jnp.arange(S * b * t * K, dtype=jnp.int32) // K
      ys = _ragged_local(xa[toka], ea, ga, wg, wu, wd, first)
      y = jnp.zeros((S * b * t, D), ys.dtype).at[toka].add(ys)
      y = jax.lax.psum_scatter(y, expert_axes, scatter_dimension=0, tiled=True)
    else:
      ys = _ragged_local(xr[tok], er, gr, wg, wu, wd, first)
      y = jnp.zeros((b * t, D), ys.dtype).at[tok].add(ys)
      if expert_axes:                                            # tokens replicated: sum shards
        y = jax.lax.psum(y, expert_axes)
  else:
    C = capacity(b * t * K, num_experts, capacity_factor)
    rank, keep = _slots(er, num_experts, C)
    dropped = jnp.sum((~keep).reshape(b, t, K), axis=-1).astype(jnp.int32)
    xg = xr[tok] * gr[:, None]
    buf = jnp.zeros((num_experts, C, D), x.dtype).at[er, rank].set(xg, mode="drop")
    if expert_axes and tokens_over_experts:
      buf = jax.lax.all_to_all(buf.reshape(S, L, C, D), expert_axes, 0, 0)  # [S(src),L,C,D]
      out = _capacity_ffn(buf, wg, wu, wd)
      out = jax.lax.all_to_all(out, expert_axes, 0, 0).reshape(num_experts, C, D)
    else:
      mine = jax.lax.dynamic_slice_in_dim(buf, first, L, axis=0)
      out = jax.lax.dynamic_update_slice_in_dim(
          jnp.zeros_like(buf), _capacity_ffn(mine, wg, wu, wd), first, axis=0)
    ys = out[er, jnp.minimum(rank, C - 1)] * keep[:, None].astype(out.dtype)
    y = jnp.zeros((b * t, D), ys.dtype).at[tok].add(ys)
    if expert_axes and not tokens_over_experts:
      y = jax.lax.psum(y, expert_axes)
  if tensor_axes:                                                # partial sums over F shards
    y = jax.lax.psum(y, tensor_axes)
  return y.reshape(b, t, D), dropped


def dispatch_experts(x, top_idx, gates, wg, wu, wd, capacity_factor: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """Expert-parallel routed experts: x [B,T,D], top_idx / gates [B,T,K], kernels [E,D,F] /
  [E,F,D] -> (y [B,T,D], dropped copies per token int32 [B,T]).

  Under a mesh with logical-axis rules it runs in `shard_map`: experts over the `expert` rule's
  mesh axes, the FFN width over `expert_mlp`'s, tokens as `batch` / `seq` say. Without a mesh it
  runs the same body on one device.
  """
  E = wg.shape[0]
  mesh, rules = current_mesh(), nn.get_logical_axis_rules()
  kw = dict(num_experts=E, capacity_factor=capacity_factor)
  if mesh is None or not rules:
    return _local_moe(x, top_idx, gates, wg, wu, wd, expert_axes=(), tokens_over_experts=False,
                      tensor_axes=(), **kw)
  ea, ta = _axes("expert", rules, mesh), _axes("expert_mlp", rules, mesh)
  ba, sa = _axes("batch", rules, mesh), _axes("seq", rules, mesh)
  expert_shards(E, dict(mesh.shape), tuple((n, tuple(a) if isinstance(a, list) else a)
                                           for n, a in rules))
  tok_axes = set(ba) | set(sa)
  if set(ta) & (tok_axes | set(ea)):
    raise ValueError(f"the expert FFN width axes {ta} must not also shard tokens or experts")
  if set(ea) & tok_axes and not set(ea) <= tok_axes:
    raise ValueError(f"tokens are sharded over some but not all expert axes {ea}")
  spec = lambda a: None if not a else (a if len(a) > 1 else a[0])
  tok3, tok2 = P(spec(ba), spec(sa), None), P(spec(ba), spec(sa))
  w_in, w_out = P(spec(ea), None, spec(ta)), P(spec(ea), spec(ta), None)
  body = lambda *a: _local_moe(*a, expert_axes=ea, tokens_over_experts=bool(set(ea) & tok_axes),
                               tensor_axes=ta, **kw)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(tok3, tok3, tok3, w_in, w_in, w_out),
                     out_specs=(tok3, tok2), check_vma=False)
  return fn(x, top_idx, gates, wg, wu, wd)


def routed_experts(cfg: Any, x, top_idx, gates, wg, wu, wd, constrain=lambda a, _: a) -> tuple[jax.Array, jax.Array | None]:
  """cfg.moe_impl dispatch: (y [B,T,D], dropped copies per token [B,T] or None)."""
  if cfg.moe_impl == "dense":
    return dense_experts(x, top_idx, gates, wg, wu, wd, constrain), None
  return dispatch_experts(x, top_idx, gates, wg, wu, wd, cfg.moe_capacity_factor)
