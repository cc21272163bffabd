"""Tiny CPU config: a ~0.8M-parameter Llama on the synthetic digit-sum task; the demo and CI default.

Run:
  python -m scalerl_jax.main --config=configs/tiny.py --workdir=/tmp/scalerl_tiny

The full ScaleRL recipe (PipelineRL-8, CISPO, prompt aggregation, batch advantage normalization,
zero-variance filtering, No-Positive-Resampling, forced interruptions, FP32 head) at toy sizes:
8 prompts x 8 generations per step, thinking budget 24-32 tokens then the interruption phrase,
8 answer tokens. The base policy comes from a short SFT warm start on noisy traces (cached in
WORKDIR/base_policy). head_dim is 64 so vLLM can serve the same model (generator.backend=vllm).

`--config=configs/tiny.py:tailed`: the length-tailed workload (issue #25): thinking budgets drawn
in [8, 96] tokens (a 1:12 spread, like the paper's 1k-12k) instead of [24, 32]. The policy's own
thinking stays ~8 tokens (one per digit), so only the budgets below 8 shorten samples.

`--config=configs/tiny.py:lengths`: the lengths themselves spread 1:12 (2026-12-05, commit 12db277, 2-core Intel Xeon): problems of
2-24 digits (thinking is one token per digit), written in 24 fixed slots (the unused ones `<unk>`,
data.synthetic_fixed_width) so that the tiny model learns them, with 4x the SFT steps (1500 + 900:
~9 min here; base pass rate ~0.20). Without the fixed slots, or with 600 SFT steps, the tiny model
stays at chance on them (NOTES.md of 2026-12-05 (2-core AMD EPYC)).

`--config=configs/tiny.py:demo` (what `make demo` runs): the defaults plus the freshness bound
`rollout.max_ahead=1` (recipes.SWITCHES["fresh"]): the generator fills at most one batch ahead, so
tokens train at lag 1 instead of 8 (issue #45: kl_k3 1-2 orders of magnitude lower and no mid-run
collapse over 5 seeds; docs/ROLLOUT.md "Demo stability"). A preset rather than the default because
~30 end-to-end tests build their admission schedules (resume, chaos, multi-host) on the plain
config's PipelineRL-8 (max_ahead=-1), which stays `--config=configs/tiny.py`.

The generator batches continuously by default (generator.continuous);
`--config.generator.continuous=False` runs the drain-per-lease loop on the same workload. With
`--config.eval.mode=fleet` the generator also runs the evaluations (through
generator.eval_decode_batch slots when continuous) and the lengths run is generator-bound: the
continuous generator ends it ~30 % sooner than the drain loop (docs/ROLLOUT.md, 2026-12-05, commit 7878542, 2-core Intel Xeon).
"""
from scalerl_jax import config as common


def get_config(arg=None):
  if arg not in (None, "", "tailed", "lengths", "demo"):
    raise ValueError(f"configs/tiny.py takes no argument, 'tailed', 'lengths' or 'demo', got {arg!r}")
  c = common.base_config()
  c.total_steps = 300
  c.model.preset = "tiny_llama3"
  c.model.vocab_size = 32          # the synthetic task's word-level vocabulary
  c.model.d_model = 128
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.model.ffn_dim = 384
  c.model.num_layers = 4
  c.model.max_position_embeddings = 256
  c.model.dtype = "float32"
  # An fp32 model end to end: generators compute with the exact fp32 masters (the vLLM parity
  # tests assert ~1e-6 per token); real-size configs push bf16 (base_config).
  c.weights.wire_dtype = "float32"
  c.model.scan_layers = False
  c.model.remat = "none"
  c.optim.lr = 3e-5
  c.learner.pad_multiple = 16      # rows of ~40-90 tokens (docs/SCALE.md "Padding")
  c.optim.warmup_steps = 5
  c.rollout.prompts_per_step = 8
  c.rollout.generations_per_prompt = 8
  c.rollout.think_budget_min = 24
  c.rollout.think_budget_max = 32
  c.rollout.answer_budget = 8
  c.rollout.max_prompt_len = 32
  c.pin_cpus = True        # learner on CPU 0, the generator on CPU 1: one "device" per role
  c.generator.backend = "jax"
  c.generator.num_workers = 1
  # --config.generator.backend=vllm: an eager engine. torch.compile of this 0.8M model costs
  # ~70 s (tens of CPU-s) per engine start on 2 cores, more than its decoding saves in a demo run.
  c.generator.vllm_args.enforce_eager = True
  c.eval.every_steps = 10
  c.eval.samples_per_prompt = 16
  # Learner-local evaluation: 64 prompts x 16 samples of a 0.8M model are cheap on the learner, and
  # the demo's curve keeps its recorded numbers; --config.eval.mode=fleet runs the same
  # evaluation on the one JAX generator through the buffer's evaluation lane.
  c.eval.mode = "local"
  c.data.kind = "synthetic"
  c.data.heldout = 64
  c.data.synthetic_n_train = 4096
  c.data.synthetic_step_noise = 0.2   # noisy SFT traces: base pass rate ~0.22 at temperature 1
  c.sft.clean_steps = 300
  c.sft.steps = 300
  c.sft.lr = 1e-3
  c.sft.num_examples = 4096
  c.checkpoint.every_steps = 50
  if arg == "tailed":
    c.rollout.think_budget_min = 8
    c.rollout.think_budget_max = 96
  if arg == "lengths":
    c.data.synthetic_num_terms = 2
    c.data.synthetic_num_terms_max = 24
    c.data.synthetic_fixed_width = True
    c.rollout.think_budget_min = 26        # every problem's thinking fits (24 digits, </think>)
    c.rollout.think_budget_max = 32
    c.sft.steps = 1500
    c.sft.clean_steps = 900
  if arg == "demo":   # `make demo` (issue #45): = recipes.SWITCHES["fresh"] (tests/config/test_recipes.py)
    c.rollout.max_ahead = 1
  return c
