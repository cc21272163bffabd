"""Unit tests for scalerl_jax.generation.interruption (budgets, injected tokens, length penalty)."""
import threading

import numpy as np
import pytest

from scalerl_jax.generation import interruption as it
from scalerl_jax.generation.slots import DecodeStats
from scalerl_jax.types import SamplingSpec


def test_budget_uniform_within_range():
  lo, hi = 10, 19
  draws = np.array([it.think_budget(3, pid, j, lo, hi) for pid in range(2000) for j in range(10)])
  assert draws.min() == lo and draws.max() == hi            # both ends inclusive, nothing outside
  counts = np.bincount(draws - lo, minlength=hi - lo + 1)
  expected = len(draws) / (hi - lo + 1)
  chi2 = float(((counts - expected) ** 2 / expected).sum())
  assert chi2 < 27.9                                        # chi-square, 9 dof, p = 0.001


def test_budgets_paper_range_and_reproducible_per_sample():
  spec = SamplingSpec()
  b = np.array([it.think_budget(1, pid, 0, spec.think_budget_min, spec.think_budget_max)
                for pid in range(5000)])
  assert b.min() >= 10240 and b.max() <= 12288
  assert abs(b.mean() - (10240 + 12288) / 2) < 30
  # the same (seed, prompt, sample) gets the same budget; another sample or seed another one
  assert it.think_budget(7, 42, 3, 10, 10_000) == it.think_budget(7, 42, 3, 10, 10_000)
  assert len({it.think_budget(7, 42, j, 10, 10_000) for j in range(8)}) == 8
  assert it.think_budget(8, 42, 3, 10, 10_000) != it.think_budget(7, 42, 3, 10, 10_000)
  with pytest.raises(ValueError, match="think_budget_min <= think_budget_max"):
    it.think_budget(0, 0, 0, 5, 4)


def test_both_backends_draw_budgets_here():
  """The JAX sampler and the vLLM worker import the one budget function (no copies)."""
  from scalerl_jax.generation import sampler
  from scalerl_jax.generation.vllm import worker
  assert sampler.think_budget is it.think_budget and worker.think_budget is it.think_budget


@pytest.mark.parametrize("length,expected", [
    (0, 0.0), (12288, 0.0),              # up to L_max - L_cache: no penalty
    (12289, -1 / 2048), (13312, -0.5),   # linear ramp
    (14336, -1.0), (20000, -1.0),        # at and beyond L_max: clipped at -1
])
def test_length_penalty_boundaries(length, expected):
  assert it.length_penalty(length) == pytest.approx(expected, abs=1e-12)


def test_apply_length_penalty_only_on_correct():
  assert it.apply_length_penalty(1.0, 13312, True) == pytest.approx(0.5)
  assert it.apply_length_penalty(0.0, 13312, False) == 0.0
  assert it.apply_length_penalty(1.0, 100, True) == 1.0
  r = it.apply_length_penalty(np.array([1.0, 1.0, 0.0]), np.array([14336, 12288, 14336]),
                              np.array([True, True, False]))
  np.testing.assert_allclose(r, [0.0, 1.0, 0.0])
  with pytest.raises(ValueError):
    it.length_penalty(10, l_max=100, l_cache=0)


def test_worker_reward_applies_the_length_penalty_to_correct_completions_only():
  """generator.Worker.rewards with rl.length_control=penalty: the grade's own correctness decides
  (it passed rl.length_penalty_max as `correct` and the cache as L_max: every call raised)."""
  import dataclasses
  import types
  from configs import tiny
  from scalerl_jax import config as common
  from scalerl_jax.data import build_dataset, synthetic as syn
  from scalerl_jax.generation.worker import Worker
  c = tiny.get_config()
  c.rl.length_control, c.rl.length_penalty_max, c.rl.length_penalty_cache = "penalty", 16, 4
  run = common.RunConfig.from_config(c)
  ds = build_dataset(run.data, run.rollout.max_prompt_len)
  p = ds.heldout[0]
  terms = tuple(int(t) for t in ds.tokenizer.decode(p.tokens[2:-2]).split())
  gold = ds.tokenizer.encode(syn.Problem(p.prompt_id, terms).gold_completion_text)
  wrong = list(gold)
  wrong[-2] = ds.tokenizer.encode(str((int(p.answer) + 1) % 10))[0]    # the answer digit
  me = types.SimpleNamespace(config=run, dataset=ds, id="g", gen=types.SimpleNamespace(version=0),
                             _count_lock=threading.Lock(), decode_stats=DecodeStats())
  assert len(gold) == 11                         # 8 digits + </think> + answer + <eos>
  for toks, want in ((gold, 1.0), (wrong, 0.0)):   # 11 <= L_max - L_cache = 12: no penalty
    r = Worker.rewards(me, types.SimpleNamespace(tokens=toks), p.answer, p.prompt_id)
    assert r == want, (toks, r, want)
  me.config = dataclasses.replace(run, rl=dataclasses.replace(run.rl, length_penalty_max=12))
  for toks, want in ((gold, 0.25), (wrong, 0.0)):  # clip((12 - 11) / 4 - 1) = -0.75 if correct
    r = Worker.rewards(me, types.SimpleNamespace(tokens=toks), p.answer, p.prompt_id)
    assert r == pytest.approx(want), (toks, r, want)
