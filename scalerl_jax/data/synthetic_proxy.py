"""Cheap numeric sanity check of the synthetic task design (numpy only; no neural network).

Proxy policy: a tabular softmax pi(s_i | s_{i-1}, d_i) over the next partial sum (the step a transformer
has to learn; the answer copy is assumed perfect). "SFT" = maximum likelihood on noisy SFT traces
(smoothed counts); "RL" = the ScaleRL update on the table: group-centred rewards, batch-std
normalization, zero-variance prompts dropped, prompt-level aggregation, plain gradient ascent.
It checks the two numbers the task promises: SFT pass rate in [0.05, 0.40] at temperature 1, and RL
improvement >= 0.25 within a few hundred steps of 8 prompts x 8 samples.

  python -m scalerl_jax.data.synthetic_proxy      # last stdout line: one JSON object
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from scalerl_jax.data import synthetic as syn


def sft_table(examples, smoothing: float = 1.0) -> np.ndarray:
  """log-probability table [prev, digit, next] fitted to SFT traces (counts + `smoothing`)."""
  counts = np.full((10, 10, 10), smoothing)
  for ex in examples:
    if ex.interrupted:
      continue
    terms = [int(t) for t in syn.TOKENIZER.decode(ex.tokens[2:ex.prompt_len - 2]).split()]
    sums = [int(t) for t in syn.TOKENIZER.decode(ex.tokens[ex.prompt_len:ex.prompt_len + len(terms)]).split()]
    prev = 0
    for d, s in zip(terms, sums):
      counts[prev, d, s] += 1
      prev = s
  return np.log(counts / counts.sum(-1, keepdims=True))


def rollout(logits, terms, rng) -> tuple[list[int], float]:
  """Samples one trace; returns (sampled sums, reward)."""
  prev, sums = 0, []
  for d in terms:
    p = np.exp(logits[prev, d] - logits[prev, d].max())
    s = int(rng.choice(10, p=p / p.sum()))
    sums.append(s)
    prev = s
  return sums, float(prev == int(np.sum(terms) % 10))


def pass_rate(logits, problems, samples, rng) -> float:
  return float(np.mean([rollout(logits, p.terms, rng)[1] for p in problems for _ in range(samples)]))


def run(seed=0, n_sft=2000, rl_steps=300, prompts_per_step=8, gens=8, lr=0.5, eval_every=50) -> dict[str, Any]:
  """Returns a dict of held-out pass rates (mean@16 on 64 held-out prompts) through SFT and RL."""
  rng = np.random.default_rng(seed)
  train, heldout = syn.make_split(seed, n_train=n_sft + prompts_per_step * rl_steps, n_heldout=64)
  logits = sft_table(syn.sft_examples(train[:n_sft], seed))
  curve = [(0, pass_rate(logits, heldout, 16, rng))]
  rl_prompts = train[n_sft:]
  for step in range(1, rl_steps + 1):
    batch = rl_prompts[(step - 1) * prompts_per_step: step * prompts_per_step]
    groups = [[rollout(logits, p.terms, rng) for _ in range(gens)] for p in batch]
    adv = [np.array([r for _, r in g]) - np.mean([r for _, r in g]) for g in groups]
    std = np.concatenate(adv).std() + 1e-6
    grad = np.zeros_like(logits)
    for p, g, a in zip(batch, groups, adv):
      if not a.any():
        continue        # zero-variance prompt
      ntok = sum(len(s) for s, _ in g)
      for (sums, _), ai in zip(g, a):
        prev = 0
        for d, s in zip(p.terms, sums):
          pr = np.exp(logits[prev, d]); pr /= pr.sum()
          grad[prev, d] -= ai / std * pr / ntok
          grad[prev, d, s] += ai / std / ntok
          prev = s
    logits = logits + lr * grad
    if step % eval_every == 0:
      curve.append((step, pass_rate(logits, heldout, 16, rng)))
  return {"sft_pass": curve[0][1], "final_pass": curve[-1][1],
          "gain": curve[-1][1] - curve[0][1], "curve": curve,
          "perfect_imitation_pass": syn.expected_pass_rate()}


if __name__ == "__main__":
  print(json.dumps(run()))
