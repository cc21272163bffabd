"""The ModelConfig of a run: from its model section (and its mesh, for MoE expert sharding).

`model_config(config)`: the learner, the generators, the tools and launch's preflight build the
model the same way (the config layer takes `config.model`'s ModelConfig overrides free-form; they
are checked here, where ModelConfig is known).
"""
from __future__ import annotations

import dataclasses
import json

from scalerl_jax import models, storage
from scalerl_jax.models import moe

_NOT_MODEL_FIELDS = ("preset", "hf_checkpoint", "logits_chunk")


def model_config(config) -> models.ModelConfig:
  """ModelConfig from `config.model`: the preset, then every field that names a ModelConfig field.

  With `config.model.hf_checkpoint` set (local or gs://), the architecture comes from that
  checkpoint's config.json and only the numerics fields (dtypes, fp32 head, scan, remat) apply.
  """
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  m = config.model.to_dict()
  unknown = [k for k in m if k not in fields and k not in _NOT_MODEL_FIELDS]
  if unknown:
    raise ValueError(f"config.model has unknown fields {unknown}; ModelConfig fields are "
                     f"{sorted(fields)}")
  overrides = {k: v for k, v in m.items() if k in fields}
  if config.model.hf_checkpoint:
    cfg_path = storage.join(m["hf_checkpoint"], "config.json")   # local or gs://
    if not storage.exists(cfg_path):
      raise FileNotFoundError(f"config.model.hf_checkpoint={m['hf_checkpoint']!r}: no "
                              "config.json there (expected a save_pretrained directory)")
    numerics = {k: overrides[k] for k in ("param_dtype", "dtype", "fp32_lm_head", "scan_layers",
                                          "remat", "attention_impl", "attention_block",
                                          "attention_q_block", "head_precision",
                                          "moe_impl", "moe_capacity_factor")
                if k in overrides}
    cfg = models.from_hf_config(json.loads(storage.read_text(cfg_path)), **numerics)
  else:
    cfg = models.get_preset(m["preset"], **overrides)
  mesh = getattr(config, "mesh", None)   # a ConfigDict or a typed RunConfig (may lack it)
  if cfg.is_moe and mesh is not None and cfg.moe_impl == "dispatch":
    shape = {a: int(s) for a, s in mesh.shape if int(s) > 0}   # -1 (rest): checked at trace
    moe.expert_shards(cfg.num_experts, shape, tuple(mesh.rules))
  return cfg
