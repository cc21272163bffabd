"""Independent float64 NumPy reference for the RL objective (helpers only, no tests here; written
separately from the JAX code, with explicit Python loops over groups, rows and tokens) and random
ragged-batch generators.
Used by tests/test_rl*.py and tests/test_learner*.py. Gradients are derived by hand:

  cispo      term = −min(ρ,ε)·A·lp                     ∂term/∂lp = −min(ρ,ε)·A
  reinforce  term = −A·lp                              ∂term/∂lp = −A
  ppo/dapo   term = −min(ρA, clip(ρ)A), ρ = e^(lp−g)   ∂term/∂lp = −ρA unless the clip is active
                                                       (A>0, ρ>1+ε_hi or A<0, ρ<1−ε_lo) → 0
  gspo       s = exp(mean_{t∈row}(lp−g)); every token of the row carries f(s) = −min(sA, clip(s)A)
             row contribution Σ_t w_t f(s) → ∂/∂lp_t = (Σ_{t'∈row} w_t')·f'(s)·s/n_row,
             f'(s) = −A unless clipped → 0
  loss = Σ w·term / Σ w, gradient = Σ-weighted ∂term / Σ w.
"""
from __future__ import annotations

import numpy as np

HP = dict(cispo_eps_max=5.0, clip_eps_low=0.2, clip_eps_high=0.28, gspo_eps_low=3e-3,
          gspo_eps_high=4e-3)


def make_batch(rng, num_prompts=5, gens=4, seq=24, zero_var_groups=1, pad_rows=0,
               policy_noise=0.3, big_ratio_frac=0.0, gspo_scale=False):
  """Random ragged rollout batch (numpy) plus learner log-probs `logp` [B,T] float32.

  Each row: prompt of 2..6 tokens, completion of 1..(seq − prompt) tokens, ~10% of completion tokens
  marked non-policy (injected interruption), the rest padding. Rows are shuffled (groups interleave).
  """
  b = num_prompts * gens
  pids = np.repeat(rng.choice(1000, num_prompts, replace=False), gens)
  rewards = rng.integers(0, 2, b).astype(np.float32)
  rewards[:gens] = 0.0; rewards[1] = 1.0                       # group 0 surely mixed
  for z in range(zero_var_groups):                              # last groups: all-equal rewards
    g = num_prompts - 1 - z
    rewards[g * gens:(g + 1) * gens] = float(z % 2)
  # a second reward level so std normalisation is non-trivial
  rewards += (rng.random(b) < 0.3) * 0.5 * (rewards > 0)
  for z in range(zero_var_groups):
    g = num_prompts - 1 - z
    rewards[g * gens:(g + 1) * gens] = float(z % 2)
  tokens = rng.integers(0, 97, (b, seq)).astype(np.int32)
  mask = np.zeros((b, seq), bool)
  for i in range(b):
    p = rng.integers(2, 7)
    n = rng.integers(1, seq - p + 1)
    mask[i, p:p + n] = True
    mask[i, p:p + n] &= rng.random(n) > 0.1
    if not mask[i].any():
      mask[i, p] = True
  logp = np.log(rng.uniform(0.05, 0.95, (b, seq))).astype(np.float32)
  noise = (1e-3 if gspo_scale else policy_noise) * rng.standard_normal((b, seq))
  if gspo_scale:                       # per-row offset so some sequence ratios leave [1−3e-3, 1+4e-3]
    noise += rng.uniform(-8e-3, 8e-3, (b, 1))
  gen = (logp + noise).astype(np.float32)
  if big_ratio_frac:
    big = rng.random((b, seq)) < big_ratio_frac
    gen = np.where(big, logp - np.log(8.0), gen).astype(np.float32)    # ρ = 8 > ε_max
  gen = np.minimum(gen, -1e-4).astype(np.float32)
  perm = rng.permutation(b)
  batch = dict(tokens=tokens[perm], gen_logprobs=gen[perm], loss_mask=mask[perm],
               rewards=rewards[perm], prompt_ids=pids[perm].astype(np.int32),
               versions=np.zeros((b, seq), np.int32))
  logp = logp[perm]
  if pad_rows:
    batch, logp = pad_batch(batch, logp, pad_rows, 0)
  return batch, logp


def pad_batch(batch, logp, rows, cols, rng=None):
  """Appends padding rows (prompt_id −1, junk incl. NaN) and padding columns (mask False)."""
  out = {}
  b, t = batch["tokens"].shape
  for k, v in batch.items():
    if v.ndim == 2:
      fill = np.nan if k == "gen_logprobs" else 0
      v = np.pad(v.astype(np.float32) if k == "gen_logprobs" else v,
                 ((0, rows), (0, cols)), constant_values=fill)
      if k == "gen_logprobs":
        v = v.astype(np.float32)
    else:
      v = np.pad(v, (0, rows), constant_values=-1 if k == "prompt_ids" else 7.0)
    out[k] = v
  out["loss_mask"][b:, 2:5] = True                    # padding rows even claim loss tokens
  lp = np.pad(logp, ((0, rows), (0, cols)), constant_values=np.nan).astype(np.float32)
  return out, lp


# ------------------------------------------------------------------------------ reference

def ref_groups(prompt_ids, keep):
  groups = {}
  for i, (p, k) in enumerate(zip(prompt_ids, keep)):
    if k:
      groups.setdefault(int(p), []).append(i)
  return groups


def ref_keep(rewards, prompt_ids, zero_variance_filter=True):
  valid = [p >= 0 for p in prompt_ids]
  if not zero_variance_filter:
    return np.array(valid), 0
  keep = np.array(valid)
  dropped = 0
  for _p, rows in ref_groups(prompt_ids, valid).items():
    rs = [float(rewards[i]) for i in rows]
    if max(rs) == min(rs):
      dropped += 1
      for i in rows:
        keep[i] = False
  return keep, dropped


def ref_advantages(rewards, prompt_ids, keep, norm, eps=1e-6):
  r = np.asarray(rewards, np.float64)
  adv = np.zeros(len(r))
  groups = ref_groups(prompt_ids, keep)
  for rows in groups.values():
    mean = sum(r[i] for i in rows) / len(rows)
    for i in rows:
      adv[i] = r[i] - mean
    if norm == "prompt":
      std = np.sqrt(sum((r[i] - mean) ** 2 for i in rows) / len(rows))
      for i in rows:
        adv[i] /= std + eps
  if norm == "batch":
    kept = [i for i in range(len(r)) if keep[i]]
    if kept:
      m = sum(adv[i] for i in kept) / len(kept)
      std = np.sqrt(sum((adv[i] - m) ** 2 for i in kept) / len(kept))
      for i in kept:
        adv[i] /= std + eps
  return adv


def ref_weights(mask, prompt_ids, keep, mode):
  b, t = mask.shape
  w = np.zeros((b, t))
  groups = ref_groups(prompt_ids, keep)
  for i in range(b):
    if not keep[i]:
      continue
    n_i = int(mask[i].sum())
    n_group = sum(int(mask[j].sum()) for j in groups[int(prompt_ids[i])])
    for tt in range(t):
      if mask[i, tt]:
        w[i, tt] = {"token": 1.0, "sample": 1.0 / max(n_i, 1), "prompt": 1.0 / max(n_group, 1)}[mode]
  return w


def ref_term_and_grad(loss, lp, g, a, hp=HP):
  """Per-token (term, ∂term/∂lp) for the token-local losses (float64 scalars)."""
  rho = np.exp(lp - g)
  if loss == "cispo":
    c = min(rho, hp["cispo_eps_max"])
    return -c * a * lp, -c * a
  if loss == "reinforce":
    return -a * lp, -a
  lo, hi = (hp["clip_eps_low"], hp["clip_eps_low"]) if loss == "ppo" else \
      (hp["clip_eps_low"], hp["clip_eps_high"])
  clipped_active = (a > 0 and rho > 1 + hi) or (a < 0 and rho < 1 - lo)
  if clipped_active:
    return -min(max(rho, 1 - lo), 1 + hi) * a, 0.0
  return -rho * a, -rho * a


def ref_loss_and_grad(loss, logp, gen, adv, w, mask, hp=HP):
  """(Σ w·term, Σ w, ∂(Σ w·term)/∂logp [B,T]) in float64."""
  b, t = logp.shape
  total, grad = 0.0, np.zeros((b, t))
  denom = float(sum(w[i, tt] for i in range(b) for tt in range(t) if mask[i, tt] and w[i, tt] > 0))
  for i in range(b):
    toks = [tt for tt in range(t) if mask[i, tt] and w[i, tt] > 0]
    if not toks:
      continue
    if loss == "gspo":
      n = len(toks)
      s = np.exp(sum(float(logp[i, tt]) - float(gen[i, tt]) for tt in toks) / n)
      a = adv[i]
      lo, hi = hp["gspo_eps_low"], hp["gspo_eps_high"]
      clipped_active = (a > 0 and s > 1 + hi) or (a < 0 and s < 1 - lo)
      f = -min(s * a, min(max(s, 1 - lo), 1 + hi) * a)
      df = 0.0 if clipped_active else -a
      wsum = sum(w[i, tt] for tt in toks)
      total += wsum * f
      for tt in toks:
        grad[i, tt] = wsum * df * s / n
      continue
    for tt in toks:
      term, d = ref_term_and_grad(loss, float(logp[i, tt]), float(gen[i, tt]), adv[i], hp)
      total += w[i, tt] * term
      grad[i, tt] = w[i, tt] * d
  return total, denom, grad


def ref_objective(batch, logp, loss, aggregation, adv_norm, zero_variance_filter=True, hp=HP):
  """Full pipeline: filter → advantages → weights → loss. Returns (loss, grad [B,T], info)."""
  f64 = lambda x: np.asarray(x, np.float64)
  keep, dropped = ref_keep(batch["rewards"], batch["prompt_ids"], zero_variance_filter)
  adv = ref_advantages(batch["rewards"], batch["prompt_ids"], keep, adv_norm)
  w = ref_weights(batch["loss_mask"], batch["prompt_ids"], keep, aggregation)
  s, d, g = ref_loss_and_grad(loss, f64(logp), f64(batch["gen_logprobs"]), adv, w,
                              batch["loss_mask"], hp)
  return s / d, g / d, dict(denominator=d, dropped=dropped, adv=adv, weights=w, keep=keep)
