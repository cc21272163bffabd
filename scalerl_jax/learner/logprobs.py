"""Next-token log-probs and entropies from float32 logits (the FP32 LM head contract).

Alignment: the log-prob of token t comes from the logits at position t − 1; position 0 (no context)
gets log-prob 0 and entropy 0 and must be outside the loss mask (it is a prompt token anyway).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from scalerl_jax.models.layers import head_matmul


def token_logprobs(logits, tokens, with_entropy: bool = True, temperature: float = 1.0) -> tuple[jax.Array, jax.Array | None]:
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


def chunked_token_logprobs(hidden, kernel, tokens, chunk: int = 1024, with_entropy: bool = True,
                           temperature: float = 1.0, precision: str = "fp32") -> tuple[jax.Array, jax.Array | None]:
  """`token_logprobs` of logits = hidden @ kernel, computed over sequence chunks of `chunk`.

  hidden [B,T,D] and kernel [D,V] in the head dtype (float32 for the FP32 LM head; see
  models.forward_hidden). Each chunk's [B,chunk,V] float32 logits exist only inside one step of a
  lax.map whose body is jax.checkpoint'ed, so the backward pass recomputes them chunk by chunk too:
  the [B,T,V] logits (8.4 GB for one 16k sequence of a 128,256 vocabulary) never exist whole.
  Same values as token_logprobs(hidden @ kernel, tokens, temperature=temperature); T need not
  divide by `chunk`. `precision`: the head matmul's (models.layers.head_matmul; config
  model.head_precision).
  """
  B, T, _ = hidden.shape
  tokens = jnp.asarray(tokens, jnp.int32)
  c = int(max(1, min(chunk, T)))
  n = -(-T // c)
  pad = n * c - T
  # Position t's logits predict token t+1 (the last position predicts nothing: target 0, dropped).
  tgt = jnp.concatenate([tokens[:, 1:], jnp.zeros((B, 1 + pad), jnp.int32)], axis=1)
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  hc = jnp.swapaxes(h.reshape(B, n, c, -1), 0, 1)                        # [n,B,c,D]
  tc = jnp.swapaxes(tgt.reshape(B, n, c), 0, 1)                          # [n,B,c]

  @jax.checkpoint
  def one(h_c, t_c) -> tuple[jax.Array, jax.Array | None]:
    logits = head_matmul(h_c, kernel, precision)                         # [B,c,V] float32
    if float(temperature) != 1.0:
      logits = logits / jnp.float32(temperature)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, t_c[..., None], axis=-1)[..., 0]
    if not with_entropy:
      return picked - lse, None
    log_probs = jax.lax.stop_gradient(logits - lse[..., None])
    return picked - lse, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)

  lp, ent = jax.lax.map(lambda xs: one(*xs), (hc, tc))                  # [n,B,c]
  pad0 = jnp.zeros((B, 1), jnp.float32)
  unchunk = lambda x: jnp.concatenate([pad0, jnp.swapaxes(x, 0, 1).reshape(B, n * c)[:, :T - 1]],
                                      axis=1)
  return unchunk(lp), (None if ent is None else unchunk(ent))
