"""Parity of our flax decoders with HF transformers (CPU torch, random tiny models, fp32)."""

import jax
import numpy as np
import pytest

from scalerl_jax import models
from scalerl_jax.models.testing import hf_logits, params_from_torch, random_hf_model, rel_err

TOL = 1e-4
_fwd = jax.jit(models.forward, static_argnums=1)


def _small(name, **kw):
  base = dict(vocab_size=256, d_model=128, num_heads=4, num_kv_heads=2, head_dim=32, ffn_dim=192,
              num_layers=2)
  base.update(kw)
  return models.get_preset(name, **base)


def _parity(cfg, seq=48, batch=2, seed=0):
  model = random_hf_model(cfg, seed=seed)
  params = params_from_torch(cfg, model)
  tokens = np.random.RandomState(seed).randint(0, cfg.vocab_size, (batch, seq))
  ref = hf_logits(model, tokens)
  ours = np.asarray(_fwd(params, cfg, tokens))
  assert ours.dtype == np.float32 and ours.shape == ref.shape
  err = rel_err(ours, ref)
  print(f"parity rel_err {err:.2e}")
  return err


@pytest.mark.parametrize("kv_heads", [4, 2, 1])       # query heads per KV head: 1, 2, 4
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_llama3_parity(kv_heads, tied, rope):
  # original_max_position 16 with a 48-token sequence so the llama3 scaling rule matters.
  cfg = _small("tiny_llama3", num_kv_heads=kv_heads, tie_embeddings=tied, rope_type=rope,
               rope_original_max_position=16, rope_factor=8.0, rope_theta=10000.0)
  assert _parity(cfg) <= TOL


@pytest.mark.parametrize("impl", ["xla_einsum", "blockwise", "causal_blocks"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_attention_backends_parity_and_gradient(kv_heads, impl):
  """Each CPU attention backend (blockwise with 16-slot key blocks, so 3 blocks; causal_blocks
  with 16-slot query blocks) matches HF and
  the xla_einsum reference in value and in the gradient of a log-prob sum; cudnn / splash are
  refused on CPU."""
  cfg = _small("tiny_llama3", num_kv_heads=kv_heads, attention_impl=impl, attention_block=16,
               attention_q_block=16)
  assert _parity(cfg) <= TOL
  ref = _small("tiny_llama3", num_kv_heads=kv_heads, attention_impl="xla_einsum")
  params = models.init_params(ref, jax.random.PRNGKey(1))
  tokens = np.random.RandomState(1).randint(0, ref.vocab_size, (2, 40))

  def lp(p, c):
    logits = models.forward(p, c, tokens)
    return jax.numpy.sum(jax.nn.log_softmax(logits)[..., 0])
  g_f, g_e = (jax.jit(jax.grad(lp), static_argnums=1)(params, c) for c in (cfg, ref))
  scale = max(float(np.abs(x).max()) for x in jax.tree.leaves(g_e))
  err = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(g_f), jax.tree.leaves(g_e)))
  assert err / scale <= 1e-5, err / scale
  for unavailable in ("cudnn", "splash"):
    with pytest.raises(ValueError, match="needs a"):
      _fwd(params, ref.replace(attention_impl=unavailable), tokens)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("step", [1, 2])
def test_llama4_parity(top_k, step):
  # 4 layers: layer 3 is NoPE (interval 4); 80 tokens > chunk 32 so chunking matters;
  # floor_scale 8 so temperature tuning changes the NoPE layer.
  cfg = _small("tiny_llama4", num_layers=4, num_experts=4, expert_ffn_dim=96, num_experts_per_tok=top_k,
               interleave_moe_layer_step=step, attention_chunk_size=32, floor_scale=8)
  assert not cfg.layer_uses_rope(3) and cfg.layer_is_chunked(0)
  assert _parity(cfg, seq=80) <= TOL


@pytest.mark.parametrize("kv_heads", [4, 1])
def test_llama4_variants_parity(kv_heads):
  """Explicit no_rope_layers, tied embeddings, llama3 rope scaling, no QK-norm / temp tuning,
  dispatching (ragged) MoE with top-2."""
  cfg = _small("tiny_llama4", num_layers=3, num_kv_heads=kv_heads, num_experts=3, expert_ffn_dim=64,
               moe_impl="dispatch", num_experts_per_tok=1 if kv_heads == 4 else 2,
               interleave_moe_layer_step=1, no_rope_layers=(0, 1, 1), attention_chunk_size=16,
               use_qk_norm=kv_heads == 4, attn_temperature_tuning=kv_heads == 4, floor_scale=4,
               tie_embeddings=True, rope_type="llama3", rope_original_max_position=16)
  assert _parity(cfg, seq=40) <= TOL


@pytest.mark.parametrize("name", ["tiny_llama3", "tiny_llama4"])
def test_presets_parity_scan_remat(name):
  """The tiny presets themselves, with scan over layer blocks and remat, match HF."""
  cfg = models.get_preset(name, scan_layers=True, remat="dots")
  assert _parity(cfg, seq=40 if name == "tiny_llama4" else 24) <= TOL


def test_padding_matches_unpadded():
  """Left- and right-padded rows give the same logits on real tokens as the unpadded row."""
  cfg = _small("tiny_llama4", num_layers=4, num_experts=4, expert_ffn_dim=64, attention_chunk_size=8,
               floor_scale=4)
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  rng = np.random.RandomState(0)
  row = rng.randint(0, cfg.vocab_size, (1, 20))
  ref = np.asarray(_fwd(params, cfg, row))[0]
  pad = 7
  left = np.concatenate([np.zeros((1, pad), int), row], 1)
  right = np.concatenate([row, np.zeros((1, pad), int)], 1)
  mask_l = np.arange(27)[None] >= pad
  mask_r = np.arange(27)[None] < 20
  out_l = np.asarray(_fwd(params, cfg, left, mask=mask_l))[0]
  out_r = np.asarray(_fwd(params, cfg, right, mask=mask_r))[0]
  assert rel_err(out_l[pad:], ref) <= 1e-5
  assert rel_err(out_r[:20], ref) <= 1e-5


def test_fp32_head_flag_and_bf16():
  cfg = models.get_preset("tiny_llama3", num_layers=1, dtype="bfloat16")
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  tokens = np.zeros((1, 4), np.int32)
  out = _fwd(params, cfg, tokens)
  assert out.dtype == np.float32
  low = _fwd(params, cfg.replace(fp32_lm_head=False), tokens)
  assert low.dtype == np.float32
  assert np.max(np.abs(np.asarray(out) - np.asarray(low))) > 0  # head really ran in bf16


def test_swiglu_vjp_matches_autodiff_in_float64_terms():
  """The SwiGLU custom VJP (only g and u saved) equals autodiff of silu(g) * u, and the NumPy
  derivative: d/dg = dh * u * s * (1 + g (1 - s)), d/du = dh * silu(g)."""
  from scalerl_jax.models.layers import swiglu
  r = np.random.default_rng(0)
  g, u, dh = (jax.numpy.asarray(r.normal(size=(6, 40)) * 3, jax.numpy.float32) for _ in range(3))
  out, vjp = jax.vjp(swiglu, g, u)
  ref_out, ref_vjp = jax.vjp(lambda a, b: jax.nn.silu(a) * b, g, u)
  np.testing.assert_allclose(out, ref_out, rtol=1e-6)
  for a, b in zip(vjp(dh), ref_vjp(dh)):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)
  g64, u64, dh64 = (np.asarray(x, np.float64) for x in (g, u, dh))
  s = 1 / (1 + np.exp(-g64))
  np.testing.assert_allclose(vjp(dh)[0], dh64 * u64 * s * (1 + g64 * (1 - s)), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(vjp(dh)[1], dh64 * g64 * s, rtol=1e-5, atol=1e-6)


def test_head_precision_choices():
  """fp32 / tf32 run the head in float32 (equal on CPU: XLA:CPU has no TF32); bf16 rounds both
  operands (a measurable difference); anything else is refused when the config is built."""
  cfg = models.get_preset("tiny_llama3", num_layers=1)
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  tokens = np.arange(8, dtype=np.int32)[None]
  out = {p: np.asarray(_fwd(params, cfg.replace(head_precision=p), tokens))
         for p in ("fp32", "tf32", "bf16")}
  assert all(o.dtype == np.float32 for o in out.values())
  np.testing.assert_array_equal(out["fp32"], out["tf32"])
  assert 0 < np.max(np.abs(out["bf16"] - out["fp32"])) < 0.05
  with pytest.raises(ValueError, match="head_precision"):
    cfg.replace(head_precision="fp16")


def test_config_roundtrip_and_errors():
  for name in models.PRESETS:
    cfg = models.get_preset(name)
    back = models.from_hf_config(models.to_hf_config(cfg))
    for f in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "ffn_dim", "rope_type", "rope_theta", "num_experts", "expert_ffn_dim",
              "attention_chunk_size", "tie_embeddings"):
      assert getattr(back, f) == getattr(cfg, f), (name, f)
    assert [back.layer_kind(i) for i in range(cfg.num_layers)] == \
        [cfg.layer_kind(i) for i in range(cfg.num_layers)]
  scout = models.get_preset("llama4_scout_17b_16e")
  assert all(scout.layer_is_moe(i) for i in range(48))
  assert [i for i in range(48) if not scout.layer_uses_rope(i)] == list(range(3, 48, 4))
  assert scout.scan_period == 4
  with pytest.raises(ValueError, match="unknown model preset"):
    models.get_preset("nope")
  with pytest.raises(ValueError, match="unknown ModelConfig fields"):
    models.get_preset("tiny_llama3", bogus=1)
  with pytest.raises(ValueError, match="multiple of num_kv_heads"):
    models.get_preset("tiny_llama3", num_kv_heads=3)
  with pytest.raises(ValueError, match="tokens must be"):
    models.forward(None, models.get_preset("tiny_llama3"), np.zeros((3,), np.int32))


def test_scan_remat_gradients_match_loop():
  """Gradients through nn.scan blocks + remat equal those of the plain layer loop."""
  from scalerl_jax.models import hf_io
  base = _small("tiny_llama4", num_layers=4, num_experts=4, expert_ffn_dim=64,
                attention_chunk_size=8, floor_scale=4)
  scan = base.replace(scan_layers=True, remat="full")
  p_loop = jax.tree.map(np.asarray, models.init_params(base, jax.random.PRNGKey(0)))
  top = {k: v for k, v in p_loop.items() if not k.startswith("layers_")}
  p_scan = hf_io.from_layer_trees(scan, top, hf_io.layer_trees(base, p_loop))
  tokens = np.random.RandomState(0).randint(0, base.vocab_size, (2, 20))

  def loss(p, cfg):
    logp = jax.nn.log_softmax(models.forward(p, cfg, tokens[:, :-1]))
    return -np.float32(1.0) * jax.numpy.mean(
        jax.numpy.take_along_axis(logp, tokens[:, 1:, None], -1))
  l1, g1 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p_loop, base)
  l2, g2 = jax.jit(jax.value_and_grad(loss), static_argnums=1)(p_scan, scan)
  assert abs(float(l1) - float(l2)) <= 1e-6
  g2 = jax.tree.map(np.asarray, g2)
  top2 = {k: v for k, v in g2.items() if k != "blocks"}
  g2_loop = hf_io.from_layer_trees(base, top2, hf_io.layer_trees(scan, g2))
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2_loop)):
    assert rel_err(b, a) <= 1e-4
