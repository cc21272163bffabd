"""Tiny CPU config: a small Llama on the synthetic task; the default for demos and CI.

Run:
  python -m scalerl_jax.main --config=configs/tiny.py --workdir=/tmp/scalerl_tiny
"""
from configs import common


def get_config(arg=None):
  del arg
  c = common.base_config()
  c.total_steps = 60
  c.model.preset = "tiny_llama3"
  c.model.dtype = "float32"
  c.model.scan_layers = False
  c.model.remat = "none"
  c.mesh.shape = (("data", 1), ("fsdp", -1), ("tensor", 1), ("expert", 1))
  c.optim.lr = 1e-4
  c.optim.warmup_steps = 5
  c.rollout.prompts_per_step = 8
  c.rollout.generations_per_prompt = 8
  c.rollout.think_budget_min = 24
  c.rollout.think_budget_max = 32
  c.rollout.answer_budget = 8
  c.rollout.max_prompt_len = 32
  c.generator.backend = "jax"
  c.generator.num_workers = 1
  c.eval.every_steps = 5
  c.eval.num_prompts = 64
  c.data.kind = "synthetic"
  c.data.heldout = 64
  return c
