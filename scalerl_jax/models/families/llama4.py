"""The Llama-4 text family: routed-expert MoE layers, NoPE layers, chunked attention, QK norm
(HF Llama4ForCausalLM / Llama4TextConfig)."""
from __future__ import annotations

from scalerl_jax.models.families.base import Family, register


def _from_hf(d) -> dict:
  moe_layers = d.get("moe_layers")
  return dict(
      ffn_dim=d.get("intermediate_size_mlp", 16384), expert_ffn_dim=d["intermediate_size"],
      num_experts=d["num_local_experts"], num_experts_per_tok=d.get("num_experts_per_tok", 1),
      interleave_moe_layer_step=d.get("interleave_moe_layer_step", 1),
      moe_layers=tuple(moe_layers) if moe_layers is not None else None,
      no_rope_layers=tuple(d["no_rope_layers"]) if d.get("no_rope_layers") else None,
      no_rope_layer_interval=d.get("no_rope_layer_interval", 4),
      attention_chunk_size=d.get("attention_chunk_size"),
      use_qk_norm=bool(d.get("use_qk_norm", True)),
      attn_temperature_tuning=bool(d.get("attn_temperature_tuning", True)),
      floor_scale=int(d.get("floor_scale", 8192)), attn_scale=float(d.get("attn_scale", 0.1)))


def _to_hf(cfg) -> dict:
  no_rope = cfg.no_rope_layers or tuple(int(cfg.layer_uses_rope(i)) for i in range(cfg.num_layers))
  return dict(
      intermediate_size=cfg.expert_ffn_dim, intermediate_size_mlp=cfg.ffn_dim,
      num_local_experts=cfg.num_experts, num_experts_per_tok=cfg.num_experts_per_tok,
      interleave_moe_layer_step=cfg.interleave_moe_layer_step,
      moe_layers=[i for i in range(cfg.num_layers) if cfg.layer_is_moe(i)],
      no_rope_layers=list(no_rope), no_rope_layer_interval=cfg.no_rope_layer_interval,
      attention_chunk_size=cfg.attention_chunk_size, use_qk_norm=cfg.use_qk_norm,
      attn_temperature_tuning=cfg.attn_temperature_tuning, floor_scale=cfg.floor_scale,
      attn_scale=cfg.attn_scale)


LLAMA4 = register(Family(
    name="llama4", hf_model_types=("llama4_text", "llama4"), hf_config_class="Llama4TextConfig",
    hf_model_class="Llama4ForCausalLM", ff_prefix="feed_forward.", rope_layout="pairs",
    default_rope_theta=500000.0, from_hf=_from_hf, to_hf=_to_hf, moe=True, nope_chunked=True,
    hf_wrapper_types=("llama4",)))
