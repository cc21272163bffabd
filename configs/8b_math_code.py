"""The paper's math+code run (PAPER_NOTES §2, Table 1 "math+code" rows): the 8B ScaleRL settings of
configs/8b.py on Polaris-53K math and DeepCoder code, half the prompts each.

Run (the arg after the colon picks the learner topology; data paths and the tokenizer directory
are the ones to set):
  python -m scalerl_jax.main --config=configs/8b_math_code.py:h100_16 \\
      --config.model.hf_checkpoint=/ckpt/llama8b \\
      --config.data.tasks.math.path=/data/polaris.parquet \\
      --config.data.tasks.code.path=/data/deepcoder.jsonl \\
      --config.data.tasks.math.tokenizer_path=/ckpt/llama8b \\
      --config.data.tasks.code.tokenizer_path=/ckpt/llama8b --workdir=gs://bucket/run

Held-out: 1,000 prompts per task, each evaluated mean@16 (`val_pass_rate/math`,
`val_pass_rate/code` beside the overall `val_pass_rate`); `analysis.fit RUN --per-task` fits one
Eq. 1 curve per task (the paper: math A 0.595 B 2.05, code A 0.615 B 1.09). Code rewards run only in
the bubblewrap sandbox (docs/SANDBOX.md); the job refuses to start without it.
"""
import importlib

from scalerl_jax import config as common

_8B = importlib.import_module("configs.8b")
DEFAULT_TOPOLOGY = _8B.DEFAULT_TOPOLOGY
LAYOUTS = _8B.LAYOUTS


def get_config(arg=None):
  c = _8B.get_config(arg)
  c.data.tasks.math = common.task_section("polaris", heldout=1000)
  c.data.tasks.code = common.task_section("deepcoder", heldout=1000)
  c.data.mixture = "math:0.5,code:0.5"
  return c
