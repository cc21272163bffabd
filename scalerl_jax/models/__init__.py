"""Llama-3 dense and Llama-4 (text) MoE decoders in flax.linen, KV-cache decoding, HF I/O.

Public API (stable; other parts code against exactly this):

  ModelConfig                      frozen dataclass of hyper-parameters (models/config.py)
  get_preset(name, **overrides)    'llama3_8b' | 'llama4_scout_17b_16e' | 'tiny_llama3' | 'tiny_llama4'
  from_hf_config(hf_cfg_or_dict)   -> ModelConfig;  to_hf_config(cfg) -> transformers config
  Transformer(cfg)                 the flax.linen module (apply-level API, see transformer.py)
  init_params(cfg, rng, boxed=False) -> params (plain dict; boxed=True keeps logical-axis boxes)
  forward(params, cfg, tokens, positions=None, mask=None, routes=None) -> float32 logits [B,T,V]
                                   (routes int [B,T,R,K]: MoE expert choices to replay, R3)
  forward_hidden(params, cfg, tokens, positions=None, mask=None) -> (hidden [B,T,D], head [D,V])
  init_cache(cfg, batch, max_len)  -> cache dict {k, v [L,B,S,K,H], pos [B,S], index [], next_pos [B]}
  prefill(params, cfg, tokens [B,T], cache, mask=None) -> (float32 logits [B,T,V], cache)
  decode_step(params, cfg, tokens [B], cache) -> (float32 logits [B,V], cache)
    (both with return_routes=True also return the chosen experts int32 [B,T,R,K] / [B,R,K])
  num_moe_layers(cfg), check_routes_shape(cfg, shape, tokens_shape)   routes' R and validation
  load_hf(path, **overrides)       -> (cfg, numpy params) from a save_pretrained directory
  save_hf(cfg, params, path)       writes config.json + safetensors loadable by transformers
  hf_named_arrays(cfg, params)     yields (hf_name, np.ndarray) in HF naming/layout (weight push)
  CACHE_LOGICAL_AXES               logical axes of each cache entry (for sharding the cache)

None of the functions is jitted: callers jit with cfg static, e.g.
`jax.jit(forward, static_argnums=1)` / `jax.jit(decode_step, static_argnums=1, donate_argnums=3)`.

Batched decoding of prompts with different lengths: left-pad the prompts and pass
`mask` (False on padding) to `prefill`; every row keeps its own positions (`cache['next_pos']`)
while all rows share one write slot (`cache['index']`). Attention masks are built from positions,
so padding is never attended to and Llama-4 chunks are counted from each row's first real token
(as HF does with left padding).
"""
from scalerl_jax.models.config import ModelConfig, PRESETS, from_hf_config, get_preset, to_hf_config
from scalerl_jax.models.hf_io import hf_named_arrays, load_hf, save_hf
from scalerl_jax.models.transformer import (CACHE_LOGICAL_AXES, Transformer, check_routes_shape,
                                            decode_step, forward, forward_hidden, init_cache,
                                            init_params, num_moe_layers, prefill)

__all__ = [
    "ModelConfig", "PRESETS", "get_preset", "from_hf_config", "to_hf_config", "Transformer",
    "init_params", "forward", "forward_hidden", "init_cache", "prefill", "decode_step", "load_hf",
    "save_hf", "hf_named_arrays", "CACHE_LOGICAL_AXES", "num_moe_layers", "check_routes_shape",
]
