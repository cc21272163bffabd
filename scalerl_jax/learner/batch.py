"""Rollout batch: host-side validation, in-jit preparation (filter, advantages, aggregation
weights — all on the FULL batch) and the split into micro-batches.

Batch contract (docs/ARCHITECTURE.md "Rollout batch"): ``tokens int32[B,T]``, ``gen_logprobs
f32[B,T]``, ``loss_mask bool[B,T]``, ``rewards f32[B]``, ``prompt_ids int32[B]``, optional
``versions int32[B,T]``, ``positions int32[B,T]`` and ``lags int32[B,T]`` (learner step − token
version: splits the mismatch and rollout-correction statistics by lag). Padding rows carry ``prompt_ids < 0``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from scalerl_jax import rl
from scalerl_jax.rl.correction import Correction
from scalerl_jax.rl.losses import LossHParams

ROW_KEYS = ("rewards", "prompt_ids")
TOKEN_KEYS = ("tokens", "gen_logprobs", "loss_mask")
OPTIONAL_TOKEN_KEYS = ("versions", "positions", "lags")


@dataclasses.dataclass(frozen=True)
class RLSpec:
  """The objective: loss family + hyper-parameters, aggregation, advantage normalisation, filter."""
  loss: str = "cispo"
  hp: LossHParams = LossHParams()
  aggregation: str = "prompt"
  adv_norm: str = "batch"
  zero_variance_filter: bool = True
  correction: Correction = Correction()   # rollout correction (rl/correction.py), off by default

  def __post_init__(self):
    rl.check_objective(self.loss, self.aggregation, self.adv_norm)

  @classmethod
  def from_config(cls, rl_cfg) -> "RLSpec":
    return cls(loss=rl_cfg.loss, hp=LossHParams.from_config(rl_cfg),
               aggregation=rl_cfg.aggregation, adv_norm=rl_cfg.adv_norm,
               zero_variance_filter=bool(rl_cfg.zero_variance_filter),
               correction=Correction.from_config(rl_cfg))


def validate_batch(batch: Mapping[str, np.ndarray], microbatches: int,
                   vocab_size: int | None = None, route_shape: tuple[int, int, int] | None = None
                   ) -> None:
  """Raises ValueError with a clear message for any contract violation (host-side, numpy).

  `route_shape` = (R MoE layers, K experts per token, E experts): the optional `routes` (MoE
  routing replay) and `gen_routes` (recorded, only compared: router_disagree) must be integer
  [B,T,R,K] in [0, E); without it, both are refused."""
  missing = [k for k in TOKEN_KEYS + ROW_KEYS if k not in batch]
  if missing:
    raise ValueError(f"rollout batch lacks keys {missing}; has {sorted(batch)}")
  tokens = np.asarray(batch["tokens"])
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be [B, T], got shape {tokens.shape}")
  if not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens must be integer, got {tokens.dtype}")
  b, t = tokens.shape
  for k in TOKEN_KEYS + tuple(k for k in OPTIONAL_TOKEN_KEYS if k in batch):
    if np.shape(batch[k]) != (b, t):
      raise ValueError(f"{k} has shape {np.shape(batch[k])}, expected {(b, t)} like tokens")
  for k in ROW_KEYS:
    if np.shape(batch[k]) != (b,):
      raise ValueError(f"{k} has shape {np.shape(batch[k])}, expected ({b},)")
  for key in ("routes", "gen_routes"):   # replayed (R3) / only compared (router_disagree)
    if key not in batch:
      continue
    routes = np.asarray(batch[key])
    if route_shape is None:
      raise ValueError(f"batch has {key} but the learner was given no route_shape (R, K, E)")
    r, k, e = route_shape
    if routes.shape != (b, t, r, k) or not np.issubdtype(routes.dtype, np.integer):
      raise ValueError(f"{key} must be integer [B,T,R,K] = {(b, t, r, k)}; got "
                       f"{routes.dtype} {routes.shape}")
    if routes.size and (routes.min() < 0 or routes.max() >= e):
      raise ValueError(f"{key} outside [0, {e}): min {routes.min()} max {routes.max()}")
  if microbatches < 1 or b % microbatches:
    raise ValueError(f"batch size {b} is not divisible by microbatches={microbatches}")
  if vocab_size is not None and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f"token ids outside [0, {vocab_size}): min {tokens.min()} max {tokens.max()}")
  mask = np.asarray(batch["loss_mask"]).astype(bool)
  if mask[:, 0].any():
    raise ValueError("loss_mask[:, 0] must be False: position 0 has no next-token log-prob")
  valid = np.asarray(batch["prompt_ids"]) >= 0
  rewards = np.asarray(batch["rewards"], np.float64)
  if not np.all(np.isfinite(rewards[valid])):
    raise ValueError(f"non-finite rewards in rows {np.flatnonzero(~np.isfinite(rewards) & valid)}")
  glp = np.asarray(batch["gen_logprobs"], np.float64)
  bad = mask & valid[:, None] & ~(np.isfinite(glp) & (glp <= 0))
  if bad.any():
    rows = np.unique(np.nonzero(bad)[0])
    raise ValueError(f"gen_logprobs non-finite or > 0 on {int(bad.sum())} loss tokens "
                     f"(rows {rows[:8].tolist()}...)")


def prepare(batch, spec: RLSpec) -> dict[str, jax.Array]:
  """Full-batch preparation (jit-able). Returns a dict with per-row ``adv [B]``, per-token
  ``weights [B,T]``, and scalars ``dropped_groups``, ``kept_groups``, ``kept_rows``, ``denominator``."""
  prompt_ids = jnp.asarray(batch["prompt_ids"])
  valid = prompt_ids >= 0
  if spec.zero_variance_filter:
    keep, dropped = rl.zero_variance_keep(batch["rewards"], prompt_ids, valid)
  else:
    keep, dropped = valid, jnp.zeros((), jnp.float32)
  adv = rl.group_advantages(batch["rewards"], prompt_ids, keep, spec.adv_norm)
  weights = rl.token_weights(batch["loss_mask"], prompt_ids, keep, spec.aggregation)
  group_size = rl.aggregation.same_group(prompt_ids, keep).sum(axis=1).astype(jnp.float32)
  kept_groups = jnp.sum(jnp.where(keep, 1.0 / jnp.maximum(group_size, 1.0), 0.0))
  return dict(adv=adv, weights=weights, dropped_groups=dropped, kept_groups=kept_groups,
              kept_rows=keep.sum().astype(jnp.float32), denominator=weights.sum())


def split_microbatches(tree, microbatches: int) -> Any:
  """[B, ...] -> [M, B/M, ...] with micro-batch m = rows {m, m + M, m + 2M, ...}.

  Strided (not contiguous) so that when B is sharded over data devices every micro-batch still
  spans all devices. Correctness does not depend on the assignment: the weights are global.
  """
  def split(x) -> jax.Array:
    b = x.shape[0]
    return jnp.swapaxes(x.reshape((b // microbatches, microbatches) + x.shape[1:]), 0, 1)
  return jax.tree.map(split, tree)


def bucket_lengths(T: int, multiple: int, max_buckets: int) -> tuple[int, ...]:
  """Token lengths a micro-batch of a [B, T] batch may be cut to (ascending, the last is T): the
  multiples of `multiple` below T, thinned to at most `max_buckets` evenly spaced ones (each
  is one compiled branch of the step)."""
  T, multiple, max_buckets = int(T), max(1, int(multiple)), max(1, int(max_buckets))
  cands = sorted({min(k * multiple, T) for k in range(1, -(-T // multiple) + 1)} | {T})
  if len(cands) > max_buckets:
    n = len(cands)
    cands = [cands[-(-(i + 1) * n // max_buckets) - 1] for i in range(max_buckets)]
  return tuple(cands)


def needed_lengths(loss_mask) -> np.ndarray:
  """Per row, 1 + the last loss position (0 for a row without loss tokens): positions after it
  cannot change the row's loss or gradient (causal attention)."""
  m = np.asarray(loss_mask).astype(bool)
  last = m.shape[1] - np.argmax(m[:, ::-1], axis=1)
  return np.where(m.any(axis=1), last, 0).astype(np.int32)


def length_sorted_order(loss_mask, microbatches: int) -> np.ndarray:
  """A row permutation after which `split_microbatches`' strided micro-batch m holds the m-th
  run of rows sorted by `needed_lengths` (so each micro-batch can be cut to its own bucket).
  The loss and gradient do not depend on row order (every aggregation is per prompt id / global)."""
  need = needed_lengths(loss_mask)
  b = need.shape[0]
  per = b // microbatches
  order = np.argsort(need, kind="stable")          # sorted position j -> original row
  perm = np.empty(b, np.int64)
  j = np.arange(b)
  perm[(j % per) * microbatches + j // per] = order
  return perm


def microbatch_token_slots(loss_mask, microbatches: int, buckets) -> int:
  """Token slots the learner computes on for a batch (rows x its micro-batch's bucket length),
  as the step's per-micro-batch cut chooses them."""
  need = needed_lengths(loss_mask)
  b = need.shape[0]
  mb_need = need.reshape(b // microbatches, microbatches).max(axis=0)   # strided micro-batches
  buckets = np.asarray(buckets)
  cut = buckets[np.minimum(np.searchsorted(buckets, mb_need), len(buckets) - 1)]
  return int(cut.sum()) * (b // microbatches)
