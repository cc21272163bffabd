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

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from scalerl_jax import config as common
from scalerl_jax import rl
from scalerl_jax.learner import metrics as metrics_lib
from scalerl_jax.learner.batch import RLSpec, bucket_lengths, prepare, split_microbatches
from scalerl_jax.learner.logprobs import chunked_token_logprobs, token_logprobs
from scalerl_jax.learner.optimizer import ClippedAdamW
from scalerl_jax.learner.state import LearnerState
from scalerl_jax.rl.correction import stat_names

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


# Batch keys of recorded MoE routes int [B,T,R,K]: "routes" are replayed (R3) and compared;
# "gen_routes" (R3 off, rl.record_routes) are only compared (the router_disagree metric).
ROUTE_KEYS = ("routes", "gen_routes")


def _recorded_routes(batch) -> jax.Array | None:
  """The generator's recorded routes of `batch` (replayed or not), or None."""
  return next((batch[k] for k in ROUTE_KEYS if k in batch), None)


MAX_SLICES = 64   # a leaf whose axis 0 has <= this many entries (the scanned layers) is sliced


def _guard(loss, grad_norm, update_norm, denom):
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
  return (denom > 0) & finite, finite


def tree_update(optimizer, acc, denom_safe, params, opt_state, loss, denom) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array, jax.Array]:
  """Any optax optimizer: grads = acc / D, update, apply under lax.cond (skipped steps)."""
  grads = jax.tree.map(lambda g: g / denom_safe, acc)
  grad_norm = optax.tree.norm(grads)
  updates, new_opt = optimizer.update(grads, opt_state, params)
  update_norm = optax.tree.norm(updates)
  ok, finite = _guard(loss, grad_norm, update_norm, denom)
  new_params, new_opt = jax.lax.cond(
      ok, lambda: (optax.apply_updates(params, updates), new_opt), lambda: (params, opt_state))
  return new_params, new_opt, grad_norm, update_norm, ok, finite


def _num_slices(x) -> int:
  return x.shape[0] if x.ndim >= 2 and 1 < x.shape[0] <= MAX_SLICES else 1


def sliced_update(optimizer, acc, denom_safe, params, opt_state, loss, denom) -> tuple[Any, Any, jax.Array, jax.Array, jax.Array, jax.Array]:
  """make_optimizer's clip -> AdamW applied in place, one axis-0 slice (scanned layer) at a time.

  The whole-tree path (`tree_update`) keeps the scaled gradients, the update tree and the new
  moments alive next to the accumulator until lax.cond picks them (~3x the fp32 parameter bytes of
  XLA temporaries). Here the accumulator `acc` is the only parameter-sized buffer: ONE pass
  rewrites params, mu and nu slice by slice with dynamic_update_slice inside a fori_loop (in
  place; zero trips when the step is skipped) and sums the update's squares on the way (the
  update_norm metric). The skip guard is decided before it, from the loss and the gradient norm
  (the old second pass, which computed every update twice to check its norm first, cost 30-60 ms
  a step on CPU, issue #26). Per element the arithmetic is optax's: acc / D, clip_by_global_norm's select, then
  `optimizer.adamw.update` on the slice (moments, bias correction, weight decay, -lr).
  """
  clip, adamw = optimizer.max_grad_norm, optimizer.adamw
  adam_state = opt_state[1] if clip else opt_state
  moments, rest = adam_state[0], tuple(adam_state[1:])
  grads = lambda a: a / denom_safe
  grad_norm = optax.tree.norm(jax.tree.map(grads, acc))
  if clip:
    trigger = grad_norm < clip
    clip_fn = lambda t: jax.lax.select(trigger, t, (t / grad_norm.astype(t.dtype)) * clip)
  else:
    clip_fn = lambda t: t

  def update(a, p, m, n) -> tuple[Any, Any, Any, Any]:
    """(new p, new mu, new nu, update) of one slice (or leaf): arrays."""
    u, st = adamw.update(clip_fn(grads(a)), (moments._replace(mu=m, nu=n),) + rest, p)
    return optax.apply_updates(p, u), st[0].mu, st[0].nu, u

  def take(x, i) -> jax.Array:
    return jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=True)

  leaves, treedef = jax.tree.flatten(acc)
  cols = [leaves, treedef.flatten_up_to(params), treedef.flatten_up_to(moments.mu),
          treedef.flatten_up_to(moments.nu)]
  # One pass: the guard is decided before the update from what can be non-finite (the loss and
  # the gradient norm; with finite gradients AdamW's update of finite parameters is finite), so
  # params, mu and nu are rewritten in the same pass that sums the update's squares. A skipped
  # step runs zero trips (its update_norm reads 0).
  ok, finite = _guard(loss, grad_norm, jnp.zeros((), jnp.float32), denom)

  def apply(a, p, m, n) -> tuple[Any, jax.Array]:
    """((new p, mu, nu), sum of the update's squares) of one leaf, slice by slice."""
    k = _num_slices(a)
    if k == 1:
      p2, m2, n2, u = update(a, p, m, n)
      new = tuple(jnp.where(ok, x, y) for x, y in ((p2, p), (m2, m), (n2, n)))
      return new, jnp.where(ok, jnp.sum(jnp.square(u)), 0.0)

    def body(i, carry) -> tuple[Any, jax.Array]:
      xs, sq = carry
      p2, m2, n2, u = update(take(a, i), *(take(x, i) for x in xs))
      xs = tuple(jax.lax.dynamic_update_index_in_dim(x, y, i, 0) for x, y in zip(xs, (p2, m2, n2)))
      return xs, sq + jnp.sum(jnp.square(u))
    return jax.lax.fori_loop(0, jnp.where(ok, k, 0), body, ((p, m, n), jnp.zeros((), jnp.float32)))

  done = [apply(*xs) for xs in zip(*cols)]
  update_norm = jnp.sqrt(sum(sq for _, sq in done))
  new_p, new_m, new_n = zip(*(xs for xs, _ in done))
  # Counters (adam count, schedule count) advance as optax advances them, only on applied steps.
  zero = jnp.zeros((), jnp.float32)
  _, st = adamw.update(zero, (moments._replace(mu=zero, nu=zero),) + rest, zero)
  keep = lambda new, old: jax.tree.map(lambda x, y: jnp.where(ok, x, y), new, old)
  new_moments = moments._replace(count=keep(st[0].count, moments.count),
                                 mu=treedef.unflatten(new_m), nu=treedef.unflatten(new_n))
  new_adam = (new_moments,) + keep(tuple(st[1:]), rest)
  new_opt = (opt_state[0], new_adam) if clip else new_adam
  return treedef.unflatten(new_p), new_opt, grad_norm, update_norm, ok, finite


def make_logprob_fn(apply_fn: ApplyFn, logits_chunk: int = common.Model.logits_chunk,
                    temperature: float = 1.0,
                    head_precision: str = common.Model.head_precision) -> Callable[..., jax.Array]:
  """``(params, tokens, routes=None) -> logp float32 [B,T]`` (0 at t=0): the learner's own
  log-probs (log_softmax(logits / T)) as its step computes them. With an ``apply_fn`` returning
  (hidden, head kernel) they are computed over sequence chunks of ``logits_chunk`` positions, so
  [B,T,V] logits never exist; under a mesh the batch stays sharded like the step's (the parity
  gate of a multi-host learner, trainer._parity)."""
  def fn(params, tokens, routes=None) -> jax.Array:
    tokens = jnp.asarray(tokens, jnp.int32)
    b, t = tokens.shape
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
    out = apply_fn(params, tokens, pos, **({"routes": routes} if routes is not None else {}))
    if isinstance(out, tuple) and isinstance(out[-1], dict):
      out = out[0] if len(out) == 2 else out[:-1]
    if isinstance(out, tuple):
      hidden, kernel = out
      return chunked_token_logprobs(hidden, kernel, tokens, logits_chunk, False,
                                    temperature=temperature, precision=head_precision)[0]
    return token_logprobs(out, tokens, False, temperature=temperature)[0]
  return fn


def _constrain(mesh, batch_partition) -> Callable[[Any], Any]:
  """Constrains each micro-batch's rows to the batch mesh axes (identity without a mesh)."""
  def constrain(tree) -> Any:
    if mesh is None or batch_partition is None:
      return tree
    sharding = NamedSharding(mesh, P(None, *batch_partition))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)
  return constrain


def _step_inputs(batch: Mapping[str, jax.Array], prep) -> dict[str, jax.Array]:
  """The objective's inputs of a whole batch (tokens, positions, gen log-probs, mask, advantages,
  weights; routes and lags when the batch has them)."""
  inputs = dict(tokens=jnp.asarray(batch["tokens"], jnp.int32), positions=_positions(batch),
                gen_logprobs=jnp.asarray(batch["gen_logprobs"], jnp.float32),
                loss_mask=jnp.asarray(batch["loss_mask"], bool),
                adv=prep["adv"], weights=prep["weights"])
  for k in ROUTE_KEYS:
    if k in batch:
      inputs[k] = jnp.asarray(batch[k], jnp.int32)
  if "lags" in batch:
    inputs["lags"] = jnp.asarray(batch["lags"], jnp.int32)
  return inputs


def _accumulate(grad_fn, params, inputs, *, microbatches: int, pad_multiple: int,
                max_buckets: int, constrain, correction_on: bool) -> tuple[Any, dict[str, jax.Array]]:
  """Σ of the micro-batches' gradients and combined stats: one `lax.scan` whose carry is the one
  accumulator; with `pad_multiple` > 0 each micro-batch runs in its length bucket
  (make_train_step's docstring)."""
  mbs = constrain(split_microbatches(inputs, microbatches))

  T = inputs["tokens"].shape[1]
  buckets = bucket_lengths(T, pad_multiple, max_buckets) if pad_multiple > 0 else (T,)

  def cut(mb, L) -> dict[str, jax.Array]:          # the token axis of every [rows, T, ...] input cut to L
    return {k: (v[:, :L] if v.ndim >= 2 else v) for k, v in mb.items()}

  def mb_grad(mb) -> Any:
    if len(buckets) == 1:
      return grad_fn(params, mb)
    pos = jnp.arange(T, dtype=jnp.int32)
    need = jnp.max(jnp.where(mb["loss_mask"], pos[None] + 1, 0))
    k = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), need), len(buckets) - 1)
    return jax.lax.switch(k, [lambda m, L=L: grad_fn(params, cut(m, L)) for L in buckets], mb)

  def body(carry, mb) -> tuple[tuple[Any, dict[str, jax.Array]], None]:   # the scan carry IS the one accumulator (updated in place)
    g_acc, s_acc = carry
    g, s = mb_grad(mb)
    return (jax.tree.map(jnp.add, g_acc, g), metrics_lib.combine(s_acc, s)), None

  keys = metrics_lib.SUM_KEYS + metrics_lib.MAX_KEYS
  if "lags" in inputs:
    keys += metrics_lib.lag_keys(stat_names() if correction_on else ())
  if _recorded_routes(inputs) is not None:
    keys += metrics_lib.ROUTER_KEYS
  init = (jax.tree.map(jnp.zeros_like, params), metrics_lib.zeros(keys))
  (acc, stats), _ = jax.lax.scan(body, init, mbs)
  return acc, stats


def _step_metrics(stats, prep, inputs, batch, loss, grad_norm, update_norm, ok, finite
                  ) -> dict[str, Any]:
  """The step's metrics: the finalized token stats, loss, norms, denominator, kept / dropped
  counts, tokens, and whether (and why) the update was skipped."""
  denom = prep["denominator"]
  m = metrics_lib.finalize(stats)
  m.update(loss=loss, grad_norm=grad_norm, update_norm=update_norm, denominator=denom,
           effective_samples=prep["kept_rows"], dropped_groups=prep["dropped_groups"],
           effective_prompts=prep["kept_groups"],
           total_tokens=jnp.sum(inputs["loss_mask"] & (batch["prompt_ids"] >= 0)[:, None]
                                ).astype(jnp.float32),
           skipped=(~ok).astype(jnp.float32),
           skip_reason=jnp.where(denom > 0, jnp.where(finite, 0.0, SKIP_NONFINITE), SKIP_EMPTY))
  return m


def _moe_stats(aux: dict, mb: Mapping[str, jax.Array], mask: jax.Array) -> dict[str, jax.Array]:
  """The forward's MoE facts: tokens dropped by expert capacity, and router agreement with the
  generator's recorded routes (metrics.router_stats; an apply_fn without aux compares nothing)."""
  stats = {}
  if "moe_dropped" in aux:
    stats["moe_dropped"] = jax.lax.stop_gradient(aux["moe_dropped"])
  recorded = _recorded_routes(mb)
  if recorded is not None:
    own = aux.get("own_routes", recorded)
    stats.update(metrics_lib.router_stats(own, recorded, mb["weights"], mask))
  return stats


def _forward(apply_fn: ApplyFn, params, mb, *, logits_chunk: int, with_entropy: bool,
             temperature: float, head_precision: str) -> tuple[jax.Array, Any, dict]:
  """(learner log-probs [B,T], entropies or None, the forward's aux dict) of a micro-batch: the
  model's float32 logits, or (hidden, head kernel) over sequence chunks; recorded routes
  replayed when the batch has `routes` (R3)."""
  extra = {"routes": mb["routes"]} if "routes" in mb else {}   # MoE routing replay (R3)
  out = apply_fn(params, mb["tokens"], mb["positions"], **extra)
  aux = {}
  if isinstance(out, tuple) and isinstance(out[-1], dict):   # (..., aux), e.g. aux['moe_dropped']
    out, aux = (out[0] if len(out) == 2 else out[:-1]), out[-1]
  if isinstance(out, tuple):             # (hidden, kernel): forward_hidden
    hidden, kernel = out
    logp, ent = chunked_token_logprobs(hidden, kernel, mb["tokens"], logits_chunk, with_entropy,
                                       temperature=temperature, precision=head_precision)
  else:
    logp, ent = token_logprobs(out, mb["tokens"], with_entropy, temperature=temperature)
  return logp, ent, aux


def _lag_stats(logp, mb: Mapping[str, jax.Array], mask, flags) -> dict[str, jax.Array]:
  """Mismatch and correction statistics split by lag class, when the batch carries lags."""
  if "lags" not in mb:
    return {}
  return metrics_lib.lag_stats(logp, mb["gen_logprobs"], mb["weights"], mask, mb["lags"], flags)


def _lr_metric(lr_schedule: optax.Schedule | None, step) -> dict[str, Any]:
  """{"lr": the schedule's rate at `step`}, or {} without a schedule."""
  return {} if lr_schedule is None else {"lr": lr_schedule(step)}


def make_train_step(apply_fn: ApplyFn, optimizer: optax.GradientTransformation, spec: RLSpec,
                    microbatches: int = common.Optim.microbatches, *, lr_schedule: optax.Schedule | None = None,
                    with_entropy: bool = True, batch_partition: P | None = None,
                    mesh=None, logits_chunk: int = common.Model.logits_chunk,
                    temperature: float = 1.0, pad_multiple: int = 0,
                    max_buckets: int = common.Learner.max_buckets,
                    head_precision: str = common.Model.head_precision) -> Callable:
  """Builds the un-jitted step function ``(state, batch) -> (state, metrics)``.

  A composition of registered pieces, each looked up by the name ``spec`` holds: the loss
  (`rl.losses.LOSSES`, with its own metric aliases), the aggregation (`rl.aggregation.AGGREGATIONS`)
  and advantage normalisation (`rl.advantages.ADV_NORMS`) in `prepare`, the rollout-correction
  switches the spec turns on (`rl.correction.SWITCHES`). The step names none of them; the only
  choices made here are how the micro-batches are accumulated (one, or a scan) and which update
  the optimizer takes (the sliced in-place AdamW, or any optax transformation).

  When ``apply_fn`` returns (hidden, head kernel), log-probs and entropies are computed over
  sequence chunks of ``logits_chunk`` positions (learner/logprobs.chunked_token_logprobs).
  ``head_precision``: the chunked LM head's matmul precision (models.layers.head_matmul).
  ``temperature``: the generators' sampling temperature T; learner log-probs are
  log_softmax(logits / T), the distribution ``gen_logprobs`` come from (else every IS ratio is biased).

  ``batch_partition`` (with ``mesh``) constrains each micro-batch's rows to the batch mesh axes.

  ``pad_multiple`` > 0 (with M > 1 micro-batches): each micro-batch is cut to its own length
  bucket (`bucket_lengths(T, pad_multiple, max_buckets)`: the smallest one covering its rows'
  last loss position) by a `lax.switch` over one compiled branch per bucket, so a micro-batch of
  short rows costs short-row FLOPs. Exact: positions after a row's last loss token cannot change
  its loss (causal attention), and D is the full batch's. Rows sorted by length
  (`batch.length_sorted_order`, the trainer does it) make the cuts effective.
  """
  loss_fn = rl.get_loss(spec.loss)
  forward = functools.partial(_forward, apply_fn, logits_chunk=logits_chunk,
                              with_entropy=with_entropy, temperature=temperature,
                              head_precision=head_precision)

  def objective(params, mb) -> tuple[jax.Array, dict[str, jax.Array]]:
    logp, ent, aux = forward(params, mb)
    mask = mb["loss_mask"].astype(bool)
    # rollout correction: the loss sees w·scale, D stays Σ w (rl/correction.py)
    weights, flags = rl.corrected_weights(logp, mb["gen_logprobs"], mb["weights"], mask,
                                          spec.correction)
    out = loss_fn(logp, mb["gen_logprobs"], mb["adv"], weights, mask, spec.hp)
    stats = metrics_lib.token_stats(logp, mb["gen_logprobs"], ent, mb["weights"], mask, out.stats)
    stats.update(_lag_stats(logp, mb, mask, flags))
    stats["loss_sum"] = jax.lax.stop_gradient(out.sum)
    stats.update(_moe_stats(aux, mb, mask))
    return out.sum, stats

  grad_fn = jax.grad(objective, has_aux=True)
  accumulate = (grad_fn if microbatches == 1 else functools.partial(
      _accumulate, grad_fn, microbatches=microbatches, pad_multiple=pad_multiple,
      max_buckets=max_buckets, constrain=_constrain(mesh, batch_partition),
      correction_on=spec.correction.enabled))
  update = sliced_update if isinstance(optimizer, ClippedAdamW) else tree_update

  def train_step(state: LearnerState, batch: Mapping[str, jax.Array]) -> tuple[LearnerState, dict[str, jax.Array]]:
    prep = prepare(batch, spec)
    inputs = _step_inputs(batch, prep)
    acc, stats = accumulate(state.params, inputs)
    denom = prep["denominator"]
    safe = jnp.where(denom > 0, denom, 1.0)
    loss = stats["loss_sum"] / safe
    new_params, new_opt, grad_norm, update_norm, ok, finite = update(
        optimizer, acc, safe, state.params, state.opt_state, loss, denom)
    new_state = LearnerState(params=new_params, opt_state=new_opt,
                             step=state.step + ok.astype(jnp.int32))
    m = _step_metrics(stats, prep, inputs, batch, loss, grad_norm, update_norm, ok, finite)
    m.update(rl.loss_metrics(spec.loss, m))
    m.update(_lr_metric(lr_schedule, state.step))
    return new_state, m

  return train_step
