"""The start-up log-prob parity gate (issue #17) on real log-probs: a generator sampling with the
learner's weights passes; one given other weights (what a broken vLLM weight update looks like)
fails with a clear message. The generator here is the JAX sampler: this machine has no vLLM venv;
tests/vllm/test_vllm_worker.py holds the engine-side numbers the thresholds come from."""
import jax
import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.training.health import ParityError, parity_check
from scalerl_jax.training.trainer import learner_token_logprobs
from scalerl_jax.types import PromptSpec, SamplingSpec


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("forecast_parity")


@pytest.fixture(scope="module")
def batch():
  cfg = models.get_preset("tiny_llama3", vocab_size=64, num_layers=2, d_model=128, ffn_dim=256,
                          dtype="float32")
  right = models.init_params(cfg, jax.random.PRNGKey(0))
  wrong = models.init_params(cfg, jax.random.PRNGKey(1))
  prompts = [PromptSpec(i, np.array([1, 7 + i, 8, 9], np.int32)) for i in range(2)]
  spec = SamplingSpec(temperature=1.0, think_budget_min=12, think_budget_max=12, answer_budget=0, seed=3)
  groups = JaxSampler(cfg, right, version=0).generate(prompts, 4, spec)
  rows = [(p.tokens, c) for p, g in zip(prompts, groups) for c in g]
  T = max(len(p) + len(c.tokens) for p, c in rows)
  tokens = np.zeros((len(rows), T), np.int32)
  gen_lp = np.zeros((len(rows), T), np.float32)
  mask = np.zeros((len(rows), T), bool)
  for i, (p, c) in enumerate(rows):
    tokens[i, :len(p)], tokens[i, len(p):len(p) + len(c.tokens)] = p, c.tokens
    gen_lp[i, len(p):len(p) + len(c.tokens)] = c.logprobs
    mask[i, len(p):len(p) + len(c.tokens)] = c.policy_mask
  return cfg, right, wrong, tokens, gen_lp, mask


def test_learner_logprobs_match_the_sampler_on_its_own_tokens(batch):
  cfg, right, _, tokens, gen_lp, mask = batch
  lp = learner_token_logprobs(cfg, right, tokens)
  np.testing.assert_allclose(lp[mask], gen_lp[mask], atol=2e-5)
  assert mask.sum() >= 40


def test_gate_passes_with_the_right_weights(batch):
  cfg, right, _, tokens, gen_lp, mask = batch
  out = parity_check(learner_token_logprobs(cfg, right, tokens), gen_lp, mask, common.base_config().health,
                     version=0, startup=True)
  assert out["health/parity_alarm"] == 0 and out["health/parity_mean_abs"] < 1e-4
  assert out["health/parity_tokens"] == int(mask.sum())


def test_gate_fails_at_startup_with_the_wrong_weights(batch):
  cfg, _, wrong, tokens, gen_lp, mask = batch
  lp = learner_token_logprobs(cfg, wrong, tokens)
  ref = np.abs(lp[mask] - gen_lp[mask]).mean()
  assert ref > 0.1                                    # independent: the raw mismatch, >> the 0.03 limit
  with pytest.raises(ParityError, match=r"parity gate failed at weight version 0: .* mean \|delta log-prob\|"):
    parity_check(lp, gen_lp, mask, common.base_config().health, version=0, startup=True)
  later = parity_check(lp, gen_lp, mask, common.base_config().health, version=50, startup=False)
  assert later["health/parity_alarm"] == 1 and later["health/parity_mean_abs"] == pytest.approx(ref, rel=1e-5)
