"""Llama-3.1-8B-shaped dense model at the paper's ScaleRL settings, with a learner layout per target.

Run (the arg after the colon picks the learner topology; default h100_16):
  python -m scalerl_jax.main --config=configs/8b.py:h100_16 --config.model.hf_checkpoint=/ckpt/llama8b --workdir=gs://bucket/run
Plan the memory of the real-size train step ahead of time (no accelerator needed):
  python -m scalerl_jax.tools.plan --config=configs/8b.py --topology=h100_16

Paper settings (PAPER_NOTES §4; base_config defaults, asserted by tests/config/test_presets.py): 48 prompts
x 16 generations = 768 sequences, thinking budget drawn in [10240, 12288] then the interruption
phrase and <= 2048 answer tokens, prompt <= 2048 (so <= 16,384 tokens a sequence), AdamW lr 5e-7,
eps 1e-15, wd 0.01, 100 warm-up steps, PipelineRL-8, CISPO eps_max 5, FP32 LM head.

Learner state: fp32 params + fp32 Adam moments (16 B/param incl. the fp32 gradient: 128 GB total),
bf16 compute, scanned layers, remat per layout as the memory plan chooses (below). The model's attention materialises the [T, T] scores, so
heads are split over `tensor` to keep a 16k-token sequence's scores small; each micro-batch holds
ONE sequence per (data x fsdp) shard. Measured results: docs/SCALE.md.
"""

from scalerl_jax import config as common

DEFAULT_TOPOLOGY = "h100_16"

# mesh over (data, fsdp, tensor, expert); microbatches = 768 / (data * fsdp): one 16k sequence per
# batch shard per micro-batch.
# remat: the cheapest policy whose AOT plan fits (`python -m scalerl_jax.tools.plan
# --choose_remat`, tries none -> dots -> full; peak GB/device at 16,448 tokens, 2026-12-04):
# h100_16 none 37.0 / 72; h100_16_fsdp full 31.1 (none 203, dots 119); tpu_v5p_16 none 60.3 / 90.3;
# tpu_v5p_64 none 51.1; gb200_16 none 60.3 / 167.4 (docs/SCALE.md "Remat by the plan").
LAYOUTS = {
    "h100_16": dict(mesh=(("data", 1), ("fsdp", 2), ("tensor", 8), ("expert", 1)),
                    microbatches=384, remat="none", scan_layers=True,
                    note="tensor = the 8 NVLink GPUs of a node, fsdp across the 2 nodes"),
    # No tensor parallelism: with flash (blockwise / cuDNN) attention and the chunked LM head a
    # 16k sequence no longer needs its heads split; one sequence per device per micro-batch.
    "h100_16_fsdp": dict(topology="h100_16",
                         mesh=(("data", 1), ("fsdp", 16), ("tensor", 1), ("expert", 1)),
                         microbatches=48, remat="full", scan_layers=True,
                         note="pure FSDP over both nodes"),
    "tpu_v5p_16": dict(mesh=(("data", 1), ("fsdp", 4), ("tensor", 4), ("expert", 1)),
                       microbatches=192, remat="none", scan_layers=True),
    "tpu_v5p_64": dict(mesh=(("data", 1), ("fsdp", 16), ("tensor", 4), ("expert", 1)),
                       microbatches=48, remat="none", scan_layers=True),
    "gb200_16": dict(mesh=(("data", 1), ("fsdp", 4), ("tensor", 4), ("expert", 1)),
                     microbatches=192, remat="none", scan_layers=True),
}


def get_config(arg=None):
  return common.scale_out_config("llama3_8b", LAYOUTS, arg or DEFAULT_TOPOLOGY)
