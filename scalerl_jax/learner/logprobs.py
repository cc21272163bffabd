"""Next-token log-probs and entropies from float32 logits (the FP32 LM head contract).

Alignment: the log-prob of token t comes from the logits at position t − 1; position 0 (no context)
gets log-prob 0 and entropy 0 and must be outside the loss mask (it is a prompt token anyway).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits, tokens, with_entropy: bool = True, temperature: float = 1.0):
  """Returns (logp [B,T], entropy [B,T] or None), both float32.

  `temperature` T: the log-probs of the distribution the generator sampled from,
  log_softmax(logits / T) (docs/LEARNER.md "Sampling temperature"); T = 1 leaves the logits as is.
  logp[b, t] = log_softmax(logits[b, t−1])[tokens[b, t]] for t ≥ 1, computed in float32 as
  logit − logsumexp (never materialising a softmax in the forward). entropy[b, t] is the entropy of
  the distribution that produced token t, under stop_gradient (a metric, not a loss term).
  """
  logits = jnp.asarray(logits, jnp.float32)[:, :-1]                       # predicts tokens[:, 1:]
  if float(temperature) != 1.0:
    logits = logits / jnp.float32(temperature)
  tgt = jnp.asarray(tokens)[:, 1:]
  lse = jax.nn.logsumexp(logits, axis=-1)
  picked = jnp.take_along_axis(logits, tgt[..., None].astype(jnp.int32), axis=-1)[..., 0]
  pad = jnp.zeros((logits.shape[0], 1), jnp.float32)
  logp = jnp.concatenate([pad, picked - lse], axis=1)
  if not with_entropy:
    return logp, None
  sg_logits, sg_lse = jax.lax.stop_gradient(logits), jax.lax.stop_gradient(lse)
  log_probs = sg_logits - sg_lse[..., None]
  ent = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)   # no lse − E[logit] cancellation
  return logp, jnp.concatenate([pad, ent], axis=1)
