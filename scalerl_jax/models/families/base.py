"""The model-family registry (the package docstring says what a family is)."""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from scalerl_jax.registry import Registry


@dataclasses.dataclass(frozen=True)
class Family:
  """One decoder family and its HF mapping.

  `hf_model_types`: config.json `model_type` values read as this family; `hf_config_class` /
  `hf_model_class` / `hf_architecture`: the transformers names; `ff_prefix`: the HF parameter
  prefix of a layer's feed-forward block; `rope_layout`: "half" (rotate-half, HF Llama) or
  "pairs" (interleaved pairs, HF Llama-4 complex rotary); `moe`: routed experts allowed;
  `nope_chunked`: NoPE layers and chunked attention (Llama-4 `no_rope_layers`,
  `attention_chunk_size`); `default_rope_theta`: when config.json has none.
  `from_hf(d)`: the family's own ModelConfig fields from a config.json dict;
  `to_hf(cfg)`: the family's own HF config fields of a ModelConfig."""
  name: str
  hf_model_types: tuple[str, ...]
  hf_config_class: str
  hf_model_class: str
  ff_prefix: str
  rope_layout: str
  default_rope_theta: float
  from_hf: Callable[[Mapping[str, Any]], dict]
  to_hf: Callable[[Any], dict]
  moe: bool = False
  nope_chunked: bool = False
  # config.json `model_type`s of a wrapper whose `text_config` is this family's decoder config
  # (Llama4Config, a multimodal wrapper, holds a Llama4TextConfig).
  hf_wrapper_types: tuple[str, ...] = ()

  @property
  def hf_architecture(self) -> str:
    """config.json `architectures` entry."""
    return self.hf_model_class


FAMILIES: Registry[Family] = Registry("model family")
names = FAMILIES.names     # the registered family names, sorted
get = FAMILIES.get         # the family called `name`; ValueError naming the registered ones


def register(family: Family) -> Family:
  """Adds `family` under its name (a name registered twice is an error)."""
  if family.rope_layout not in ("half", "pairs"):
    raise ValueError(f"family {family.name}: rope_layout must be 'half' or 'pairs'")
  return FAMILIES.register(family.name)(family)


def decoder_config(d: Mapping[str, Any]) -> dict:
  """The decoder's config.json dict: a registered wrapper's `text_config` (a family's
  `hf_wrapper_types`), else `d` itself."""
  wrappers = {t for n in FAMILIES.names() for t in FAMILIES.get(n).hf_wrapper_types}
  if "text_config" in d and d.get("model_type") in wrappers:
    return dict(d["text_config"])
  return dict(d)


def of_hf_model_type(model_type: str) -> Family:
  """The family a config.json `model_type` belongs to; ValueError otherwise."""
  fams = [FAMILIES.get(n) for n in FAMILIES.names()]
  for f in fams:
    if model_type in f.hf_model_types:
      return f
  known = [t for f in fams for t in f.hf_model_types]
  raise ValueError(f"unsupported HF model_type {model_type!r} (expected one of {known})")
