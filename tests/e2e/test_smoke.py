"""The whole loop in a handful of steps: buffer + generator process + learner + evaluator.

Asserts real properties of the run (issue 6): the compute axis strictly increases, no token is
older than k, zero-variance groups were dropped, over-budget samples were interrupted and their
injected tokens carry no loss weight, and validation never used a training prompt.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from scalerl_jax import config as run_config
from scalerl_jax.data import synthetic
from scalerl_jax.protocol import rollout_pb2 as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K = 2


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("e2e_smoke")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  wd = tmp_path_factory.mktemp("smoke")
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py", f"--workdir={wd}",
         "--config.total_steps=6", "--config.sft.clean_steps=20", "--config.sft.steps=10",
         "--config.eval.every_steps=2",
         "--config.eval.samples_per_prompt=2", "--config.data.heldout=16",
         f"--config.rollout.max_lag={K}", "--config.debug_dump_every=1",
         # Gold thinking is 8 tokens: a 3-5 token budget forces interruptions.
         "--config.rollout.think_budget_min=3", "--config.rollout.think_budget_max=5"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  return wd


def _lines(wd):
  return [json.loads(l) for l in open(os.path.join(wd, "metrics.jsonl"))]


def test_compute_axis_strictly_increases(run_dir):
  lines = _lines(run_dir)
  train = [l for l in lines if l["kind"] == "train"]
  assert [l["step"] for l in train] == list(range(1, 7))
  c = [l["compute_hours"] for l in lines]
  assert c[0] == pytest.approx(0.0, abs=1e-4)          # R0 at compute 0
  assert all(b > a for a, b in zip(c, c[1:])), c
  evals = [l for l in lines if l["kind"] == "eval"]
  assert [l["step"] for l in evals] == [0, 2, 4, 6]
  # Each pass rate is a mean over heldout x samples = 16 x 2 Bernoulli draws: a multiple of 1/32.
  for l in evals:
    k = round(l["val_pass_rate"] * 32)
    assert 0 <= k <= 32 and l["val_pass_rate"] == pytest.approx(k / 32, abs=1e-9)


def test_token_lag_at_most_k(run_dir):
  for l in _lines(run_dir):
    if l["kind"] == "train":
      assert 0 <= l["max_lag"] <= K
      assert sum(l["lag_hist"]) > 0 and len(l["lag_hist"]) <= K + 1


def _zero_variance_groups(batch):
  """Prompt groups of a dumped batch whose rewards are all equal (what the filter must drop)."""
  pids, rewards = batch["prompt_ids"], np.asarray(batch["rewards"]).reshape(len(batch["prompt_ids"]), -1)[:, 0]
  groups = sorted({int(p) for p in pids if p >= 0})
  return sum(int(np.ptp(rewards[pids == p]) == 0) for p in groups), len(groups)


def test_zero_variance_groups_dropped(run_dir):
  """Every step drops exactly the groups of its batch whose rewards are all equal, and a step with
  no group left is skipped (holds on any trajectory: the count is recomputed from the dumped batch,
  not hoped to be > 0)."""
  train = {l["step"]: l for l in _lines(run_dir) if l["kind"] == "train"}
  print("\n[zero-variance] step: (dropped of 8, skipped)",
        {s: (l["dropped_groups"], l["skipped"]) for s, l in train.items()})
  for s, l in train.items():
    want, n = _zero_variance_groups(np.load(os.path.join(run_dir, "batches", f"step_{s - 1:06d}.npz")))
    assert n == 8 and l["dropped_groups"] == want, (s, l["dropped_groups"], want)
    assert l["skipped"] == (want == n), (s, l["skipped"], want)


def test_interrupted_tokens_have_zero_loss_weight(run_dir):
  interrupt = synthetic.TOKENIZER.interruption_ids
  n_interrupted = 0
  for f in sorted(os.listdir(os.path.join(run_dir, "batches"))):
    b = np.load(os.path.join(run_dir, "batches", f))
    for i in np.flatnonzero(b["finish_reason"] == pb.FINISH_INTERRUPTED):
      toks, mask = b["tokens"][i], b["loss_mask"][i]
      starts = [j for j in range(len(toks) - len(interrupt) + 1)
                if list(toks[j:j + len(interrupt)]) == list(interrupt)]
      assert starts, "interrupted sample without the interruption phrase"
      j = starts[-1]
      assert not mask[j:j + len(interrupt)].any()           # injected tokens: no loss weight
      assert mask[j - 1] or mask[j + len(interrupt)]       # policy tokens around it do count
      n_interrupted += 1
  assert n_interrupted > 0


def test_ledger_counts_every_processed_token(run_dir):
  """Each train line's FLOPs grow by 6N (learner) and 2N (generators) per real token of the dumped
  batch: prompts, injected tokens and zero-variance-filtered groups included, padding not
  (docs/COMPUTE.md "What the FLOPs count"); the loss-token FLOPs are the smaller useful part."""
  from scalerl_jax.models import sections as model_sections
  from scalerl_jax.tools.describe import count_params
  config = run_config.resolve_config(os.path.join(run_dir, "config.json"))
  n = float(count_params(model_sections.model_config(config))["params_active"])
  lines = _lines(run_dir)
  train = {l["step"]: l for l in lines if l["kind"] == "train"}
  prev = {k: 0.0 for k in ("train_flops", "gen_flops", "train_loss_flops", "train_pad_flops")}
  injected = 0
  for step in range(1, 7):
    b = np.load(os.path.join(run_dir, "batches", f"step_{step - 1:06d}.npz"))
    real = int(b["prompt_lengths"].sum() + b["completion_lengths"].sum())
    injected += int(b["completion_lengths"].sum() - b["loss_mask"].sum())
    assert 0 < real < b["tokens"].size                         # the batch is padded
    l = train[step]
    assert l["train_flops"] - prev["train_flops"] == pytest.approx(6 * n * real, rel=1e-9)
    assert l["gen_flops"] - prev["gen_flops"] == pytest.approx(2 * n * real, rel=1e-9)
    assert l["train_loss_flops"] - prev["train_loss_flops"] == pytest.approx(6 * n * l["tokens"],
                                                                             rel=1e-9)
    assert l["train_pad_flops"] - prev["train_pad_flops"] == pytest.approx(
        6 * n * (b["tokens"].size - real), rel=1e-9)
    assert l["train_loss_flops"] < l["train_flops"]
    prev = l
  assert injected > 0          # interrupted samples' injected tokens were in the count


def test_validation_never_saw_a_training_prompt(run_dir):
  held = {tuple(p.prompt_tokens) for p in synthetic.make_split(0, 0, 16)[1]}
  trained = set()
  for f in os.listdir(os.path.join(run_dir, "batches")):
    b = np.load(os.path.join(run_dir, "batches", f))
    for row, m in zip(b["tokens"], b["loss_mask"]):
      trained.add(tuple(row[:int(np.argmax(m))]))           # the prompt precedes the first loss token
  assert trained and not (trained & held)
  train_file = [json.loads(l) for l in open(os.path.join(run_dir, "train_prompts.jsonl"))]
  assert not ({tuple(p["tokens"]) for p in train_file} & held)


def test_outputs_exist(run_dir):
  for name in ("config.json", "metrics.jsonl", "tb", "base_policy/config.json"):
    assert os.path.exists(os.path.join(run_dir, name)), name


def test_checkpoint_restores_final_params(run_dir):
  """The last orbax checkpoint holds the final state: its params equal the exported final policy
  bit for bit, its update count is the steps not skipped, and its params differ from the SFT base
  policy exactly when an update was applied."""
  import jax
  from scalerl_jax import models
  from scalerl_jax.training.checkpoint import RunCheckpointer
  from scalerl_jax.learner import LearnerState, make_optimizer
  from scalerl_jax.models import sections as model_sections
  config = run_config.resolve_config(os.path.join(run_dir, "config.json"))
  cfg = model_sections.model_config(config)
  params = models.init_params(cfg, jax.random.PRNGKey(1))
  abstract = jax.eval_shape(lambda p: LearnerState.create(p, make_optimizer(config.optim)), params)
  ck = RunCheckpointer(str(run_dir))
  assert ck.latest_step() == 6
  state, meta = ck.restore(abstract)
  train = [l for l in _lines(run_dir) if l["kind"] == "train"]
  applied = 6 - sum(int(l["skipped"]) for l in train)     # a step whose groups all dropped is skipped
  assert int(state.step) == applied and meta["step"] == 6
  assert meta["ledger"]["train_seconds"] > 0 and isinstance(meta["npr"], dict)
  assert meta["last_eval"]["step"] == 6
  _, final = models.load_hf(os.path.join(run_dir, "final_policy"))
  _, base = models.load_hf(os.path.join(run_dir, "base_policy"))
  got = jax.tree.map(np.asarray, state.params)
  assert jax.tree.structure(got) == jax.tree.structure(final)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(final)):   # bit for bit
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))
  moved = [float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(base))]
  assert (max(moved) > 0) == (applied > 0), (moved, applied)   # training moved them iff it updated


def test_ppo_off_policy_rounds(tmp_path):
  """PPO-off-policy-k: one big batch per version, then k learner steps on it (lags 0..k-1), and
  the generator picks up the next round's weights (a regression: it once waited forever)."""
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.rollout.mode=ppo_off_policy",
         "--config.rollout.max_lag=2", "--config.total_steps=4", "--config.sft.clean_steps=20",
         "--config.sft.steps=10", "--config.eval.every_steps=100",
         "--config.eval.samples_per_prompt=1", "--config.data.heldout=8"]
  r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stderr[-4000:]
  train = [l for l in _lines(tmp_path) if l["kind"] == "train"]
  assert [l["max_lag"] for l in train] == [0, 1, 0, 1]     # two rounds: the second one's weights
