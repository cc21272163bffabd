"""`ModelConfig`: hyper-parameters of the Llama-3 dense and Llama-4 (text) MoE decoders.

Presets: `llama3_8b`, `llama4_scout_17b_16e`, `tiny_llama3`, `tiny_synthetic`, `tiny_llama4` (see `PRESETS`).
`from_hf_config` / `to_hf_config` convert to and from `transformers` config objects (or dicts).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from scalerl_jax import lazy
from scalerl_jax.models import families

# transformers (~1 CPU-s to import) only on the HF I/O path (to_hf_config): loaded at first use.
transformers = lazy.module("transformers")

REMAT_POLICIES = ("none", "full", "dots")
# Training-path attention backends (models/attention.py): auto = cudnn on GPU, splash on TPU,
# causal_blocks elsewhere; xla_einsum = the materialised-scores reference.
ATTENTION_IMPLS = ("auto", "xla_einsum", "blockwise", "causal_blocks", "cudnn", "splash")
# LM-head matmul precision (layers.head_matmul; docs/LEARNER.md "Head precision").
HEAD_PRECISIONS = ("fp32", "tf32", "bf16")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters. Field names follow HF where a 1:1 field exists (see from_hf_config)."""
  family: str = "llama3"                 # llama3 (dense, LlamaForCausalLM) | llama4 (Llama4ForCausalLM)
  vocab_size: int = 512
  d_model: int = 256
  num_layers: int = 4
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 64
  ffn_dim: int = 768                     # dense SwiGLU width (HF intermediate_size / intermediate_size_mlp)
  norm_eps: float = 1e-5
  tie_embeddings: bool = False
  max_position_embeddings: int = 8192
  # RoPE. rope_type 'llama3' applies the Llama-3.1 frequency-scaling rule.
  rope_theta: float = 10000.0
  rope_type: str = "default"             # default | llama3
  rope_factor: float = 8.0
  rope_low_freq_factor: float = 1.0
  rope_high_freq_factor: float = 4.0
  rope_original_max_position: int = 8192
  # Llama-4 only.
  num_experts: int = 0                   # 0 = dense model
  num_experts_per_tok: int = 1
  expert_ffn_dim: int = 0                # HF intermediate_size (routed + shared expert width)
  interleave_moe_layer_step: int = 1
  moe_layers: tuple[int, ...] | None = None      # overrides interleave step (HF semantics)
  no_rope_layers: tuple[int, ...] | None = None  # HF semantics: 1 = layer uses RoPE, 0 = NoPE
  no_rope_layer_interval: int = 4
  attention_chunk_size: int | None = None        # chunked attention on RoPE layers (llama4)
  use_qk_norm: bool = False
  attn_temperature_tuning: bool = False
  floor_scale: int = 8192
  attn_scale: float = 0.1
  moe_impl: str = "dispatch"             # dispatch (expert-parallel, active FLOPs) | dense (reference)
  moe_capacity_factor: float = 0.0       # dispatch: 0 = dropless (ragged_dot); c > 0 = c*avg rows/expert
  bos_token_id: int | None = None
  eos_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = ()     # every eos id of the checkpoint (config.json + generation_config.json); () = eos_token_id alone
  # Numerics / compilation.
  param_dtype: str = "float32"
  dtype: str = "float32"                 # compute dtype
  fp32_lm_head: bool = True              # LM head in float32 -> float32 logits
  head_precision: str = "fp32"           # fp32 (HIGHEST) | tf32 | bf16 (layers.head_matmul)
  scan_layers: bool = False              # nn.scan over repeating blocks of the layer pattern
  remat: str = "none"                    # none | full | dots
  # Cache-free (training / scoring) attention backend, one of ATTENTION_IMPLS (models/attention.py);
  # the KV-cache decode path always materialises its scores.
  attention_impl: str = "auto"
  attention_block: int = 512             # key-block size of the blockwise (flash) backend
  attention_q_block: int = 64            # query-block size of the causal_blocks backend

  def __post_init__(self):
    fam = families.get(self.family)      # ValueError naming the registered families
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f"remat must be one of {REMAT_POLICIES}, got {self.remat!r}")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"attention_impl must be one of {ATTENTION_IMPLS}, got "
                       f"{self.attention_impl!r}")
    if self.attention_block <= 0:
      raise ValueError(f"attention_block must be positive, got {self.attention_block}")
    if self.attention_q_block <= 0:
      raise ValueError(f"attention_q_block must be positive, got {self.attention_q_block}")
    if self.head_precision not in HEAD_PRECISIONS:
      raise ValueError(f"head_precision must be one of {HEAD_PRECISIONS}, got "
                       f"{self.head_precision!r}")
    if self.moe_impl not in ("dense", "dispatch"):
      raise ValueError(f"moe_impl must be 'dense' or 'dispatch', got {self.moe_impl!r}")
    if self.moe_capacity_factor < 0:
      raise ValueError(f"moe_capacity_factor must be >= 0, got {self.moe_capacity_factor}")
    if self.rope_type not in ("default", "llama3"):
      raise ValueError(f"rope_type must be 'default' or 'llama3', got {self.rope_type!r}")
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                 "ffn_dim"):
      if getattr(self, name) <= 0:
        raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                       f"({self.num_kv_heads})")
    if not fam.moe and self.num_experts:
      raise ValueError(f"{self.family} family is dense: num_experts must be 0")
    if self.num_experts:
      if not 1 <= self.num_experts_per_tok <= self.num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}]")
      if self.expert_ffn_dim <= 0:
        raise ValueError("expert_ffn_dim must be positive for an MoE model")
    if self.no_rope_layers is not None and len(self.no_rope_layers) < self.num_layers:
      raise ValueError("no_rope_layers must have at least num_layers entries")
    if self.attention_chunk_size is not None and self.attention_chunk_size <= 0:
      raise ValueError("attention_chunk_size must be positive or None")

  # ---- per-layer structure (HF Llama4TextConfig rules) ----
  @property
  def is_moe(self) -> bool:
    return self.num_experts > 0

  def layer_is_moe(self, i: int) -> bool:
    """True if layer i uses the routed MoE FFN (HF `moe_layers` / `interleave_moe_layer_step`)."""
    if not self.is_moe:
      return False
    if self.moe_layers is not None:
      return i in self.moe_layers
    step = self.interleave_moe_layer_step
    return i % step == step - 1

  def layer_uses_rope(self, i: int) -> bool:
    """False for Llama-4 NoPE layers."""
    if not families.get(self.family).nope_chunked:
      return True
    if self.no_rope_layers:
      return bool(self.no_rope_layers[i])
    return (i + 1) % self.no_rope_layer_interval != 0

  def layer_is_chunked(self, i: int) -> bool:
    """Chunked (local) attention: Llama-4 RoPE layers when attention_chunk_size is set."""
    return (families.get(self.family).nope_chunked and self.attention_chunk_size is not None
            and self.layer_uses_rope(i))

  def layer_kind(self, i: int) -> tuple[bool, bool, bool]:
    """(moe, rope, chunked) of layer i; layers of equal kind have identical structure."""
    return (self.layer_is_moe(i), self.layer_uses_rope(i), self.layer_is_chunked(i))

  @property
  def scan_period(self) -> int:
    """Smallest p dividing num_layers with kind(i) == kind(i mod p): the scanned block size."""
    kinds = [self.layer_kind(i) for i in range(self.num_layers)]
    for p in range(1, self.num_layers + 1):
      if self.num_layers % p == 0 and all(kinds[i] == kinds[i % p] for i in range(self.num_layers)):
        return p
    return self.num_layers

  def replace(self, **kw) -> "ModelConfig":
    """Returns a copy with fields replaced."""
    return dataclasses.replace(self, **kw)


# ---------------------------------------------------------------- presets
PRESETS: dict[str, ModelConfig] = {
    "llama3_8b": ModelConfig(
        family="llama3", vocab_size=128256, d_model=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, ffn_dim=14336, norm_eps=1e-5, tie_embeddings=False,
        max_position_embeddings=131072, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_position=8192,
        bos_token_id=128000, eos_token_id=128001),
    "llama4_scout_17b_16e": ModelConfig(
        family="llama4", vocab_size=202048, d_model=5120, num_layers=48, num_heads=40,
        num_kv_heads=8, head_dim=128, ffn_dim=16384, norm_eps=1e-5, tie_embeddings=False,
        max_position_embeddings=10485760, rope_theta=500000.0, rope_type="llama3",
        rope_factor=16.0, rope_low_freq_factor=1.0, rope_high_freq_factor=1.0,
        rope_original_max_position=8192, num_experts=16, num_experts_per_tok=1,
        expert_ffn_dim=8192, interleave_moe_layer_step=1, no_rope_layer_interval=4,
        attention_chunk_size=8192, use_qk_norm=True, attn_temperature_tuning=True,
        floor_scale=8192, attn_scale=0.1, bos_token_id=200000, eos_token_id=200001),
    "tiny_llama3": ModelConfig(
        family="llama3", vocab_size=512, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, ffn_dim=768, rope_theta=10000.0, tie_embeddings=False,
        max_position_embeddings=2048),
    # configs/tiny.py's model (the synthetic task's 32-word vocabulary) as one preset name: how
    # launch.rehearse swaps it into a real-size config with `--config.model.preset=tiny_synthetic`.
    "tiny_synthetic": ModelConfig(
        family="llama3", vocab_size=32, d_model=128, num_layers=4, num_heads=2, num_kv_heads=1,
        head_dim=64, ffn_dim=384, rope_theta=10000.0, tie_embeddings=False,
        max_position_embeddings=256),
    "tiny_llama4": ModelConfig(
        family="llama4", vocab_size=512, d_model=256, num_layers=4, num_heads=4, num_kv_heads=2,
        head_dim=64, ffn_dim=768, rope_theta=10000.0, tie_embeddings=False,
        max_position_embeddings=2048, num_experts=4, num_experts_per_tok=1, expert_ffn_dim=256,
        interleave_moe_layer_step=2, no_rope_layer_interval=4, attention_chunk_size=32,
        use_qk_norm=True, attn_temperature_tuning=True, floor_scale=8, attn_scale=0.1),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
  """Returns the named preset with `overrides` applied (e.g. dtype='bfloat16', scan_layers=True)."""
  if name not in PRESETS:
    raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
  bad = set(overrides) - {f.name for f in dataclasses.fields(ModelConfig)}
  if bad:
    raise ValueError(f"unknown ModelConfig fields in overrides: {sorted(bad)}")
  return dataclasses.replace(PRESETS[name], **overrides)


# ---------------------------------------------------------------- HF conversion
def _first(x):
  return x[0] if isinstance(x, (list, tuple)) else x


def _all(x) -> tuple[int, ...]:
  """Every id of an HF `eos_token_id` entry (an int, a list, or None) when it lists several."""
  return tuple(int(i) for i in x) if isinstance(x, (list, tuple)) and len(x) > 1 else ()


def from_hf_config(hf: Any, **overrides: Any) -> ModelConfig:
  """Builds a ModelConfig from a transformers config object or a config.json dict.

  Accepts LlamaConfig / Llama4TextConfig, or a Llama4Config (its text_config is used).
  """
  d = families.decoder_config(dict(hf) if isinstance(hf, Mapping) else hf.to_dict())
  fam = families.of_hf_model_type(d.get("model_type", "llama"))
  family = fam.name
  rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
  rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
  if rope_type not in ("default", "llama3"):
    raise ValueError(f"unsupported rope_type {rope_type!r}")
  theta = rope.get("rope_theta", d.get("rope_theta", fam.default_rope_theta))
  head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
  kw: dict[str, Any] = dict(
      family=family, vocab_size=d["vocab_size"], d_model=d["hidden_size"],
      num_layers=d["num_hidden_layers"], num_heads=d["num_attention_heads"],
      num_kv_heads=d.get("num_key_value_heads") or d["num_attention_heads"], head_dim=head_dim,
      norm_eps=d.get("rms_norm_eps", 1e-5), tie_embeddings=bool(d.get("tie_word_embeddings", False)),
      max_position_embeddings=d.get("max_position_embeddings", 8192), rope_theta=float(theta),
      rope_type=rope_type, bos_token_id=_first(d.get("bos_token_id")),
      eos_token_id=_first(d.get("eos_token_id")), eos_token_ids=_all(d.get("eos_token_id")))
  if rope_type == "llama3":
    kw.update(rope_factor=float(rope["factor"]), rope_low_freq_factor=float(rope["low_freq_factor"]),
              rope_high_freq_factor=float(rope["high_freq_factor"]),
              rope_original_max_position=int(rope["original_max_position_embeddings"]))
  if d.get("attention_bias") or d.get("mlp_bias"):
    raise ValueError("attention_bias / mlp_bias are not supported")
  kw.update(fam.from_hf(d))
  kw.update(overrides)
  cfg = ModelConfig(**kw)
  # Canonical form: drop explicit per-layer lists that equal what the step / interval derive.
  if cfg.moe_layers is not None and list(cfg.moe_layers) == [
      i for i in range(cfg.num_layers) if cfg.replace(moe_layers=None).layer_is_moe(i)]:
    cfg = cfg.replace(moe_layers=None)
  if cfg.no_rope_layers is not None and list(cfg.no_rope_layers[:cfg.num_layers]) == [
      int(cfg.replace(no_rope_layers=None).layer_uses_rope(i)) for i in range(cfg.num_layers)]:
    cfg = cfg.replace(no_rope_layers=None)
  return cfg


def _rope_dict(cfg: ModelConfig) -> Mapping[str, Any]:
  r: dict[str, Any] = {"rope_type": cfg.rope_type, "rope_theta": cfg.rope_theta}
  if cfg.rope_type == "llama3":
    r.update(factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
             high_freq_factor=cfg.rope_high_freq_factor,
             original_max_position_embeddings=cfg.rope_original_max_position)
  return r


def to_hf_config(cfg: ModelConfig) -> Any:
  """Returns the transformers config describing `cfg` (its family's class: LlamaConfig,
  Llama4TextConfig)."""
  common = dict(
      vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
      num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
      head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
      max_position_embeddings=cfg.max_position_embeddings, rope_parameters=dict(_rope_dict(cfg)),
      bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) if cfg.eos_token_ids
      else cfg.eos_token_id, hidden_act="silu")
  fam = families.get(cfg.family)
  return getattr(transformers, fam.hf_config_class)(**fam.to_hf(cfg), **common)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse RoPE frequencies [head_dim/2] (float64 numpy), incl. the llama3 scaling rule."""
  dim = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32).astype(np.float32) / dim))
  inv = inv.astype(np.float32)
  if cfg.rope_type != "llama3":
    return inv
  factor, lo, hi = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  old = cfg.rope_original_max_position
  low_wl, high_wl = old / lo, old / hi
  wl = 2 * math.pi / inv
  out = np.where(wl > low_wl, inv / factor, inv)
  if hi != lo:
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = ~(wl < high_wl) & ~(wl > low_wl)
    out = np.where(medium, smoothed, out)
  return out.astype(np.float32)
