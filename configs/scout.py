"""Llama-4 Scout 17B x 16E MoE at the paper's ScaleRL settings, with a learner layout per target.

Run (the arg after the colon picks the learner topology; default gb200_32):
  python -m scalerl_jax.main --config=configs/scout.py:gb200_32 --config.model.hf_checkpoint=/ckpt/scout --workdir=gs://bucket/run
Plan the memory of the real-size train step ahead of time (no accelerator needed):
  python -m scalerl_jax.tools.plan --config=configs/scout.py --topology=gb200_32

Paper settings as configs/8b.py (768 sequences of <= 16,384 tokens, AdamW 5e-7 / 1e-15 / 0.01 /
100 warm-up, PipelineRL-8, CISPO eps_max 5). The text decoder has 107.8e9 parameters: fp32 params +
fp32 Adam moments are 12 B/param (81 GB/device on 16 devices) and the learner step adds ~3x the
fp32 parameter bytes of gradient temporaries (another 81 GB on 16).

MoE: every layout runs the expert-parallel dispatch (models/moe.py) with capacity factor 2.0
(GShard buffers, 2x the routed expert's active FLOPs; copies past capacity are dropped and counted
in the learner metric `moe_dropped`); set model.moe_capacity_factor=0 for the dropless mode.
gb200_16 uses expert 16 (one expert per GPU; the expert axis is also the FSDP axis of every other
weight and splits each sequence 16 ways): with the blockwise attention and the sliced AdamW it
plans 149.1 GB/device against 167.4 usable (dense MoE on fsdp 4 x tensor 4, before the sliced
AdamW: 166.3 GB at 4.25x the FLOPs; docs/SCALE.md).
Default topology: gb200_32.
"""

from scalerl_jax import config as common

DEFAULT_TOPOLOGY = "gb200_32"

# Sequence-parallel layouts (topologies.SEQUENCE_PARALLEL): micro-batch = ONE 16k sequence split
# over fsdp x expert (T/(fsdp*expert) query positions a device), heads / mlp / vocab over tensor;
# 768 micro-batches.
_SP = dict(microbatches=768, remat="full", scan_layers=True, sequence_parallel=True,
           moe_capacity_factor=2.0)
LAYOUTS = {
    # expert 16: one expert per GPU; tokens and non-expert weights over the same 16 ways.
    # remat by the plan (tools.plan --choose_remat, 16,448 tokens): none 213.1 GB does not fit,
    # "dots" 155.7 of 167.4 fits at +12.4 % FLOPs (full: +1 forward). Other layouts: full, not
    # re-planned (a Scout plan compiles ~100 s per policy).
    "gb200_16": dict(mesh=(("data", 1), ("fsdp", 1), ("tensor", 1), ("expert", 16)),
                     **dict(_SP, remat="dots"),
                     note="the paper's 16 trainer GPUs: 155.7 of 167.4 GB (docs/SCALE.md)"),
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
  config = common.scale_out_config("llama4_scout_17b_16e", LAYOUTS, arg or DEFAULT_TOPOLOGY)
  # A generator pod holds its versions (215.5 GB bf16 each) + the weight relay's copy of one
  # (weights/relay.py): with two held versions that is 942 GiB, above the a4x node's 800 GiB
  # share for 4 GPUs (launch.preflight). One held version (versions an evaluation pins are kept
  # regardless, generation/eval_lane.py) fits.
  config.generator.eval_hold_versions = 1
  return config
