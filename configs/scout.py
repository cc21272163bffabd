"""Llama-4 Scout 17B x 16E MoE at the paper's ScaleRL settings.

Run:
  python -m scalerl_jax.main --config=configs/scout.py --config.model.hf_checkpoint=/ckpt/scout --workdir=gs://bucket/run
"""
from configs import common


def get_config(arg=None):
  del arg
  c = common.base_config()
  c.model.preset = "llama4_scout_17b_16e"
  c.mesh.shape = (("data", 1), ("fsdp", -1), ("tensor", 1), ("expert", 1))
  return c
