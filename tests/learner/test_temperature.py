"""Sampling temperature on both sides (docs/LEARNER.md "Sampling temperature").

The JAX sampler draws at temperature T and records log_softmax(logits / T); the learner must compute
the same distribution, else every importance ratio is biased (PAPER_NOTES §5). On the first step of
a run (learner weights = generator weights) the IS ratios are then 1 and KL(gen‖learner) ~ 0.
The rollouts take the real path: JaxSampler -> Rollout messages -> batch_to_arrays -> Learner.step.
A learner left at T = 1 (the code before the fix) is run on the same batch as the reference of what
the bias looks like.
"""
import jax
import jax.numpy as jnp
import numpy as np

from configs import tiny
from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.learner import Learner
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.client import Batch, batch_to_arrays
from scalerl_jax.types import PromptSpec, SamplingSpec

CFG = models.get_preset("tiny_llama3", num_layers=1, vocab_size=64)
T = 0.7


def apply_fn(params, tokens, positions):
  return models.forward(params, CFG, tokens, positions)


def _first_step_batch(params, temperature):
  """One step's batch (8 prompts x 4 samples, 32 tokens each) sampled at `temperature`."""
  rng = np.random.default_rng(0)
  prompts = [PromptSpec(i, rng.integers(1, CFG.vocab_size, 6).astype(np.int32), "")
             for i in range(8)]
  spec = SamplingSpec(temperature=temperature, think_budget_min=0, think_budget_max=0,
                      answer_budget=32, seed=3)
  groups = JaxSampler(CFG, params, version=0, chunk_steps=32).generate(prompts, 4, spec)
  msgs = []
  for gid, (p, group) in enumerate(zip(prompts, groups)):
    rollouts = [codec.completion_to_rollout(c, group_id=gid, sample_index=i, prompt_tokens=p.tokens,
                                            generator_id="gen-0", rewards=(float(i % 2),))
                for i, c in enumerate(group)]
    msgs.append(pb.Group(group_id=gid, prompt_id=p.prompt_id, rollouts=rollouts))
  return batch_to_arrays(Batch(0, msgs, pb.BatchSummary()))


def _first_step_metrics(params, batch, **kw):
  config = tiny.get_config()
  config.generator.temperature = T
  learner = Learner.for_run(apply_fn, jax.tree.map(jnp.array, params),
                            common.RunConfig.from_config(config), vocab_size=CFG.vocab_size, **kw)
  return learner.step(batch)


def test_learner_logprobs_at_the_generator_temperature():
  params = models.init_params(CFG, jax.random.PRNGKey(0))
  batch = _first_step_batch(params, T)
  assert batch["loss_mask"].sum() == 8 * 4 * 32
  fixed = _first_step_metrics(params, batch)                      # T from config.generator
  old = _first_step_metrics(params, batch, temperature=1.0)       # the learner before the fix
  print(f"\n[T={T}] learner at T: IS ratio mean {fixed['is_ratio_mean']:.7f} max "
        f"{fixed['is_ratio_max']:.7f} k3 {fixed['kl_k3']:.2e}; learner at 1 (old): ratio mean "
        f"{old['is_ratio_mean']:.5f} max {old['is_ratio_max']:.4f} k3 {old['kl_k3']:.2e}")
  assert abs(fixed["is_ratio_mean"] - 1.0) < 1e-3 and fixed["kl_k3"] < 1e-6
  assert abs(fixed["is_ratio_max"] - 1.0) < 1e-3
  # The bias it removes. E_gen[π_learner / π_gen] = 1 for any two full-support distributions, so
  # the old learner's ratio *mean* stays near 1 (0.9991 here); its KL and ratio spread do not.
  assert old["kl_k3"] > 1e-3 and old["is_ratio_max"] > 1.2
