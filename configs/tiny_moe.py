"""Tiny CPU MoE config: a Llama-4-style MoE (4 experts, top-1, a shared expert, every layer MoE,
NoPE every 4th layer, QK-norm) on configs/tiny.py's synthetic digit-sum task.

Run:
  python -m scalerl_jax.main --config=configs/tiny_moe.py --workdir=/tmp/scalerl_tiny_moe

What it is for: routing replay (R3) and the router-agreement metric `router_disagree` on a model
that ships with the project. The base policy is its own SFT warm start (config.sft, cached in
WORKDIR/base_policy, built the way configs/tiny.py's is: no download). The JAX generator records
every token's routes (rl.record_routes), R3 is on by default (recipes.resolve_routing_replay;
`--config.recipe=scalerl+no_r3` turns it off) and the weights cross the wire in bf16
(weights.wire_dtype), so the generator's router sees bf16-rounded weights while the learner's
sees the fp32 masters: the engine mismatch R3 removes from the expert choice.

The leave-one-out of docs/LEARNER.md "Router agreement" (R3 on/off, token band on/off):
  python -m scalerl_jax.compare --config=configs/tiny_moe.py \
      --recipes=scalerl,scalerl+no_r3,scalerl+token_band,scalerl+no_r3+token_band --workdir=runs/moe
"""
from configs import tiny


def get_config(arg=None):
  if arg not in (None, ""):
    raise ValueError(f"configs/tiny_moe.py takes no argument, got {arg!r}")
  c = tiny.get_config()
  c.total_steps = 120
  c.eval.every_steps = 8
  c.eval.num_prompts = 32            # 32 held-out prompts x 8 samples: a quarter of tiny.py's
  c.eval.samples_per_prompt = 8      #   evaluation cost (the MoE forward is ~2x the dense one)
  c.model.preset = "tiny_llama4"
  c.model.num_experts = 4
  c.model.num_experts_per_tok = 1
  c.model.expert_ffn_dim = 192       # routed experts and the shared expert
  c.model.interleave_moe_layer_step = 1   # every layer MoE (as Scout): 4 (token, layer) pairs a token
  c.model.no_rope_layer_interval = 4      # iRoPE: layer 4 is NoPE
  # Chunked attention on the RoPE layers, with chunks as long as the positions: the ~40-90 token
  # rows never cross a chunk (chunks of 32 cut the digit sum off the thinking it needs).
  c.model.attention_chunk_size = 256
  # A quarter of tiny.py's SFT examples (150 clean + 150 noisy steps of 32): the MoE step costs
  # more than the dense one and the base only needs a pass rate RL can raise.
  c.sft.clean_steps = 150
  c.sft.steps = 150
  c.sft.batch_size = 32
  c.weights.wire_dtype = "bfloat16"  # the generator's weights are bf16-rounded fp32 masters
  c.rl.record_routes = True          # the generator records routes also without replay
  return c
