"""Continuous batching for the embedded JAX sampler: a fixed number of sequence slots kept full.

`JaxSampler.generate` decodes one static batch and returns when its longest sequence ends; with
think budgets drawn from [lo, hi] and answers of any length the batch empties long before that
(uniform lengths in [L/8, L] keep ~56 % of the slots busy). `ContinuousDecoder` keeps
`capacity` slots decoding: when a sequence ends its slot takes the next waiting sample, whose
prompt is prefilled into that slot between decode chunks (JetStream's insert-and-generate).

Layout (one device; the sampler's split KV cache, per-layer keys [B,K,S,H], values [B,K,H,S]):

* cache columns [0, P) hold each slot's prompt (left-padded to the decoder's prompt width P);
  columns [P, P + R) are a ring shared by all slots: decode step g writes every slot's new token
  at column P + g mod R (one in-place column update per buffer, as in the static sampler), with
  R >= the longest completion L, so a sequence never overwrites its own tokens. Attention masks
  come from positions (models/attention.py), not from column order: a slot's positions are set at
  its insertion (prompt 0..n-1, every other column -1 = empty), so what an earlier sequence left in
  the ring is never attended to.
* the outputs (tokens, log-probs, versions, policy mask) use the same ring [B, R]; a finished
  slot's completion is read from columns (start + t) mod R.
* a chunk decodes only a bucket of rows (capacity, /2, /4, /8: `row_buckets`), the busy slots
  packed into it: when they would fit a smaller bucket, the ones above it are moved down
  (`_move`, a copy of their rows). Under PipelineRL-k admission most slots are often empty; the
  first version decoded all of them (2026-12-04, commit 9b375a9, 2-core AMD EPYC: the tailed tiny run took 266 s vs 195 s drained).
* attention reads a window of the ring while the samples in flight are young: the prompt columns
  and the ring columns of decode steps [first, first + W), `first` the oldest busy sample's start,
  W the smallest of 2, 4, 8 ... chunks (below R) that reaches the chunk's end; gathered once per
  chunk, the chunk's new columns written back. One old sample in flight means the whole ring.
* an insertion prefills each distinct prompt once (a group's samples share their prompt) into a
  prompt bank (a prefix cache of the last `capacity` prompts, for the current weights version)
  and copies its KV to their slots; a later insertion of the same prompt (the group's other
  samples, as slots free) copies it from the bank without prefilling again. Its memory: the
  prompt columns of the cache once more (capacity x P).
* a chunk is up to `chunk_steps` decode steps; while samples wait for slots (`step(refill=True)`)
  it ends after the step at which `stop_after` of its samples finished (default capacity / 8), so
  a finished sample's slot does not idle to the chunk's end (half a chunk per sample on average).
* randomness is per sample, not per slot or step: token t of sample j of prompt p draws
  uniform(fold_in(key(seed, p, j), t)). The same request decodes to the same tokens whatever the
  slot, the neighbours and the moment it was inserted (log-probs equal to float32 rounding: the
  attention sums run over the columns in another order).
* in-flight weight updates keep their meaning: `sampler.apply_pending()` runs between chunks;
  each slot's pending logits carry the version that computed them (a prompt inserted after a
  swap is prefilled with the new weights), every token is stamped with it, and old KV is kept.

Not here (the static sampler does them): routing replay (`record_routes`), several devices, and
scanned-layer models; `ContinuousDecoder` refuses those with one line.
"""
from __future__ import annotations

import collections
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from scalerl_jax import models
from scalerl_jax.generation import sampler as sampler_lib
from scalerl_jax.generation.interruption import think_end_automaton
from scalerl_jax.generation.slots import DecodeStats, SlotRequest, drive
from scalerl_jax.types import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, Completion, SamplingSpec

_BUCKET = 16


def _row_keys(seeds, prompt_ids, samples):
  """The per-sample PRNG keys: fold_in(fold_in(PRNGKey(seed), prompt id), sample index)."""
  one = lambda s, p, j: jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(s), p), j)
  return jax.vmap(one)(seeds, prompt_ids, samples)


def _row_uniforms(keys, lengths, n_steps: int):
  """[n_steps, B, 1] uniforms: step i of a live row draws for its token number length + i."""
  t = lengths[None, :] + jnp.arange(n_steps, dtype=jnp.int32)[:, None]
  one = lambda k, i: jax.random.uniform(jax.random.fold_in(k, i), (), jnp.float32)
  return jax.vmap(jax.vmap(one))(jnp.broadcast_to(keys, (n_steps, *keys.shape)), t)[..., None]


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _empty(cfg, B: int, P: int, R: int, kv_dtype: str):
  """A decode state with `B` free slots, prompt width `P` and ring `R` (see module doc)."""
  cache = sampler_lib.split_cache(models.init_cache(cfg, B, P + R, dtype=kv_dtype))
  zi = lambda: jnp.zeros((B,), jnp.int32)
  return dict(
      cache=cache, logits=jnp.zeros((B, cfg.vocab_size), jnp.float32),
      keys=jnp.zeros((B, 2), jnp.uint32), logit_version=zi(),
      tokens=jnp.zeros((B, R), jnp.int32), logprobs=jnp.zeros((B, R), jnp.float32),
      versions=jnp.zeros((B, R), jnp.int32), policy=jnp.zeros((B, R), bool),
      length=zi(), think_count=zi(), force_idx=zi(), phase=zi(), answer_count=zi(),
      budget=zi(), answer_budget=zi(), think_state=zi(), done=jnp.ones((B,), bool),
      interrupted=jnp.zeros((B,), bool), stopped=jnp.zeros((B,), bool),
      g=jnp.zeros((), jnp.int32))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _empty_bank(cfg, Q: int, P: int, kv_dtype: str):
  """A prompt bank of `Q` rows: the prefilled KV [Q, ...] of prompts of width `P` and each one's
  next-token logits [Q, V] (see ContinuousDecoder.insert)."""
  return dict(cache=sampler_lib.split_cache(models.init_cache(cfg, Q, P, dtype=kv_dtype)),
              logits=jnp.zeros((Q, cfg.vocab_size), jnp.float32))


@functools.partial(jax.jit, static_argnums=(1,), donate_argnums=(2,))
def _prefill_bank(params, cfg, bank, rows, tokens, mask):
  """Prefills u prompts [u, P] and writes them to bank rows `rows` [u] (a row >= Q is padding:
  dropped)."""
  small = sampler_lib.split_cache(models.init_cache(cfg, tokens.shape[0], tokens.shape[1],
                                                    dtype=bank["cache"]["k"][0].dtype))
  logits, small = models.prefill(params, cfg, tokens, small, mask)
  put = lambda big, val: big if big.ndim == 0 else big.at[rows].set(val, mode="drop")
  return dict(cache=jax.tree_util.tree_map(put, bank["cache"], small),
              logits=put(bank["logits"], logits[:, -1]))


@functools.partial(jax.jit, static_argnums=(0, 11), donate_argnums=(1,))
def _insert(cfg, state, bank, slots, src, budget, answer_budget, seeds, prompt_ids, samples,
            version, phase0: int):
  """Puts bank row `src[i]` (a prefilled prompt) into slot `slots[i]` (k of them; a slot index
  >= B is padding: dropped): a group's samples share their prompt's prefill. Each slot's prompt
  goes to cache columns [0, P); its ring columns become empty. `version`: the weights version
  that prefilled the bank (the bank holds one version), stamped on each slot's first logits."""
  k = slots.shape[0]
  cache = state["cache"]
  S = cache["pos"].shape[1]
  small = jax.tree_util.tree_map(lambda x: x if x.ndim == 0 else x[src], bank["cache"])
  P = small["pos"].shape[1]
  logits = bank["logits"][src]
  put = lambda big, val: big.at[slots].set(val, mode="drop")
  new_cache = dict(
      cache,
      k=tuple(big.at[slots, :, :P, :].set(sm, mode="drop")
              for big, sm in zip(cache["k"], small["k"])),
      v=tuple(big.at[slots, :, :, :P].set(sm, mode="drop")
              for big, sm in zip(cache["v"], small["v"])),
      pos=put(cache["pos"], jnp.concatenate(
          [small["pos"], jnp.full((k, S - P), -1, jnp.int32)], axis=1)),
      next_pos=put(cache["next_pos"], small["next_pos"]))
  zero = jnp.zeros((k,), jnp.int32)
  out = dict(state, cache=new_cache, logits=put(state["logits"], logits),
             keys=put(state["keys"], _row_keys(seeds, prompt_ids, samples)),
             logit_version=put(state["logit_version"], jnp.full((k,), version, jnp.int32)),
             budget=put(state["budget"], budget),
             answer_budget=put(state["answer_budget"], answer_budget),
             phase=put(state["phase"], jnp.full((k,), phase0, jnp.int32)),
             done=put(state["done"], jnp.zeros((k,), bool)),
             interrupted=put(state["interrupted"], jnp.zeros((k,), bool)),
             stopped=put(state["stopped"], jnp.zeros((k,), bool)))
  for name in ("length", "think_count", "force_idx", "answer_count", "think_state"):
    out[name] = put(state[name], zero)
  return out


def _rows(state, n: int):
  """Rows [:n] of every per-slot array of a decode state (scalars: the step counter `g` is
  shared by all slots)."""
  return jax.tree_util.tree_map(lambda x: x if x.ndim == 0 else x[:n], state)


def _put_rows(state, sub):
  """`state` with rows [:n] of every per-slot array (and the shared scalars) taken from `sub`."""
  return jax.tree_util.tree_map(
      lambda big, small: small if big.ndim == 0 else big.at[:small.shape[0]].set(small),
      state, sub)


def _cache_view(cache, rows: int, cols):
  """Rows [:rows] of the KV cache, and with `cols` [C] only those columns (keys [b,K,C,H],
  values [b,K,H,C], positions [b,C]); `cols` None: every column."""
  if cols is None:
    return _rows(cache, rows)
  return dict(cache, k=tuple(x[:rows][:, :, cols, :] for x in cache["k"]),
              v=tuple(x[:rows][..., cols] for x in cache["v"]),
              pos=cache["pos"][:rows][:, cols], next_pos=cache["next_pos"][:rows])


def _cache_put(cache, view, cols, src, dst):
  """Writes a decoded view back: with `cols` None all of its rows; else its columns `src` (the
  ones this chunk wrote) to the cache's columns `dst`."""
  if cols is None:
    return _put_rows(cache, view)
  b = view["next_pos"].shape[0]
  return dict(cache, k=tuple(big.at[:b, :, dst, :].set(sm[:, :, src, :])
                             for big, sm in zip(cache["k"], view["k"])),
              v=tuple(big.at[:b, :, :, dst].set(sm[..., src])
                      for big, sm in zip(cache["v"], view["v"])),
              pos=cache["pos"].at[:b, dst].set(view["pos"][:, src]),
              next_pos=cache["next_pos"].at[:b].set(view["next_pos"]))


@functools.partial(jax.jit, donate_argnums=(0,))
def _move(state, src, dst):
  """Copies slot rows `src` [k] to slots `dst` [k] (a dst >= B is padding: dropped): packs the
  live slots low, so that decoding a prefix of the slots decodes all of them."""
  return jax.tree_util.tree_map(
      lambda x: x if x.ndim == 0 else x.at[dst].set(x[src], mode="drop"), state)


@functools.partial(jax.jit, static_argnums=(1, 3, 4, 5, 7, 8), donate_argnums=(2,))
def _decode(params, cfg, state, n_steps: int, room: int, use_top_p: bool, consts, rows: int,
            width: int, first, stop_after):
  """Up to `n_steps` decode steps of slots [0, rows) (the live ones are packed there: `rows` is a
  bucket, so few shapes compile); a finished or free slot computes but changes nothing of its
  outputs. `stop_after` > 0 (traced: no recompiles) ends the chunk after the step at which that
  many samples have finished in it. `width` > 0: attention reads only the prompt columns and the
  `width` ring columns of decode steps [first, first + width) (every live sample started at or
  after `first`, and first + width >= g + n_steps), gathered once per chunk; 0: every ring
  column. Returns (state, done [B], length [B], steps run)."""
  interrupt, stop, temperature, top_p, version, end_cols, end_next, end_hit = consts
  full = state
  R = full["tokens"].shape[1]
  P = full["cache"]["pos"].shape[1] - R
  g0 = full["g"]
  steps = jnp.arange(n_steps, dtype=jnp.int32)
  if width:
    cols = jnp.concatenate([jnp.arange(P, dtype=jnp.int32),
                            P + (first + jnp.arange(width, dtype=jnp.int32)) % R])
    base = P + g0 - first            # the view's column of decode step g0
  else:
    cols = None
  state = dict(_rows({k: v for k, v in full.items() if k != "cache"}, rows),
               cache=_cache_view(full["cache"], rows, cols))
  uniforms = _row_uniforms(state["keys"], state["length"], n_steps)

  def body(i, s) -> dict[str, Any]:
    sampled, lp = sampler_lib.sample_rows(uniforms[i], s["logits"], temperature, top_p, use_top_p)
    token, lp, live, forcing, fields = sampler_lib.advance_rows(
        s, sampled, lp, interrupt, stop, s["answer_budget"], (end_cols, end_next, end_hit), room)
    col = (g0 + i) % R
    out: dict[str, Any] = dict(s, **fields, **sampler_lib.write_outputs(s, col, live, token, lp,
                                                                         forcing))
    cache = dict(s["cache"], index=base + i if width else P + col)
    out["logits"], out["cache"] = models.decode_step(params, cfg, jnp.where(live, token, 0), cache)
    out["logit_version"] = jnp.full_like(s["logit_version"], version)
    return out

  done0 = state["done"]

  def more(c) -> jax.Array:
    i, s = c
    ended = jnp.sum(s["done"] & ~done0)
    return (i < n_steps) & ((stop_after <= 0) | (ended < stop_after))

  # The columns of steps not run are written back unchanged (the view holds what it gathered).
  n_run, state = jax.lax.while_loop(more, lambda c: (c[0] + 1, body(c[0], c[1])),
                                    (jnp.int32(0), state))
  state["g"] = g0 + n_run
  cache = _cache_put(full["cache"], state.pop("cache"), cols,
                     base + steps if width else None, P + (g0 + steps) % R)
  state = dict(_put_rows({k: v for k, v in full.items() if k != "cache"}, state), cache=cache)
  return state, state["done"], state["length"], n_run


def default_stop_after(capacity: int) -> int:
  """ContinuousDecoder's default `stop_after` for `capacity` slots: capacity / 8, at least 1."""
  return max(1, int(capacity) // 8)


class ContinuousDecoder:
  """`capacity` decode slots on a JaxSampler's model and weights; see the module docstring.

  `spec` fixes what all samples share (temperature, top_p, stop and interruption tokens, the
  end-of-thinking rule); the budgets are per request (`SlotRequest`). `max_prompt_len`: the
  prompt width P (rounded up to a multiple of 16); `max_completion_len`: the ring R (default
  spec.think_budget_max + interruption tokens + spec.answer_budget, rounded up to 16), the most
  tokens a completion may hold.

      dec = ContinuousDecoder(sampler, capacity=64, spec=spec, max_prompt_len=64)
      dec.insert(requests[:dec.free])           # as many as there are free slots
      for req, completion in dec.step(): ...    # one chunk of decoding; the finished samples
  """

  def __init__(self, sampler: "sampler_lib.JaxSampler", capacity: int, spec: SamplingSpec,
               max_prompt_len: int, max_completion_len: int | None = None,
               chunk_steps: int | None = None, row_buckets: int = 4, windows: bool = True,
               stop_after: int | None = None):
    if sampler.record_routes:
      raise ValueError("continuous batching does not record MoE routes (routing replay): use "
                       "generator.continuous=False")
    if sampler.num_devices != 1:
      raise ValueError(f"continuous batching decodes on one device, the sampler has "
                       f"{sampler.num_devices} (generator.jax_devices)")
    if sampler.cfg.scan_layers:
      raise ValueError("continuous batching needs an unscanned model (model.scan_layers=False)")
    if capacity <= 0 or row_buckets <= 0:
      raise ValueError(f"capacity and row_buckets must be positive, got {capacity}, {row_buckets}")
    self.sampler, self.cfg, self.spec = sampler, sampler.cfg, spec
    self.capacity = int(capacity)
    # Decoded row counts: capacity, capacity/2, ... (`row_buckets` sizes, one compile each).
    self.buckets = sorted({-(-self.capacity // 2 ** i) for i in range(int(row_buckets))})
    self.P = -(-int(max_prompt_len) // _BUCKET) * _BUCKET
    self.n_int = len(spec.interruption_tokens)
    L = int(max_completion_len or spec.think_budget_max + self.n_int + spec.answer_budget)
    self.room = L
    self.R = -(-L // _BUCKET) * _BUCKET
    if self.P + L > self.cfg.max_position_embeddings:
      raise ValueError(f"prompt {self.P} + completion {L} tokens exceed the model's "
                       f"{self.cfg.max_position_embeddings} positions")
    self.chunk_steps = int(chunk_steps or sampler.chunk_steps)
    # With samples waiting (`step(refill=True)`), a chunk ends once this many of its samples
    # finished, their slots refilled at once instead of idle to the chunk's end (half a chunk
    # per sample on average). Each early end costs a chunk's fixed work (dispatch, reading the
    # outputs, an insert, the window's gather): capacity / 8 balances them (bench.continuous:
    # 16 slots of a weight-streaming model: 1-2 best; 64 slots of the tiny model: 8 as fast as
    # whole chunks, 1 a ratio of 1.11 instead of 1.32). 0: whole chunks always.
    self.stop_after = default_stop_after(self.capacity) if stop_after is None else int(stop_after)
    # Ring widths attention may read (powers of two from 2 chunks, below R; else all of R):
    # samples far shorter than R (thinking ends early) do not pay for R's columns.
    self.widths = [w for w in (2 ** i * self.chunk_steps for i in range(1, 12))
                   if w < self.R] if windows else []
    end_ids = spec.think_end_tokens or (() if sampler.end_think_token is None
                                        else (sampler.end_think_token,))
    end = think_end_automaton(end_ids, spec.think_end_text, spec.think_end_vocab)
    self._end = (end.columns(self.cfg.vocab_size), end.next_state, end.hit)
    self._interrupt = np.asarray(list(spec.interruption_tokens) or [0], np.int32)
    self._stop = np.asarray(list(spec.stop_tokens) or [-1], np.int32)
    self.state = _empty(self.cfg, self.capacity, self.P, self.R, sampler.kv_dtype)
    # Prompt bank (prefix cache): the prefilled KV of up to `capacity` recent prompts, by token
    # bytes, valid for one weights version. A group's samples enter over several inserts (as
    # slots free), and each insert prefilled their prompt again: as costly as a decode step
    # where a step streams the weights (bench.continuous --memory-bound: 10 % of the time).
    self.bank = _empty_bank(self.cfg, self.capacity, self.P, sampler.kv_dtype)
    self._bank_rows: collections.OrderedDict[bytes, int] = collections.OrderedDict()
    self._bank_version = -1             # the weights version the bank holds (-1: none yet)
    self.prompt_prefills = 0           # prompts prefilled (bank misses)
    self._slots: list[SlotRequest | None] = [None] * self.capacity
    self._start = [0] * self.capacity   # the decode step at which each slot's sample started
    self._g = 0
    self._length = np.zeros(self.capacity, np.int64)
    self.stats = DecodeStats()

  @property
  def free(self) -> int:
    """Slots without a sample."""
    return sum(s is None for s in self._slots)

  @property
  def in_flight(self) -> list[SlotRequest]:
    """The samples being decoded."""
    return [s for s in self._slots if s is not None]

  def insert(self, requests: Sequence[SlotRequest]) -> None:
    """Puts `requests` into free slots (at most `free` of them) and prefills their prompts."""
    requests = list(requests)
    if not requests:
      return
    free = [i for i, s in enumerate(self._slots) if s is None]
    if len(requests) > len(free):
      raise ValueError(f"{len(requests)} requests for {len(free)} free slots")
    t0 = time.perf_counter()
    self.sampler.apply_pending()
    # powers of two: few prefill shapes compile
    k = 1 << (len(requests) - 1).bit_length()
    prompts: dict = {}     # distinct prompts (a group's samples share one): tokens -> row
    src = np.zeros((k,), np.int32)
    slots = np.full((k,), self.capacity, np.int32)   # >= capacity: padding, dropped
    ints = np.zeros((5, k), np.int64)
    for i, r in enumerate(requests + requests[-1:] * (k - len(requests))):
      t = np.asarray(r.prompt.tokens, np.int32)
      if t.ndim != 1 or not 0 < len(t) <= self.P:
        raise ValueError(f"prompt {r.prompt.prompt_id}: {t.shape} tokens; the decoder takes 1 to "
                         f"{self.P} (max_prompt_len)")
      if r.think_budget < 0 or r.answer_budget <= 0:
        raise ValueError(f"prompt {r.prompt.prompt_id}: budgets must be >= 0 (think) and > 0 "
                         f"(answer), got {r.think_budget}, {r.answer_budget}")
      src[i] = prompts.setdefault(t.tobytes(), len(prompts))
      ints[:, i] = (r.think_budget, r.answer_budget if self.n_int else self.room,
                    int(r.seed) & 0xFFFFFFFF, int(r.prompt.prompt_id) & 0x7FFFFFFF,
                    r.sample_index)
      if i < len(requests):
        slots[i] = free[i]
        self._slots[free[i]] = r
        self._start[free[i]] = self._g
        self._length[free[i]] = 0
    src = self._bank_lookup(list(prompts))[src]
    self.state = _insert(self.cfg, self.state, self.bank, slots, src,
                         ints[0].astype(np.int32), ints[1].astype(np.int32),
                         ints[2].astype(np.uint32), ints[3].astype(np.int32),
                         ints[4].astype(np.int32), np.int32(self._bank_version),
                         sampler_lib.PHASE_THINK if self.n_int else sampler_lib.PHASE_ANSWER)
    self.stats.insert_s += time.perf_counter() - t0

  def _bank_lookup(self, prompts: list[bytes]) -> np.ndarray:
    """The bank row of each of these distinct prompts (token bytes), prefilling the ones not in
    the bank in one batch (into free rows, else the least recently used rows of other prompts).
    A weights swap empties the bank: a prompt inserted after a swap is prefilled by the new
    weights, as before the bank."""
    if self._bank_version != self.sampler.version:
      self._bank_rows.clear()
      self._bank_version = int(self.sampler.version)
    missing = [b for b in prompts if b not in self._bank_rows]
    if missing:
      wanted = set(prompts)
      used = set(self._bank_rows.values())
      free = [r for r in range(self.capacity) if r not in used]
      while len(free) < len(missing):     # evict: oldest first, never a prompt of this insert
        old = next(b for b in self._bank_rows if b not in wanted)
        free.append(self._bank_rows.pop(old))
      u = 1 << (len(missing) - 1).bit_length()     # powers of two: few prefill shapes compile
      tokens = np.zeros((u, self.P), np.int32)
      mask = np.zeros((u, self.P), bool)
      rows = np.full((u,), self.capacity, np.int32)   # >= Q: padding, dropped
      for i, b in enumerate(missing):
        t = np.frombuffer(b, np.int32)
        tokens[i, self.P - len(t):] = t
        mask[i, self.P - len(t):] = True
        rows[i] = free[i]
        self._bank_rows[b] = free[i]
      mask[len(missing):, -1] = True   # padding rows: one token, never used
      self.bank = _prefill_bank(self.sampler.params, self.cfg, self.bank, rows, tokens, mask)
      self.prompt_prefills += len(missing)
    for b in prompts:
      self._bank_rows.move_to_end(b)
    return np.asarray([self._bank_rows[b] for b in prompts], np.int32)

  def step(self, refill: bool = False) -> list[tuple[SlotRequest, Completion]]:
    """Decodes one chunk (`chunk_steps` tokens per busy slot; weights queued on the sampler are
    swapped in first) and returns the samples that finished, with their completions; their slots
    are free again. `refill` (the caller has samples waiting for slots): the chunk ends early,
    after the step at which `stop_after` samples finished."""
    t0 = time.perf_counter()
    self.sampler.apply_pending()
    rows = self._pack()
    spec = self.spec
    consts = (self._interrupt, self._stop, np.float32(spec.temperature), np.float32(spec.top_p),
              np.int32(self.sampler.version)) + self._end
    first = min((self._start[i] for i, r in enumerate(self._slots) if r is not None),
                default=self._g)
    need = self._g + self.chunk_steps - first
    width = next((w for w in self.widths if w >= need), 0)
    self.stats.window_chunks += bool(width)
    self.state, done, length, n_run = _decode(self.sampler.params, self.cfg, self.state,
                                              self.chunk_steps, self.room, spec.top_p < 1.0,
                                              consts, rows, width, np.int32(first),
                                              np.int32(self.stop_after if refill else 0))
    done, length, n_run = jax.device_get((done, length, n_run))
    n_run = int(n_run)
    self._g += n_run
    busy = np.array([s is not None for s in self._slots])
    grown = np.where(busy, length - self._length, 0)
    self._length = np.where(busy, length, self._length)
    st = self.stats
    st.chunks += 1
    st.slot_steps += self.capacity * n_run
    st.row_steps += rows * n_run
    st.live_row_steps += int(grown.sum())
    finished = [i for i in range(self.capacity) if busy[i] and done[i]]
    out = []
    if finished:
      host = jax.device_get({k: self.state[k] for k in (
          "tokens", "logprobs", "versions", "policy", "interrupted", "stopped")})
      for i in finished:
        r, n = self._slots[i], int(length[i])
        assert r is not None               # a finished slot holds its request
        cols = (self._start[i] + np.arange(n)) % self.R
        reason = (FINISH_INTERRUPTED if host["interrupted"][i]
                  else FINISH_STOP if host["stopped"][i] else FINISH_LENGTH)
        c = Completion(prompt_id=r.prompt.prompt_id, tokens=host["tokens"][i, cols],
                       logprobs=host["logprobs"][i, cols], versions=host["versions"][i, cols],
                       policy_mask=host["policy"][i, cols], finish_reason=reason)
        st.completions += 1
        st.tokens += n
        st.policy_tokens += int(c.policy_mask.sum())
        out.append((r, c))
        self._slots[i] = None
    st.decode_s += time.perf_counter() - t0
    return out

  def _pack(self) -> int:
    """The rows the next chunk decodes: the smallest bucket that holds every busy slot. When the
    busy slots would fit a smaller bucket than the one their highest index needs, the ones above
    it move down into free slots (`_move`: their KV rows, outputs and sampling state; a sample
    draws its randomness by its own key and token index, so the move changes none of its
    tokens)."""
    busy = [i for i, s in enumerate(self._slots) if s is not None]
    need = next(b for b in self.buckets if b >= len(busy))
    if busy and busy[-1] >= need:
      src = [i for i in busy if i >= need]
      dst = [i for i in range(need) if self._slots[i] is None][:len(src)]
      k = 1 << (len(src) - 1).bit_length()
      pad = k - len(src)
      self.state = _move(self.state, np.asarray(src + [0] * pad, np.int32),
                         np.asarray(dst + [self.capacity] * pad, np.int32))
      for a, b in zip(src, dst):
        self._slots[b], self._slots[a] = self._slots[a], None
        self._start[b], self._length[b] = self._start[a], self._length[a]
      self.stats.moves += len(src)
    return need

  def note_idle(self, seconds: float) -> None:
    """Books `seconds` the caller waited with free slots and nothing to insert."""
    self.stats.idle_s += float(seconds)

  def run(self, requests: Sequence[SlotRequest]) -> list[tuple[SlotRequest, Completion]]:
    """Decodes all `requests` (slots refilled as samples finish): `slots.drive`."""
    return drive(self, requests)
