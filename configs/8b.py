"""Llama-3.1-8B-shaped dense model at the paper's ScaleRL settings.

Run:
  python -m scalerl_jax.main --config=configs/8b.py --config.model.hf_checkpoint=/ckpt/llama8b --workdir=gs://bucket/run
"""
from configs import common


def get_config(arg=None):
  del arg
  c = common.base_config()
  c.model.preset = "llama3_8b"
  return c
