"""Training-path attention backends vs the einsum reference, and the chunked LM-head log-probs.

Every backend that runs on CPU must equal `einsum_attention` (f32 scores materialised) to <= 1e-5
in fp32, in the output and in the gradient w.r.t. q, k and v, at T = 300 with key blocks of 64
(so blocks are partial and a chunk boundary falls inside a block). Gradients use a random
cotangent on real (non-padding) queries only: the loss never reads padding outputs.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax import recipes
from scalerl_jax.learner.logprobs import chunked_token_logprobs, token_logprobs
from scalerl_jax.models import attention as A

B, T, N, K, H = 2, 300, 4, 2, 16
BLOCK = 64


def _inputs(seed=0):
  r = np.random.default_rng(seed)
  return [jnp.asarray(r.normal(size=s), jnp.float32) for s in ((B, T, N, H), (B, T, K, H),
                                                                (B, T, K, H), (B, T, N, H))]


def _positions(kind):
  slots = np.arange(T)[None].repeat(B, 0)
  lens = np.array([[T], [217]])
  if kind == "right":
    return np.where(slots < lens, slots, -1).astype(np.int32)
  if kind == "left":
    return np.where(slots >= T - lens, slots - (T - lens), -1).astype(np.int32)
  return slots.astype(np.int32)


def _temperature(q, pos, floor_scale=32, attn_scale=0.1):
  """Llama-4 NoPE temperature tuning of q (as models/layers.py applies it before the kernel)."""
  scale = jnp.log1p(jnp.floor((pos.astype(jnp.float32) + 1.0) / floor_scale)) * attn_scale + 1.0
  return q * scale[:, :, None, None]


CASES = {   # name: (positions, chunk size, NoPE temperature tuning)
    "causal": ("slots", None, False),
    "chunked_boundary_in_block": ("slots", 100, False),   # 100 falls inside block [64, 128)
    "nope_temperature": ("slots", None, True),
    "right_padding": ("right", None, False),
    "left_padding": ("left", None, False),
    "left_padding_chunked": ("left", 100, False),
}


def _check(fn, case, tol=1e-5):
  kind, chunk, temp = CASES[case]
  q, k, v, ct = _inputs()
  pos = jnp.asarray(_positions(kind))
  if temp:
    q = _temperature(q, pos)
  ct = ct * (pos >= 0)[..., None, None]
  run = lambda f: lambda q, k, v: jnp.sum(f(q, k, v, pos, pos, chunk_size=chunk) * ct)
  fwd = lambda f: jax.jit(lambda q, k, v: f(q, k, v, pos, pos, chunk_size=chunk))
  ref_out = fwd(A.einsum_attention)(q, k, v)
  out = fwd(fn)(q, k, v)
  valid = (pos >= 0)[..., None, None]
  errs = [float(jnp.max(jnp.abs((out - ref_out) * valid)))]
  # jitted: op-by-op (eager) gradients of these graphs took most of the module's ~180 s
  g_ref = jax.jit(jax.grad(run(A.einsum_attention), argnums=(0, 1, 2)))(q, k, v)
  g = jax.jit(jax.grad(run(fn), argnums=(0, 1, 2)))(q, k, v)
  errs += [float(jnp.max(jnp.abs(a - b)) / max(1.0, float(jnp.max(jnp.abs(b)))))
           for a, b in zip(g, g_ref)]
  print(case, "out, dq, dk, dv errors", errs)
  assert max(errs) <= tol, errs
  return errs


@pytest.mark.parametrize("case", sorted(CASES))
def test_blockwise_matches_einsum(case):
  _check(lambda *a, **kw: A.blockwise_attention(*a, block=BLOCK, **kw), case)


@pytest.mark.parametrize("case", ["causal", "chunked_boundary_in_block", "right_padding",
                                  "nope_temperature"])
def test_causal_blocks_kernel_matches_einsum(case):
  """Query blocks of 48 (T = 300: a partial last block; chunk 100 crosses a block): the key tiles
  above the diagonal are skipped, and nothing changes (slot-order cases)."""
  _check(lambda *a, **kw: A.causal_block_attention(*a, q_block=48, **kw), case)


@pytest.mark.parametrize("case", sorted(CASES))
def test_causal_blocks_dispatch_matches_einsum(case):
  """Through `attention(impl="causal_blocks")`: slot order takes the skipping kernel, left
  padding (a key after a query's slot can be visible) the blockwise fallback; both exact."""
  _check(lambda *a, **kw: A.attention(*a, impl="causal_blocks", q_block=48, block=BLOCK, **kw),
         case)


def test_causal_blocks_skips_the_tiles_above_the_diagonal():
  """The compiled forward does about half the score FLOPs of the einsum reference at 8 blocks
  ((8+1)/16 = 0.5625 of the T*T tiles), measured by XLA's own cost analysis."""
  q, k, v, _ = _inputs()
  q, k, v = q[:, :256], k[:, :256], v[:, :256]
  pos = jnp.asarray(np.arange(256)[None].repeat(B, 0).astype(np.int32))
  flops = lambda f: jax.jit(f).lower(q, k, v, pos, pos).compile().cost_analysis()["flops"]
  ref = flops(lambda *a: A.einsum_attention(*a))
  ours = flops(lambda *a: A.causal_block_attention(*a, q_block=32))
  assert 0.5 <= ours / ref <= 0.65, (ours, ref)


def test_executed_branch_only_counts_the_path_a_slot_layout_batch_runs():
  """XLA's cost analysis counts the dispatch's lax.cond as its costlier branch (the blockwise
  fallback when that one costs more): `executed_branch_only` traces the fast path alone, for
  counting. Same output on a slot-layout batch, the kernel's own FLOPs, no case/if op in its HLO;
  the flag is off after."""
  q, k, v, _ = _inputs()
  q, k, v = q[:, :256], k[:, :256], v[:, :256]
  pos = jnp.asarray(np.arange(256)[None].repeat(B, 0).astype(np.int32))
  f = lambda *a: A.attention(*a, impl="causal_blocks", q_block=32, block=64)
  guarded = jax.jit(f).lower(q, k, v, pos, pos)
  with A.executed_branch_only():
    fast = jax.jit(lambda *a: f(*a)).lower(q, k, v, pos, pos)
  has_cond = lambda low: any(op in low.as_text() for op in ("stablehlo.case", "stablehlo.if"))
  assert has_cond(guarded) and not has_cond(fast)
  cost = lambda low: low.compile().cost_analysis()["flops"]
  direct = jax.jit(lambda *a: A.causal_block_attention(*a, q_block=32)).lower(q, k, v, pos, pos)
  assert cost(fast) == pytest.approx(cost(direct), rel=1e-6)      # the kernel, nothing else
  assert cost(guarded) >= cost(fast) * (1 - 1e-6)                  # the cond: its costlier branch
  np.testing.assert_allclose(np.asarray(fast.compile()(q, k, v, pos, pos)),
                             np.asarray(guarded.compile()(q, k, v, pos, pos)), rtol=1e-5, atol=1e-6)
  assert has_cond(jax.jit(lambda *a: f(*a)).lower(q, k, v, pos, pos))


@pytest.mark.parametrize("case", ["causal", "chunked_boundary_in_block", "right_padding"])
def test_cudnn_wrapper_matches_einsum(case):
  """The cudnn backend's slot-layout wrapper (chunk folding, sequence lengths), run with
  jax.nn.dot_product_attention's XLA implementation on CPU (cuDNN itself needs a GPU)."""
  fn = lambda *a, **kw: A.dot_product_attention_slots(*a, implementation="xla", **kw)
  _check(fn, case)


def test_splash_interpret_matches_einsum():
  """Pallas splash attention (TPU kernel) in interpret mode on CPU, right padding."""
  fn = lambda *a, **kw: A.splash_attention_slots(*a, interpret=True, **kw)
  _check(fn, "right_padding")


def test_slot_layout_detects_what_the_fast_kernels_assume():
  pos = {k: jnp.asarray(_positions(k)) for k in ("slots", "right", "left")}
  assert bool(A.slot_layout(pos["slots"], pos["slots"]))
  assert bool(A.slot_layout(pos["right"], pos["right"]))
  assert not bool(A.slot_layout(pos["left"], pos["left"]))   # -> blockwise fallback


def test_unavailable_backend_is_a_config_error():
  def cfg(impl):
    c = common.base_config()
    c.model.attention_impl = impl
    return c
  for impl, platform in (("cudnn", "cpu"), ("splash", "cpu"), ("splash", "gpu"),
                         ("cudnn", "tpu"), ("flash", "cpu")):
    with pytest.raises(recipes.ConfigError, match="attention_impl"):
      recipes.check_attention(cfg(impl).model, platform)
  for impl, platform in (("auto", "cpu"), ("blockwise", "cpu"), ("cudnn", "gpu"),
                         ("splash", "tpu"), ("xla_einsum", "gpu")):
    recipes.check_attention(cfg(impl).model, platform)
  assert A.resolve("auto", "gpu") == "cudnn" and A.resolve("auto", "tpu") == "splash"
  assert A.resolve("auto", "cpu") == "causal_blocks"


@pytest.mark.parametrize("chunk", [8, 37, 64])
def test_chunked_logprobs_equal_whole_logits(chunk):
  """Chunks of 8 (not dividing T = 37), exactly T, and more than T: log-probs, entropies and
  the gradient w.r.t. hidden and kernel equal the whole-logits path to <= 1e-6 (scaled error
  max|a - b| / max(1, max|b|); the chunked matmuls round differently in the last bit)."""
  r = np.random.default_rng(1)
  Bn, Tn, D, V = 3, 37, 16, 50
  hidden = jnp.asarray(r.normal(size=(Bn, Tn, D)), jnp.float32)
  kernel = jnp.asarray(r.normal(size=(D, V)) * 0.5, jnp.float32)
  tokens = jnp.asarray(r.integers(0, V, size=(Bn, Tn)), jnp.int32)
  w = jnp.asarray(r.normal(size=(Bn, Tn)), jnp.float32)
  whole = token_logprobs(jnp.einsum("BTD,DV->BTV", hidden, kernel), tokens)
  chunked = chunked_token_logprobs(hidden, kernel, tokens, chunk)
  for a, b in zip(chunked, whole):
    assert a.shape == b.shape == (Bn, Tn)
    assert float(jnp.max(jnp.abs(a - b))) / max(1.0, float(jnp.max(jnp.abs(b)))) <= 1e-6
  f_whole = lambda h, k: jnp.sum(token_logprobs(jnp.einsum("BTD,DV->BTV", h, k), tokens)[0] * w)
  f_chunk = lambda h, k: jnp.sum(chunked_token_logprobs(h, k, tokens, chunk)[0] * w)
  for a, b in zip(jax.jit(jax.grad(f_chunk, (0, 1)))(hidden, kernel),
                  jax.jit(jax.grad(f_whole, (0, 1)))(hidden, kernel)):
    assert float(jnp.max(jnp.abs(a - b))) / max(1.0, float(jnp.max(jnp.abs(b)))) <= 1e-6
