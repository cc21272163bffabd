"""Llama-4 Scout 17B x 16E MoE at the paper's ScaleRL settings, with a learner layout per target.

Run (the arg after the colon picks the learner topology; default gb200_32):
  python -m scalerl_jax.main --config=configs/scout.py:gb200_32 --config.model.hf_checkpoint=/ckpt/scout --workdir=gs://bucket/run
Plan the memory of the real-size train step ahead of time (no accelerator needed):
  python -m scalerl_jax.tools.plan --config=configs/scout.py --topology=gb200_32

Paper settings as configs/8b.py (768 sequences of <= 16,384 tokens, AdamW 5e-7 / 1e-15 / 0.01 /
100 warm-up, PipelineRL-8, CISPO eps_max 5). The text decoder has 107.8e9 parameters: fp32 params +
fp32 Adam moments are 12 B/param (81 GB/device on 16 devices) and the learner step adds ~3x the
fp32 parameter bytes of gradient temporaries (another 81 GB on 16). With sequence parallelism
(one 16k sequence per micro-batch, split over fsdp) the activations are ~29 GB, so 16 GB200
(186 GB) need 191 GB: it does NOT fit; 32 GB200 (101 GB), 64 TPU v5p (57 GB) or 64 H100 (55 GB) do
(docs/SCALE.md). Every parameter is sharded over fsdp x tensor (expert axis 1: with
`moe_impl='dense'` the router / attention / shared-expert weights would be replicated over an
expert axis). Default topology: gb200_32.
"""

from configs import common

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
  return common.scale_out_config("llama4_scout_17b_16e", LAYOUTS, arg or DEFAULT_TOPOLOGY)
