"""Prints one JSON object describing a config's model: parameter counts via jax.eval_shape.

Run from the repo root:
  python -m scalerl_jax.tools.describe --config=configs/8b.py
  python -m scalerl_jax.tools.describe --config=configs/scout.py

params_total counts every parameter; params_active counts those one token uses (top-k of the
routed experts, plus the shared expert, attention, norms, embedding row and LM head).
Nothing is allocated: shapes come from jax.eval_shape of the initializer.
"""
from __future__ import annotations

import json
import math

from absl import app
import jax
import ml_collections
from ml_collections import config_flags

from scalerl_jax.models import sections as model_sections
from scalerl_jax.models.config import ModelConfig
from scalerl_jax.sharding import abstract_params

_CONFIG = None   # the --config flag, defined only when run as a program (importable as a library)

_ROUTED = ("gate", "up", "down")


def model_config(c: ml_collections.ConfigDict) -> ModelConfig:
  """The ModelConfig of a run config (one place: scalerl_jax.model_sections.model_config)."""
  return model_sections.model_config(c)


def count_params(cfg: ModelConfig) -> dict:
  """{'params_total', 'params_active', 'params_routed_experts', 'params_embedding', 'param_bytes'}."""
  shapes = abstract_params(cfg)
  total = active = routed = nbytes = 0
  for path, leaf in jax.tree_util.tree_flatten_with_path(shapes)[0]:
    keys = [getattr(p, "key", str(p)) for p in path]
    n = math.prod(leaf.shape)
    total += n
    nbytes += n * leaf.dtype.itemsize
    if "moe" in keys and keys[-1] in _ROUTED and "shared" not in keys:
      routed += n
      active += n * cfg.num_experts_per_tok // cfg.num_experts
    else:
      active += n
  embed = cfg.vocab_size * cfg.d_model
  return dict(params_total=total, params_active=active, params_routed_experts=routed,
              params_embedding=embed, param_bytes=nbytes)


def describe(c: ml_collections.ConfigDict) -> dict:
  """The JSON-able description of a run config's model."""
  cfg = model_config(c)
  out = dict(preset=c.model.preset, family=cfg.family, num_layers=cfg.num_layers,
             d_model=cfg.d_model, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
             head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, num_experts=cfg.num_experts,
             experts_per_token=cfg.num_experts_per_tok, scan_period=cfg.scan_period,
             param_dtype=cfg.param_dtype, dtype=cfg.dtype)
  out.update(count_params(cfg))
  out["mesh_shape"] = [list(x) for x in c.mesh.shape]
  return out


def main(argv) -> None:
  del argv
  assert _CONFIG is not None             # defined when run as a program
  if _CONFIG.value is None:
    raise app.UsageError("--config=configs/NAME.py is required")
  print(json.dumps(describe(_CONFIG.value)))


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file.")
  app.run(main)
