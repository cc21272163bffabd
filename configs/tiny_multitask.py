"""Tiny CPU multitask config: the digit-sum task and the tiny code task mixed 50/50 (configs/tiny.py's
model and recipe, one word-level vocabulary of 39 words for both tasks).

Run:
  python -m scalerl_jax.main --config=configs/tiny_multitask.py --workdir=/tmp/scalerl_multitask

Tasks (docs/DATA.md "Mixtures", "The tiny code task"):
  math  the digit-sum task (kind=synthetic, exact-match verifier), 64 held-out prompts
  code  the tiny code task (kind=tiny_code): the model writes `print ( 3 + 7 * 2 ... )`, which runs
        in the bubblewrap sandbox and must print the expression's value; 32 held-out prompts
Each step leases ~half of its 8 prompts from each task; evaluation logs `val_pass_rate` (all
held-out samples) and `val_pass_rate/math`, `val_pass_rate/code`; the end-of-run fit
(WORKDIR/fit/) fits Eq. 1 to each of them, side by side in curves.png. Generators log every grade
to WORKDIR/logs/rewards-gen-<i>.jsonl (reason, sandboxed).
"""
from scalerl_jax import config as common
from configs import tiny


def get_config(arg=None):
  del arg
  c = tiny.get_config()
  c.model.vocab_size = 40          # 39 words (data/tiny_code.py VOCAB) padded to 40
  c.rollout.answer_budget = 20     # the program: print ( 6 digits, 5 operators ) <eos> = 15 tokens
  c.eval.every_steps = 15
  c.data.tasks.math = common.task_section(
      "synthetic", heldout=64, synthetic_n_train=4096, synthetic_step_noise=0.2)
  c.data.tasks.code = common.task_section(
      "tiny_code", heldout=32, synthetic_n_train=4096, synthetic_num_terms=6,
      synthetic_step_noise=0.2)
  c.data.mixture = "math:0.5,code:0.5"
  return c
