"""KV-cache prefill / decode equals the full forward (fp32, <= 1e-5), incl. chunk boundaries and
the sampler's per-layer heads-major cache."""
import jax
import numpy as np
import pytest

from scalerl_jax import models
from scalerl_jax.models.testing import rel_err

TOL = 1e-5
_fwd = jax.jit(models.forward, static_argnums=1)
_prefill = jax.jit(models.prefill, static_argnums=1)
_step = jax.jit(models.decode_step, static_argnums=1, donate_argnums=3)


def _cfg(name, **kw):
  if name == "tiny_llama4":  # chunk 8 and floor_scale 4 so chunking / temperature tuning matter
    kw = dict(dict(attention_chunk_size=8, floor_scale=4, num_experts_per_tok=2), **kw)
  return models.get_preset(name, vocab_size=256, d_model=128, head_dim=32, ffn_dim=192,
                           expert_ffn_dim=64 if name == "tiny_llama4" else 0, **kw)


@pytest.mark.parametrize("name,scan", [("tiny_llama3", False), ("tiny_llama4", False),
                                       ("tiny_llama4", True)])
def test_prefill_then_decode_equals_forward(name, scan):
  cfg = _cfg(name, scan_layers=scan)
  params = models.init_params(cfg, jax.random.PRNGKey(1))
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 21))
  full = np.asarray(_fwd(params, cfg, tokens))
  cache = models.init_cache(cfg, batch=2, max_len=24)
  n_prompt = 5   # decode crosses the chunk boundaries at positions 8 and 16
  logits, cache = _prefill(params, cfg, tokens[:, :n_prompt], cache)
  got = [np.asarray(logits)]
  for t in range(n_prompt, tokens.shape[1]):
    step_logits, cache = _step(params, cfg, tokens[:, t], cache)
    got.append(np.asarray(step_logits)[:, None])
  got = np.concatenate(got, axis=1)
  print(f"cache rel_err {rel_err(got, full):.2e}")
  assert rel_err(got, full) <= TOL
  assert int(cache["index"]) == 21 and list(np.asarray(cache["next_pos"])) == [21, 21]


@pytest.mark.parametrize("name", ["tiny_llama3", "tiny_llama4"])
def test_left_padded_rows_decode_together(name):
  """Rows with prompts of different lengths (left-padded) match their own unpadded forward."""
  cfg = _cfg(name)
  params = models.init_params(cfg, jax.random.PRNGKey(2))
  rng = np.random.RandomState(1)
  lens, gen = [3, 11], 9
  seqs = [rng.randint(1, cfg.vocab_size, (n + gen,)) for n in lens]
  P = max(lens)
  prompt = np.zeros((2, P), np.int32)
  mask = np.zeros((2, P), bool)
  for r, n in enumerate(lens):
    prompt[r, P - n:] = seqs[r][:n]
    mask[r, P - n:] = True
  cache = models.init_cache(cfg, batch=2, max_len=P + gen)
  logits, cache = _prefill(params, cfg, prompt, cache, mask)
  outs = [[np.asarray(logits)[r, -1]] for r in range(2)]
  for t in range(gen - 1):
    tok = np.array([seqs[r][lens[r] + t] for r in range(2)], np.int32)
    step_logits, cache = _step(params, cfg, tok, cache)
    for r in range(2):
      outs[r].append(np.asarray(step_logits)[r])
  for r, n in enumerate(lens):
    ref = np.asarray(_fwd(params, cfg, seqs[r][None]))[0, n - 1:n - 1 + gen]
    assert rel_err(np.stack(outs[r]), ref) <= TOL, r
  assert list(np.asarray(cache["next_pos"])) == [l + gen - 1 for l in lens]


def test_multi_chunk_prefill_and_errors():
  cfg = _cfg("tiny_llama4", scan_layers=True, moe_impl="dispatch")
  params = models.init_params(cfg, jax.random.PRNGKey(3))
  tokens = np.random.RandomState(2).randint(0, cfg.vocab_size, (1, 20))
  full = np.asarray(_fwd(params, cfg, tokens))
  cache = models.init_cache(cfg, batch=1, max_len=20)
  a, cache = _prefill(params, cfg, tokens[:, :13], cache)
  b, cache = _prefill(params, cfg, tokens[:, 13:], cache)
  assert rel_err(np.concatenate([a, b], 1), full) <= TOL
  with pytest.raises(ValueError, match="decode_step takes tokens"):
    models.decode_step(params, cfg, tokens, cache)
  with pytest.raises(ValueError, match="batch"):
    models.prefill(params, cfg, np.zeros((3, 2), np.int32), cache)
  with pytest.raises(ValueError, match="positive"):
    models.init_cache(cfg, 0, 4)


@pytest.mark.parametrize("kv_dtype,tol", [("float32", TOL), ("bfloat16", 1e-2)])
def test_split_heads_major_cache_equals_forward(kv_dtype, tol):
  """The sampler's per-layer [B,K,S,H] cache (rollout.sampler.split_cache) decodes like the full
  forward: float32 within TOL; a bfloat16 cache within its rounding (measured 2.0e-3 rel)."""
  from scalerl_jax.generation.sampler import split_cache
  cfg = _cfg("tiny_llama3")
  params = models.init_params(cfg, jax.random.PRNGKey(4))
  tokens = np.random.RandomState(3).randint(0, cfg.vocab_size, (2, 17))
  full = np.asarray(_fwd(params, cfg, tokens))
  cache = split_cache(models.init_cache(cfg, batch=2, max_len=20, dtype=kv_dtype))
  assert cache["k"][0].shape == (2, cfg.num_kv_heads, 20, cfg.head_dim)
  logits, cache = _prefill(params, cfg, tokens[:, :6], cache)
  got = [np.asarray(logits)]
  for t in range(6, tokens.shape[1]):
    step_logits, cache = _step(params, cfg, tokens[:, t], cache)
    got.append(np.asarray(step_logits)[:, None])
  err = rel_err(np.concatenate(got, axis=1), full)
  print(f"split {kv_dtype} cache rel_err {err:.2e}")
  assert err <= tol
  assert isinstance(cache["k"], tuple) and cache["k"][0].dtype == np.dtype(kv_dtype)
