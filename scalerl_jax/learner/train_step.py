"""The jitted (optionally sharded) learner step with exact micro-batch gradient accumulation.

    train_step(state, batch) -> (new_state, metrics)

1. ``prepare`` on the FULL batch: zero-variance filter, advantages, aggregation weights and the
   global loss denominator D = Σ weights (see scalerl_jax/rl/aggregation.py).
2. Split rows into M micro-batches; ``lax.scan`` over them accumulating ∇(partial loss sum) and
   additive token statistics. Each micro-batch recomputes learner log-probs from float32 logits.
3. grads = Σ_m ∇sum_m / D, loss = Σ_m sum_m / D — exactly the full-batch loss and gradient.
4. AdamW update (global-norm clip inside the optax chain). A step whose D == 0 (empty after
   filtering) or whose loss / grad norm / update norm is non-finite is SKIPPED: params, optimizer
   state and ``step`` stay unchanged and ``metrics['skipped']`` is 1 (reason in ``skip_reason``:
   1 = empty batch, 2 = non-finite). Never a silent NaN update.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from scalerl_jax import rl
from scalerl_jax.learner import metrics as metrics_lib
from scalerl_jax.learner.batch import RLSpec, prepare, split_microbatches
from scalerl_jax.learner.logprobs import chunked_token_logprobs, token_logprobs
from scalerl_jax.learner.state import LearnerState

# (params, tokens, positions) -> float32 logits [B,T,V], or (hidden [B,T,D], head kernel [D,V])
# (models.forward_hidden): then log-probs are computed over sequence chunks (logits_chunk).
# With MoE routing replay it is also called with routes=int [B,T,R,K].
ApplyFn = Callable[..., Any]
SKIP_EMPTY, SKIP_NONFINITE = 1.0, 2.0


def _positions(batch):
  if "positions" in batch:
    return jnp.asarray(batch["positions"], jnp.int32)
  b, t = batch["tokens"].shape
  return jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))


def make_train_step(apply_fn: ApplyFn, optimizer: optax.GradientTransformation, spec: RLSpec,
                    microbatches: int = 1, *, lr_schedule: optax.Schedule | None = None,
                    with_entropy: bool = True, batch_partition: P | None = None,
                    mesh=None, logits_chunk: int = 1024) -> Callable:
  """Builds the un-jitted step function ``(state, batch) -> (state, metrics)``.

  When ``apply_fn`` returns (hidden, head kernel), log-probs and entropies are computed over
  sequence chunks of ``logits_chunk`` positions (learner/logprobs.chunked_token_logprobs).

  ``batch_partition`` (with ``mesh``) constrains each micro-batch's rows to the batch mesh axes.
  """
  loss_fn = rl.get_loss(spec.loss)

  def objective(params, mb):
    extra = {"routes": mb["routes"]} if "routes" in mb else {}   # MoE routing replay (R3)
    out = apply_fn(params, mb["tokens"], mb["positions"], **extra)
    aux = {}
    if isinstance(out, tuple) and isinstance(out[-1], dict):   # (..., aux), e.g. aux['moe_dropped']
      out, aux = (out[0] if len(out) == 2 else out[:-1]), out[-1]
    if isinstance(out, tuple):
      logp, ent = chunked_token_logprobs(*out, mb["tokens"], logits_chunk, with_entropy)
    else:
      logp, ent = token_logprobs(out, mb["tokens"], with_entropy)
    mask = mb["loss_mask"].astype(bool)
    out = loss_fn(logp, mb["gen_logprobs"], mb["adv"], mb["weights"], mask, spec.hp)
    stats = metrics_lib.token_stats(logp, mb["gen_logprobs"], ent, mb["weights"], mask, out.stats)
    stats["loss_sum"] = jax.lax.stop_gradient(out.sum)
    if "moe_dropped" in aux:
      stats["moe_dropped"] = jax.lax.stop_gradient(aux["moe_dropped"])
    return out.sum, stats

  grad_fn = jax.grad(objective, has_aux=True)

  def constrain(tree):
    if mesh is None or batch_partition is None:
      return tree
    spec_m = P(None, *batch_partition)
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
        x, NamedSharding(mesh, spec_m)), tree)

  def train_step(state: LearnerState, batch: Mapping[str, jax.Array]):
    prep = prepare(batch, spec)
    inputs = dict(tokens=jnp.asarray(batch["tokens"], jnp.int32), positions=_positions(batch),
                  gen_logprobs=jnp.asarray(batch["gen_logprobs"], jnp.float32),
                  loss_mask=jnp.asarray(batch["loss_mask"], bool),
                  adv=prep["adv"], weights=prep["weights"])
    if "routes" in batch:
      inputs["routes"] = jnp.asarray(batch["routes"], jnp.int32)
    params = state.params
    if microbatches == 1:
      grads, stats = grad_fn(params, inputs)
    else:
      mbs = constrain(split_microbatches(inputs, microbatches))

      def body(carry, mb):
        g_acc, s_acc = carry
        g, s = grad_fn(params, mb)
        return (jax.tree.map(jnp.add, g_acc, g), metrics_lib.combine(s_acc, s)), None

      init = (jax.tree.map(jnp.zeros_like, params), metrics_lib.zeros())
      (grads, stats), _ = jax.lax.scan(body, init, mbs)
    denom = prep["denominator"]
    safe = jnp.where(denom > 0, denom, 1.0)
    grads = jax.tree.map(lambda g: g / safe, grads)
    loss = stats["loss_sum"] / safe
    grad_norm = optax.tree.norm(grads)
    updates, new_opt = optimizer.update(grads, state.opt_state, params)
    update_norm = optax.tree.norm(updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    ok = (denom > 0) & finite
    new_params, new_opt = jax.lax.cond(
        ok, lambda: (optax.apply_updates(params, updates), new_opt),
        lambda: (params, state.opt_state))
    new_state = LearnerState(params=new_params, opt_state=new_opt,
                             step=state.step + ok.astype(jnp.int32))
    m = metrics_lib.finalize(stats)
    m.update(loss=loss, grad_norm=grad_norm, update_norm=update_norm, denominator=denom,
             effective_samples=prep["kept_rows"], dropped_groups=prep["dropped_groups"],
             effective_prompts=prep["kept_groups"],
             total_tokens=jnp.sum(inputs["loss_mask"] & (batch["prompt_ids"] >= 0)[:, None]
                                  ).astype(jnp.float32),
             skipped=(~ok).astype(jnp.float32),
             skip_reason=jnp.where(denom > 0, jnp.where(finite, 0.0, SKIP_NONFINITE), SKIP_EMPTY))
    if spec.loss == "cispo":
      m["truncated_frac"] = m["clip_frac_high"]
    if lr_schedule is not None:
      m["lr"] = lr_schedule(state.step)
    return new_state, m

  return train_step
