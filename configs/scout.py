"""Llama-4 Scout 17B x 16E MoE at the paper's ScaleRL settings, with a learner layout per target.

Run (the arg after the colon picks the learner topology; default gb200_16):
  python -m scalerl_jax.main --config=configs/scout.py:gb200_16 --config.model.hf_checkpoint=/ckpt/scout --workdir=gs://bucket/run
Plan the memory of the real-size train step ahead of time (no accelerator needed):
  python -m scalerl_jax.tools.plan --config=configs/scout.py --topology=gb200_16

Paper settings as configs/8b.py (768 sequences of <= 16,384 tokens, AdamW 5e-7 / 1e-15 / 0.01 /
100 warm-up, PipelineRL-8, CISPO eps_max 5). The text decoder has 107.8e9 parameters: fp32 params +
fp32 Adam moments + the fp32 gradient are 16 B/param = 1.72 TB, i.e. 108 GB/device on 16 devices.
That fits only the 186 GB of a GB200 (the paper trains on 16 GB200); on 95 GB TPU v5p it needs
64 chips, on 80 GB H100 it needs >= 32 GPUs (docs/SCALE.md). Every parameter is sharded 16 ways
over fsdp x tensor (expert axis 1: with `moe_impl='dense'` the router/attention/shared-expert
weights would be replicated over an expert axis). Measured results: docs/SCALE.md.
"""
from configs import common
from scalerl_jax import topologies

DEFAULT_TOPOLOGY = "gb200_32"

# Sequence-parallel layouts (topologies.SEQUENCE_PARALLEL): micro-batch = ONE 16k sequence split
# over fsdp (T/fsdp query positions a device), heads / mlp / vocab over tensor; 768 micro-batches.
_SP = dict(microbatches=768, remat="full", scan_layers=True, sequence_parallel=True)
LAYOUTS = {
    "gb200_16": dict(mesh=(("data", 1), ("fsdp", 4), ("tensor", 4), ("expert", 1)), **_SP,
                     note="the paper's 16 trainer GPUs: does NOT fit this learner (docs/SCALE.md)"),
    "gb200_32": dict(mesh=(("data", 1), ("fsdp", 8), ("tensor", 4), ("expert", 1)), **_SP),
    "tpu_v5p_64": dict(mesh=(("data", 1), ("fsdp", 16), ("tensor", 4), ("expert", 1)), **_SP),
    "h100_64": dict(mesh=(("data", 1), ("fsdp", 8), ("tensor", 8), ("expert", 1)), **_SP),
    # Do NOT fit (the fp32 state alone is 81 GB/device); kept so the plan tool shows why.
    "tpu_v5p_16": dict(mesh=(("data", 1), ("fsdp", 4), ("tensor", 4), ("expert", 1)), **_SP,
                       note="does not fit"),
    "h100_16": dict(mesh=(("data", 1), ("fsdp", 2), ("tensor", 8), ("expert", 1)), **_SP,
                    note="does not fit"),
}


def get_config(arg=None):
  c = common.base_config()
  c.model.preset = "llama4_scout_17b_16e"
  c.model.param_dtype = "float32"
  c.model.dtype = "bfloat16"
  # Generator-side layout the plan tool compiles: bf16 weights, tensor-parallel over 8 devices,
  # a KV cache of 64 sequences x 16,384 tokens.
  c.generator.tensor_parallel = 8
  c.generator.decode_batch = 64
  c.layouts = topologies.layouts_to_config(LAYOUTS)
  c.topology = arg or DEFAULT_TOPOLOGY
  return topologies.apply_layout(c)
