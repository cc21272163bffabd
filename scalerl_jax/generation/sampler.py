"""Embedded JAX sampler: batched, jitted decoding on the models' KV-cache path.

`JaxSampler` implements the `Generator` interface (generation/generator.py):

* all G samples of all prompts decode together as one batch (prompts left-padded, bucketed to a
  multiple of 16 so few shapes compile);
* temperature / top-p sampling, stop tokens, float32 log-probs from the FP32 LM head;
* forced length interruption (PAPER_NOTES §3): each sample draws a thinking budget uniformly from
  [think_budget_min, think_budget_max]; if it has not closed its thinking by then (interruption.py's
  end-of-thinking rule, shared with vLLM: the text contains `</think>`), the interruption tokens
  are fed in (policy_mask False, log-prob 0) and it gets `answer_budget` more tokens;
* in-flight weight updates: decoding runs in jitted chunks of `chunk_steps` tokens; weights handed to
  `load_weights` (from any thread) are swapped in between chunks, so sequences in progress continue
  with the new weights and their old KV cache, and every later token is stamped with the new version.

Decode speed on CPU (bench.sampler, numbers in docs/VLLM.md): the KV cache is held as one
[B,K,S,H] key and one [B,K,H,S] value buffer per layer (split_cache): XLA updates each in place
inside the fori_loop (a stacked [L,B,S,K,H] cache was copied whole several times per step) and
decode attention is two batched matmuls over (B,K) that contract each buffer's last axis in place.
The cache grows with the sequences (_cache_capacity) so early steps do not attend over empty slots;
cache, prefill and decode state are built by one jitted call (_start); tokens are drawn by
inverting the CDF with one uniform per row (not B*V Gumbels), the uniforms of a whole chunk drawn
before its loop. `devices=N` decodes the rows data-parallel over N local devices (XLA:CPU devices
run concurrently: ~1.2-1.3x on 2 cores).

Log-probs are those of the distribution actually sampled from: log_softmax(logits / T), renormalised
over the top-p nucleus when top_p < 1 (at T = 1, top_p = 1 this is exactly the learner's log π).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.models import hf_io
from scalerl_jax.generation.generator import Generator
from scalerl_jax.generation.interruption import think_budget, think_end_automaton
from scalerl_jax.types import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, Completion, PromptSpec, SamplingSpec

PHASE_THINK, PHASE_FORCE, PHASE_ANSWER = 0, 1, 2   # a row thinks, is being interrupted, answers
_BUCKET = 16


def _chunk_uniforms(rng, step, n_steps: int, n: int, rows):
  """Sampling uniforms [n_steps, n, 1] for decode steps step .. step + n_steps - 1: step t draws
  uniform(fold_in(rng, t)) for the whole batch (one threefry per chunk, not two per step; the same
  numbers whatever the chunking). `rows` = (offset, total) on a batch shard: this shard's slice of
  the total batch's draws (the same numbers as on one device)."""
  total = n if rows is None else rows[1]
  keys = jax.vmap(jax.random.fold_in, (None, 0))(rng, step + jnp.arange(n_steps))
  u = jax.vmap(lambda k: jax.random.uniform(k, (total, 1), jnp.float32))(keys)
  return u if rows is None else jax.lax.dynamic_slice_in_dim(u, rows[0], n, axis=1)


def _inverse_cdf(u, logp):
  """One exact draw per row from softmax(logp) by inverting the CDF with a uniform u [B,1] per row.

  (jax.random.categorical draws B*V Gumbel numbers: ~30x slower on CPU at V=512.) Zero-probability
  tokens (-inf log-prob, e.g. outside the top-p nucleus) add nothing to the CDF: never drawn."""
  cum = jnp.cumsum(jnp.exp(logp), axis=-1)                                   # [B,V]
  u = u * cum[:, -1:]
  token = jnp.sum(cum <= u, axis=-1)
  # Guard against rounding at the top end: the last token with nonzero probability.
  last = logp.shape[-1] - 1 - jnp.argmax(jnp.flip(logp > -jnp.inf, axis=-1), axis=-1)
  return jnp.minimum(token, last).astype(jnp.int32)


def sample_rows(u, logits, temperature, top_p, use_top_p: bool = True) -> tuple[jax.Array, jax.Array]:
  """Samples one token per row with uniforms u [B,1]; returns (token int32 [B], log-prob float32
  [B])."""
  scaled = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  logp = jax.nn.log_softmax(scaled, axis=-1)
  if not use_top_p:   # top_p = 1: no sort over the vocabulary
    token = _inverse_cdf(u, logp)
    return token, jnp.take_along_axis(logp, token[:, None], axis=-1)[:, 0]
  # Top-p: keep the smallest set of tokens whose probability mass reaches top_p.
  order = jnp.argsort(-logp, axis=-1)
  sorted_lp = jnp.take_along_axis(logp, order, axis=-1)
  cum = jnp.cumsum(jnp.exp(sorted_lp), axis=-1)
  keep_sorted = (cum - jnp.exp(sorted_lp)) < top_p           # mass before this token < top_p
  keep = jnp.zeros_like(keep_sorted).at[
      jnp.arange(logp.shape[0])[:, None], order].set(keep_sorted)
  masked = jnp.where(keep, logp, -jnp.inf)
  nucleus_lp = jax.nn.log_softmax(masked, axis=-1)
  token = _inverse_cdf(u, nucleus_lp)
  lp = jnp.take_along_axis(nucleus_lp, token[:, None], axis=-1)[:, 0]
  return token, lp


_ROWS = "rows"   # the sampler's own batch mesh axis (decoding split over local devices)
_REPLICATED = ("rng", "step", "logit_version")


def _state_specs(state):
  """PartitionSpecs of a decode state (or the cache alone): per-row arrays split over _ROWS."""
  P = jax.sharding.PartitionSpec
  def spec(path, leaf) -> jax.sharding.PartitionSpec:
    name = path[-1].key if isinstance(path[-1], jax.tree_util.DictKey) else path[0].key
    if name in _REPLICATED or name == "index":
      return P()
    return P(None, _ROWS) if leaf.ndim == 5 else P(_ROWS)   # stacked [L,B,S,K,H] cache
  return jax.tree_util.tree_map_with_path(spec, state)


def _on_rows(fn, mesh, in_specs, out_specs):
  """`fn` run per batch shard over `mesh` (shard_map), or as is when `mesh` is None."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)


@functools.partial(jax.jit, static_argnums=(1, 3, 5, 6), donate_argnums=(2,))
def _decode_chunk(params, cfg, state, n_steps, consts, use_top_p=True, mesh=None):
  """Runs `n_steps` sampling steps on the whole batch (see JaxSampler.generate for the state);
  returns (state, all rows done [n_shards]). The state (incl. the KV cache) is donated: updated in
  place. With a `mesh`, each device decodes its slice of the rows (no cross-device traffic but the
  done flags); the sampling uniforms are those of the whole batch, so tokens equal one device's."""
  P = jax.sharding.PartitionSpec
  fn = functools.partial(_chunk_steps, cfg=cfg, n_steps=n_steps, use_top_p=use_top_p,
                         sharded=mesh is not None)
  specs = _state_specs(state)
  return _on_rows(fn, mesh, (P(), specs, P()), (specs, P(_ROWS)))(params, state, consts)


def advance_rows(s, sampled, lp, interrupt, stop, answer_budget, end, room) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
  """One decode step's per-row bookkeeping, shared by the drain (`_chunk_steps`) and continuous
  (generation/continuous.py) decoders: the token each row emits (the sampled one, or the next
  interruption token while forcing, log-prob 0), and the rows' new length / phase / budget
  counters / done flags.

  `s`: the decode state's per-row arrays (length, phase, think_count, think_state, force_idx,
  answer_count, budget, done, interrupted, stopped); `answer_budget`: a scalar or one per row;
  `end`: the end-of-thinking automaton (columns, next_state, hit); `room`: the most tokens a
  completion may hold. Returns (token, lp, live, forcing, fields)."""
  end_cols, end_next, end_hit = end
  n_int = interrupt.shape[0]
  forcing = s["phase"] == PHASE_FORCE
  forced_tok = interrupt[jnp.clip(s["force_idx"], 0, n_int - 1)]
  token = jnp.where(forcing, forced_tok, sampled)
  lp = jnp.where(forcing, 0.0, lp)
  live = ~s["done"]
  length = s["length"] + live.astype(jnp.int32)
  is_stop = jnp.any(token[:, None] == stop[None, :], axis=-1) & ~forcing
  thinking = s["phase"] == PHASE_THINK
  # End of thinking: interruption.py's automaton (the text so far contains </think>), one table
  # lookup per token whatever the number of tokens "</think>" takes.
  end_col = end_cols[token]
  closes = thinking & end_hit[s["think_state"], end_col]
  think_state = jnp.where(thinking, end_next[s["think_state"], end_col], s["think_state"])
  think_count = s["think_count"] + (thinking & live).astype(jnp.int32)
  start_force = thinking & ~closes & (think_count >= s["budget"]) & ~is_stop
  force_idx = jnp.where(forcing, s["force_idx"] + 1, jnp.where(start_force, 0, s["force_idx"]))
  finished_force = forcing & (force_idx >= n_int)
  phase = jnp.where(closes | finished_force, PHASE_ANSWER,
                    jnp.where(start_force, PHASE_FORCE, s["phase"]))
  answering = (s["phase"] == PHASE_ANSWER) & live
  answer_count = s["answer_count"] + answering.astype(jnp.int32)
  out_of_room = length >= room
  done = s["done"] | (live & (is_stop | (answer_count >= answer_budget) | out_of_room))
  fields = dict(length=length, think_count=think_count, think_state=think_state,
                force_idx=force_idx, phase=phase, answer_count=answer_count, done=done,
                interrupted=s["interrupted"] | (start_force & live),
                stopped=s["stopped"] | (live & is_stop))
  return token, lp, live, forcing, fields


def write_outputs(s, col, live, token, lp, forcing) -> dict:
  """A decode step's outputs written at column `col` of the live rows' [B, L] buffers (one
  in-place column update per buffer, not a scatter): tokens, log-probs, the policy mask, and the
  version of the logits each token was sampled from (`s["logit_version"]`, one or one per row: a
  token belongs to the policy whose forward pass produced its logits). Shared by the drain and
  continuous decoders."""
  def write(buf, val) -> jax.Array:
    old = jax.lax.dynamic_slice_in_dim(buf, col, 1, axis=1)[:, 0]
    return jax.lax.dynamic_update_slice_in_dim(buf, jnp.where(live, val, old)[:, None], col, 1)
  return dict(tokens=write(s["tokens"], token), logprobs=write(s["logprobs"], lp),
              versions=write(s["versions"], jnp.broadcast_to(s["logit_version"], token.shape)),
              policy=write(s["policy"], ~forcing))


def _chunk_steps(params, state, consts, *, cfg, n_steps, use_top_p, sharded):
  interrupt, stop, temperature, top_p, answer_budget, version, end_cols, end_next, end_hit = consts
  rows = None
  if sharded:   # this shard's rows of the whole batch: same uniforms as one device draws
    b = state["done"].shape[0]
    rows = (jax.lax.axis_index(_ROWS) * b, b * jax.lax.axis_size(_ROWS))

  step0 = state["step"]
  uniforms = _chunk_uniforms(state["rng"], step0, n_steps, state["done"].shape[0], rows)

  def body(i, s) -> dict[str, Any]:
    sampled, lp = sample_rows(uniforms[i], s["logits"], temperature, top_p, use_top_p)
    token, lp, live, forcing, fields = advance_rows(
        s, sampled, lp, interrupt, stop, answer_budget, (end_cols, end_next, end_hit),
        room=s["tokens"].shape[1])
    # Every live row's next token goes to column step0 + i (all rows start together and advance
    # one token per step until done): one in-place column update per buffer, not a scatter.
    col = step0 + i
    out: dict[str, Any] = dict(s, **fields, **write_outputs(s, col, live, token, lp, forcing))
    if "routes" in s:   # routing replay: the fed token's chosen experts per MoE layer
      logits, cache, routes = models.decode_step(params, cfg, jnp.where(live, token, 0),
                                                 s["cache"], return_routes=True)
      old = jax.lax.dynamic_slice_in_dim(s["routes"], col, 1, axis=1)[:, 0]
      out["routes"] = jax.lax.dynamic_update_slice_in_dim(
          s["routes"], jnp.where(live[:, None, None], routes, old)[:, None], col, 1)
    else:
      logits, cache = models.decode_step(params, cfg, jnp.where(live, token, 0), s["cache"])
    out["logits"], out["cache"] = logits, cache
    out["logit_version"] = version
    return out

  state = jax.lax.fori_loop(0, n_steps, body, state)
  state["step"] = step0 + n_steps
  return state, jnp.all(state["done"])[None]


def split_cache(cache) -> dict[str, Any]:
  """models.init_cache layout -> the same cache with k, v as tuples of per-layer arrays, keys
  [B,K,S,H] and values transposed [B,K,H,S] (both decode dots then contract the stored last axis:
  XLA:CPU copied a [B,K,S,H] value cache into [B,K,H,S] every step).

  The (unscanned) model accepts either form and returns the form it was given. Per-layer buffers
  are updated in place inside the decode loop (a stacked [L,...] cache was copied whole several
  times per step), and the heads-major [B,K,S,H] layout makes decode attention two batched matmuls
  over (B,K) reading the cache in place (the [B,S,K,H] layout needs a transpose or a broadcast
  multiply-reduce: ~2x slower per cache slot on CPU)."""
  return dict(cache, k=tuple(jnp.transpose(x, (0, 2, 1, 3)) for x in cache["k"]),
              v=tuple(jnp.transpose(x, (0, 2, 3, 1)) for x in cache["v"]))


def _rows_mesh(devices) -> jax.sharding.Mesh | None:
  """JaxSampler's `devices` option -> a 1-D mesh over _ROWS, or None for one device."""
  if devices is None:
    return None
  local = jax.local_devices()
  if devices == "auto":
    devs = local
  elif isinstance(devices, int):
    if not 1 <= devices <= len(local):
      raise ValueError(f"devices={devices}: this process has {len(local)} local devices")
    devs = local[:devices]
  else:
    devs = list(devices)
  return None if len(devs) <= 1 else jax.sharding.Mesh(np.array(devs), (_ROWS,))


_MIN_CACHE = 32


def _cache_capacity(needed: int, total: int) -> int:
  """Cache slots to allocate for `needed` slots, <= total: `needed` rounded up to a multiple of
  max(32, 2^(bits(needed) - 3)), i.e. at most ~1/8 (or 31 slots) of attention over empty slots and
  ~8 shapes (decode-chunk compilations) per doubling of the length."""
  step = max(_MIN_CACHE, 1 << max(0, needed.bit_length() - 3))
  return min(-(-needed // step) * step, total)


@functools.partial(jax.jit, static_argnums=(1,))
def _grow_cache(cache, size: int):
  """A split cache (see split_cache) with `size` slots: empty slots appended (pos -1)."""
  def pad(a, fill, axis) -> jax.Array:
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths, constant_values=fill)
  return dict(cache, k=tuple(pad(a, 0, 2) for a in cache["k"]),
              v=tuple(pad(a, 0, 3) for a in cache["v"]), pos=pad(cache["pos"], -1, 1))


@functools.partial(jax.jit, static_argnums=(1, 7, 8, 9, 10, 11, 12, 13))
def _start(params, cfg, tokens, mask, budget, rng, version, cap, L, kv_dtype, split,
           phase, mesh, record_routes):
  """Empty `cap`-slot cache (split per layer if `split`), prompt prefill and the decode state;
  with a `mesh`, each device builds its slice of the rows (see _decode_chunk). `record_routes`:
  the state also holds the prompt's and the completion's chosen experts (routing replay)."""
  P = jax.sharding.PartitionSpec
  fn = functools.partial(_start_rows, cfg=cfg, cap=cap, L=L, kv_dtype=kv_dtype, split=split,
                         phase=phase, record_routes=record_routes)
  args = (params, tokens, mask, budget, rng, version)
  if mesh is None:
    return fn(*args)
  out = jax.eval_shape(fn, *args)
  return _on_rows(fn, mesh, (P(), P(_ROWS), P(_ROWS), P(_ROWS), P(), P()),
                  _state_specs(out))(*args)


def _start_rows(params, tokens, mask, budget, rng, version, *, cfg, cap, L, kv_dtype,
                split, phase, record_routes):
  B = tokens.shape[0]
  cache = models.init_cache(cfg, B, cap, dtype=kv_dtype)
  if split:
    cache = split_cache(cache)   # per-layer buffers, updated in place
  extra = {}
  if record_routes:
    logits, cache, prompt_routes = models.prefill(params, cfg, tokens, cache, mask,
                                                  return_routes=True)
    extra = dict(prompt_routes=prompt_routes, routes=jnp.zeros(
        (B, L, *prompt_routes.shape[2:]), jnp.int32))
  else:
    logits, cache = models.prefill(params, cfg, tokens, cache, mask)
  z = lambda dt: jnp.zeros((B,), dt)
  return dict(**extra,
      rng=rng, logits=logits[:, -1], cache=cache,
      tokens=jnp.zeros((B, L), jnp.int32), logprobs=jnp.zeros((B, L), jnp.float32),
      versions=jnp.zeros((B, L), jnp.int32), policy=jnp.zeros((B, L), bool),
      length=z(jnp.int32), think_count=z(jnp.int32), force_idx=z(jnp.int32),
      phase=jnp.full((B,), phase, jnp.int32), answer_count=z(jnp.int32), budget=budget,
      think_state=z(jnp.int32), done=z(bool), interrupted=z(bool),
      stopped=z(bool), logit_version=version, step=jnp.zeros((), jnp.int32))


class JaxSampler(Generator):
  """Batched jitted sampler on the JAX model; see the module docstring."""

  def __init__(self, cfg: models.ModelConfig, params, version: int = 0,
               chunk_steps: int = common.Generator.chunk_steps,
               end_think_token: int | None = None, kv_dtype: str = "float32",
               devices: int | str | Sequence | None = None,
               record_routes: bool = common.RL.record_routes):
    """`kv_dtype`: KV-cache storage ("float32" default: log-probs equal the learner's forward to
    float32 rounding; "bfloat16" halves cache reads, see docs/ROLLOUT.md for its log-prob error).

    `devices`: decode data-parallel over several local devices (each gets a slice of the rows,
    params replicated): an int (the first n local devices), "auto" (all local devices), or a list
    of devices. Default None: one device. Same tokens as one device (the sampling uniforms are
    drawn for the whole batch); log-probs equal to float32 rounding.

    `record_routes` (MoE; routing replay, rl.routing_replay): every Completion also carries
    `routes` int32 [P+L, R, K], the experts each prompt and completion token was routed to in
    each of the R MoE layers (the last token's are those of its own forward step, which only
    feeds the logits after the sequence)."""
    if record_routes and not cfg.is_moe:
      raise ValueError("record_routes needs an MoE model")
    self.record_routes = bool(record_routes)
    self.cfg = cfg
    self.kv_dtype = kv_dtype
    self._mesh = _rows_mesh(devices)
    self._params = self._place(params)
    self._version = int(version)
    self._pending = None
    self._lock = threading.Lock()
    self.chunk_steps = int(chunk_steps)
    self.end_think_token = end_think_token
    self.on_chunk = None  # optional callback(chunk_index) for tests / in-flight update hooks

  @property
  def num_devices(self) -> int:
    """Devices the batch is decoded on (see `devices`)."""
    return 1 if self._mesh is None else self._mesh.size

  def _place(self, params):
    """Params on our device(s): replicated over the rows mesh (a no-op when already there)."""
    if self._mesh is None:
      return jax.tree.map(jax.device_put, params)   # adopts aligned host arrays on CPU
    rep = jax.sharding.NamedSharding(self._mesh, jax.sharding.PartitionSpec())
    return jax.device_put(params, rep)

  @property
  def version(self) -> int:
    return self._version

  @property
  def params(self) -> Any:
    return self._params

  def load_params(self, params, version: int, model_cfg=None) -> None:
    """Our layout already: queued as is (`set_params`); `model_cfg` is unused."""
    del model_cfg
    self.set_params(params, version)

  def set_params(self, params, version: int) -> None:
    """Queues our-layout params as policy `version`; applied between decode chunks.

    The host -> device conversion happens here, in the caller's thread, so the swap between
    chunks is a pointer swap and does not stall decoding. It is `jax.device_put`: on CPU a
    64-byte aligned numpy leaf (weights.stream's fetch arrays) is adopted without a copy, so the
    caller must not modify such arrays afterwards."""
    params = self._place(params)
    with self._lock:
      self._pending = (params, int(version))

  def load_weights(self, weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                   version: int) -> None:
    """Takes HF-named arrays (the weight interchange format) as policy `version`."""
    named = dict(weights.items() if isinstance(weights, Mapping) else weights)

    def get(name) -> Any:
      if name not in named:
        raise ValueError(f"weight update for version {version} lacks tensor {name!r}")
      return named[name]

    self.set_params(hf_io.params_from_hf_tensors(self.cfg, get), version)

  def apply_pending(self) -> None:
    """Swaps in the newest queued version (within `max_version`); called between decode chunks."""
    with self._lock:
      pending = self._pending
      if pending is None or (self.max_version is not None and pending[1] > self.max_version):
        return
      self._pending = None
    if pending is not None:
      params, version = pending
      self._params = self._place(params)
      self._version = version

  def generate(self, prompts: Sequence[PromptSpec], n: int,
               spec: SamplingSpec) -> list[list[Completion]]:
    """Samples `n` completions for each prompt; returns one group (list) per prompt."""
    if n <= 0 or not prompts:
      raise ValueError(f"need n > 0 and at least one prompt (got n={n}, {len(prompts)} prompts)")
    self.apply_pending()
    rows = [p for p in prompts for _ in range(n)]
    B = len(rows)
    B_pad = -(-B // self.num_devices) * self.num_devices   # rows split evenly over devices
    P = max(len(p.tokens) for p in rows)
    P = -(-P // _BUCKET) * _BUCKET
    n_int = len(spec.interruption_tokens)
    L = spec.think_budget_max + n_int + spec.answer_budget
    L = -(-L // _BUCKET) * _BUCKET
    if P + L > self.cfg.max_position_embeddings:
      raise ValueError(f"prompt {P} + completion {L} tokens exceed the model's "
                       f"{self.cfg.max_position_embeddings} positions")
    tokens = np.zeros((B_pad, P), np.int32)
    mask = np.zeros((B_pad, P), bool)
    for i, p in enumerate(rows + rows[-1:] * (B_pad - B)):   # padding rows: dropped at the end
      t = np.asarray(p.tokens, np.int32)
      if t.ndim != 1 or len(t) == 0:
        raise ValueError(f"prompt {p.prompt_id}: tokens must be a non-empty 1-D array")
      tokens[i, P - len(t):] = t
      mask[i, P - len(t):] = True
    sample_index = [j for _ in prompts for j in range(n)]
    budget = np.array([think_budget(spec.seed, p.prompt_id, j, spec.think_budget_min,
                                    spec.think_budget_max) for p, j in zip(rows, sample_index)])
    budget = np.concatenate([budget, budget[-1:].repeat(B_pad - B)])
    # Where thinking ends: interruption.py's rule (shared with the vLLM worker).
    end_ids = spec.think_end_tokens or (() if self.end_think_token is None
                                        else (self.end_think_token,))
    end = think_end_automaton(end_ids, spec.think_end_text, spec.think_end_vocab)
    end_consts = (end.columns(self.cfg.vocab_size), end.next_state, end.hit)
    # The cache grows with the sequences (see _cache_capacity): every decode step
    # attends over all allocated slots, so a cache sized for the longest completion from the start
    # would make early steps read mostly empty slots. Scanned-layer models keep one full cache.
    grow = not self.cfg.scan_layers
    cap = _cache_capacity(P + min(self.chunk_steps, L), P + L) if grow else P + L
    # One jitted call builds the cache, runs the prompt and the whole state (no per-array
    # dispatches); host scalars go in as numpy values (no device ops to create them).
    state = _start(self._params, self.cfg, tokens, mask, budget.astype(np.int32),
                   jax.random.PRNGKey(spec.seed), np.int32(self._version),
                   cap, L, self.kv_dtype, grow, PHASE_ANSWER if not n_int else PHASE_THINK,
                   self._mesh, self.record_routes)
    interrupt = np.asarray(list(spec.interruption_tokens) or [0], np.int32)
    stop = np.asarray(list(spec.stop_tokens) or [-1], np.int32)
    # Without interruption tokens there is no thinking phase: the whole completion is the answer.
    answer_budget = spec.answer_budget if n_int else L
    chunk = 0
    for start in range(0, L, self.chunk_steps):
      if grow and cap < P + min(start + self.chunk_steps, L):
        cap = _cache_capacity(P + min(start + self.chunk_steps, L), P + L)
        state["cache"] = _grow_cache(state["cache"], cap)
      consts = (interrupt, stop, np.float32(spec.temperature), np.float32(spec.top_p),
                np.int32(answer_budget), np.int32(self._version)) + end_consts
      state, all_done = _decode_chunk(self._params, self.cfg, state,
                                      min(self.chunk_steps, L - start), consts, spec.top_p < 1.0,
                                      self._mesh)
      chunk += 1
      if self.on_chunk is not None:
        self.on_chunk(chunk)
      if np.asarray(all_done).all():
        break
      self.apply_pending()
    keys = ("tokens", "logprobs", "versions", "policy", "length", "interrupted", "stopped")
    keys += ("prompt_routes", "routes") if self.record_routes else ()
    host = jax.device_get({k: state[k] for k in keys})
    groups: list[list[Completion]] = [[] for _ in prompts]
    for i in range(B):
      n_tok = int(host["length"][i])
      reason = (FINISH_INTERRUPTED if host["interrupted"][i]
                else FINISH_STOP if host["stopped"][i] else FINISH_LENGTH)
      groups[i // n].append(Completion(
          prompt_id=rows[i].prompt_id, tokens=host["tokens"][i, :n_tok].copy(),
          logprobs=host["logprobs"][i, :n_tok].copy(), versions=host["versions"][i, :n_tok].copy(),
          policy_mask=host["policy"][i, :n_tok].copy(), finish_reason=reason,
          routes=None if not self.record_routes else np.concatenate(
              [host["prompt_routes"][i, P - len(rows[i].tokens):], host["routes"][i, :n_tok]])))
    return groups
