"""Issue 24: an instruct model under the prompt templates, in a real miniature run (main: buffer +
generator process + learner), with a Llama-3-style tokenizer and chat template.

The "instruct model" is the scripted generator (generator.backend=scripted, generation/fake.py):
deterministic, it answers in the format the prompt asks for (pre-filled `<think>` -> closes it with
`</think>` and boxes the answer; asked for \\boxed{} -> boxes it) and otherwise ends its turn at
<|eot_id|> with a plain sentence, as Llama-3.1-8B-Instruct does. Its even samples are right, its
odd ones off by one. Everything else is the real path: the template renders the prompts, the
worker grades with the `math` verifier under the template's `require_think_close`, the trainer's
step-0 reward check reads the first batch. The learner is a random-init tiny Llama (vocab 512).
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_instruct")]

OVERRIDES = [
    "--config.data.kind=polaris", "--config.data.heldout=4", "--config.generator.backend=scripted",
    "--config.model.vocab_size=512", "--config.model.max_position_embeddings=256",
    "--config.model.num_layers=1", "--config.model.d_model=64", "--config.model.num_heads=1",
    "--config.model.ffn_dim=128",
    "--config.rollout.max_prompt_len=96", "--config.rollout.think_budget_min=48",
    "--config.rollout.think_budget_max=64", "--config.rollout.answer_budget=32",
    "--config.eval.mode=fleet", "--config.eval.samples_per_prompt=2",
    "--config.total_steps=1", "--config.eval.every_steps=1", "--config.pin_cpus=False",
    "--config.forecast.enabled=False",
    "--config.health.step0_min_samples=64"]   # the batch is 8 x 8 (deterministic rewards here)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """The tokenizer, 36 arithmetic problems and a random-init base policy (WORKDIR/base_policy is
  what warm_start loads; an HF dataset ships no SFT traces)."""
  root = tmp_path_factory.mktemp("instruct")
  tok = write_llama3_style_tokenizer(str(root / "tok"), vocab_size=512)
  rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)}
          for a in range(3, 9) for b in range(11, 17)]
  data = root / "math.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return dict(root=root, tok=tok, data=str(data), base=_base_policy(str(root / "base_policy")))


def _base_policy(path):
  import jax
  from scalerl_jax import models
  from scalerl_jax.models import sections as model_sections
  from configs import tiny
  from scalerl_jax.config import apply_overrides
  c = tiny.get_config()
  apply_overrides(c, [o for o in OVERRIDES if o.startswith("--config.model.")])
  cfg = model_sections.model_config(c)
  models.save_hf(cfg, jax.device_get(models.init_params(cfg, jax.random.PRNGKey(0))), path)
  return path


def _run(setup, name, template):
  wd = setup["root"] / name
  args = OVERRIDES + [f"--config.data.path={setup['data']}",
                      f"--config.data.tokenizer_path={setup['tok']}",
                      f"--config.data.template={template}"]
  shutil.copytree(setup["base"], wd / "base_policy")
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={wd}"]
  r = subprocess.run(cmd + args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                     env={**os.environ, "PYTHONPATH": ROOT})
  lines = [json.loads(l) for l in open(wd / "metrics.jsonl")] if (wd / "metrics.jsonl").exists() else []
  grades = []
  for f in sorted(os.listdir(wd / "logs")) if (wd / "logs").exists() else []:
    if f.startswith("rewards-"):
      grades += [json.loads(l) for l in open(wd / "logs" / f)]
  return r, lines, grades


def test_reasoning_template_gets_rewards_at_step_0(setup):
  r, lines, grades = _run(setup, "reasoning", "reasoning_instruct")
  assert r.returncode == 0, r.stderr[-4000:]
  r0 = [l for l in lines if l["kind"] == "eval" and l["step"] == 0][0]
  assert r0["val_pass_rate"] == pytest.approx(0.5)      # 4 held-out prompts x 2: even samples right
  train = [l for l in lines if l["kind"] == "train"]
  assert [l["step"] for l in train] == [1]
  assert train[0]["mean_reward"] == pytest.approx(0.5)
  assert train[0]["health/step0_nonzero_frac"] == pytest.approx(0.5)
  assert train[0]["dropped_groups"] == 0                 # every group has reward variance
  assert not [l for l in lines if l["kind"] == "health_abort"]
  reasons = {g["reason"] for g in grades}
  assert reasons == {"pass", "wrong_answer"}, reasons    # every completion closed its thinking


def test_bare_template_stops_at_step_0_with_one_line(setup):
  r, lines, grades = _run(setup, "bare", "bare")
  assert r.returncode == 1, r.stderr[-4000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last == (
      "run stopped at step 0: 0 of 64 samples got a non-zero reward; 0 of them wrote `</think>`, "
      "which the verifier requires, and the template `bare` asks for none (64 ended their turn, "
      "0 were cut): set --config.data.template=reasoning_instruct (think prefix + answer "
      "instruction; or `instruct`: no `</think>` required) (health.step0_reward_check=False "
      "skips this check)"), last
  assert "Traceback" not in r.stderr
  r0 = [l for l in lines if l["kind"] == "eval" and l["step"] == 0][0]
  assert r0["val_pass_rate"] == 0.0
  assert not [l for l in lines if l["kind"] == "train"]
  abort, = [l for l in lines if l["kind"] == "health_abort"]
  assert abort["step"] == 0 and last.endswith(abort["reason"])
  assert grades and {g["reason"] for g in grades} == {"no_answer"}
