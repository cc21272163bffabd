"""The Llama-3 dense family (HF LlamaForCausalLM)."""
from __future__ import annotations

from scalerl_jax.models.families.base import Family, register


def _from_hf(d) -> dict:
  return {"ffn_dim": d["intermediate_size"]}


def _to_hf(cfg) -> dict:
  return {"intermediate_size": cfg.ffn_dim}


LLAMA3 = register(Family(
    name="llama3", hf_model_types=("llama",), hf_config_class="LlamaConfig",
    hf_model_class="LlamaForCausalLM", ff_prefix="mlp.", rope_layout="half",
    default_rope_theta=10000.0, from_hf=_from_hf, to_hf=_to_hf))
