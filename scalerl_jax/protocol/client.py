"""Client of the rollout buffer, used by generators and the learner.

Generator loop:
  c = BufferClient(address, token)
  for a in c.lease("gen-0", max_groups=4, wait_timeout_s=5):          # pb.Assignment
    if my_version < a.min_version: my_version, params = StreamFetcher(c).fetch(my_version, 60)
    completions = generator.generate([assignment_prompt(a)], a.group_size, spec)[0]
    c.push([completion_to_rollout(x, group_id=a.group_id, sample_index=i, ...) ...])  # acked
Learner loop:
  StreamPublisher(c, 0, params).publish()        # optional: the initial weights
  for s in range(steps):
    batch = c.pull_batch(s, timeout_s=600)       # Batch: complete groups + lag histogram
    arrays = batch_to_arrays(batch)              # ARCHITECTURE.md "Rollout batch"
    ...train...; StreamPublisher(c, s + 1, params).publish()
Weight versions travel only as streamed versions (weights.stream: StreamPublisher / StreamFetcher,
which use `publish_raw` / `fetch_raw`); `fetch_version` is the JAX-free fetch of generators that
carry no weights (fakes).

Unary calls and pulls retry with exponential backoff on UNAVAILABLE; pushes re-send the not yet
acknowledged rollouts (the server is idempotent on rollout_id, so nothing is stored twice).
By default the client keeps retrying for `retry_budget_s` (60 s), long enough for a buffer restart
from its write-ahead log (docs/RELIABILITY.md); `retries=N` gives the old fixed attempt count. A
PullBatch retried for the same step after a restart gets the same groups (the delivery is logged).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from typing import Iterable, Iterator, Mapping, Optional, Sequence

import grpc
import numpy as np

from scalerl_jax import config
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.rpc import SERVICE, TLS, channel_options, open_channel
from scalerl_jax.types import PromptSpec
from scalerl_jax.protocol.wire import varint

_RETRY = (grpc.StatusCode.UNAVAILABLE,)
log = logging.getLogger("scalerl.rpc")


def _ident(x):
  return x


@dataclasses.dataclass
class Batch:
  """One learner step's batch: complete groups (all G rollouts each) and the token-lag histogram."""
  step: int
  groups: list            # list[pb.Group]
  summary: pb.BatchSummary


class BufferClient:
  """Thin typed wrapper over the RolloutBuffer service (thread-safe, one channel)."""

  def __init__(self, address: str, token: str, *, max_message_bytes: int = 256 << 20,
               retries: Optional[int] = None,
               retry_budget_s: float = config.Generator.retry_budget_s,
               backoff_s: float = 0.05, max_backoff_s: float = 2.0, tls: Optional[TLS] = None):
    """retries=None: retry UNAVAILABLE until `retry_budget_s` has passed; retries=N: N retries.
    `tls` (rpc.TLS, e.g. `TLS.from_config(config)`): verify the server over TLS (plaintext if None)."""
    self.address = address
    self._token, self._max_message_bytes, self.tls = token, max_message_bytes, tls or TLS()
    self._md = (("authorization", f"Bearer {token}"),)
    # Reconnect quickly once a restarted buffer listens again (gRPC's default backoff grows to 120 s).
    self._ch = open_channel(address, self.tls, channel_options(max_message_bytes) + [
        ("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000))])
    self.retries, self.retry_budget_s = retries, retry_budget_s
    self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
    self.retried = 0           # UNAVAILABLE errors retried so far (all calls)
    m = lambda name: f"/{SERVICE}/{name}"
    ser = lambda x: x if isinstance(x, bytes) else x.SerializeToString()
    self._lease = self._ch.unary_unary(m("LeasePrompts"), ser, pb.LeaseResponse.FromString)
    self._push = self._ch.stream_stream(m("PushRollouts"), ser, pb.PushResponse.FromString)
    self._pull = self._ch.unary_stream(m("PullBatch"), ser, pb.BatchItem.FromString)
    self._publish = self._ch.stream_unary(m("PublishWeights"), ser, pb.PublishAck.FromString)
    self._fetch = self._ch.unary_stream(m("FetchWeights"), ser, pb.WeightChunk.FromString)
    self._fetch_raw = self._ch.unary_stream(m("FetchWeights"), ser, _ident)
    self._watch = self._ch.unary_stream(m("WatchVersion"), ser, pb.VersionNotice.FromString)
    self._status = self._ch.unary_unary(m("GetStatus"), ser, pb.Status.FromString)
    self._heartbeat = self._ch.unary_unary(m("Heartbeat"), ser, pb.HeartbeatResponse.FromString)
    self._submit_eval = self._ch.unary_unary(m("SubmitEval"), ser, pb.EvalAck.FromString)
    self._push_eval = self._ch.unary_unary(m("PushEvalResults"), ser, pb.EvalPushResponse.FromString)
    self._collect_eval = self._ch.unary_unary(m("CollectEval"), ser, pb.EvalResult.FromString)
    self._bulk_address = self._ch.unary_unary(m("WeightBulkAddress"), ser, _ident)

  def close(self) -> None:
    self._ch.close()

  def peer(self, address: str, retries: int = 3) -> "BufferClient":
    """A client for another server of this run (a learner weight source), same token and TLS."""
    return BufferClient(address, self._token, max_message_bytes=self._max_message_bytes,
                        retries=retries, backoff_s=self.backoff_s, max_backoff_s=self.max_backoff_s,
                        tls=self.tls)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def _give_up(self, attempt: int, t0: float) -> bool:
    if self.retries is not None:
      return attempt >= self.retries
    return time.time() - t0 >= self.retry_budget_s

  def _retry(self, fn):
    delay, t0, attempt = self.backoff_s, time.time(), 0
    while True:
      try:
        return fn()
      except grpc.RpcError as e:
        if e.code() not in _RETRY or self._give_up(attempt, t0):
          raise
        # e.g. "GOAWAY received; Error code: 2; Debug Text: Cancelling all calls" when the
        # buffer shut down with this call open (gRPC's own line is off: scalerl_jax/__init__.py)
        log.debug("%s: %s (%s); retry %d", self.address, e.code().name, e.details(), attempt + 1)
      attempt += 1
      self.retried += 1
      time.sleep(delay * (0.5 + random.random()))
      delay = min(delay * 2, self.max_backoff_s)

  # ---- generators --------------------------------------------------------------------------------
  def lease(self, generator_id: str, max_groups: int = 1,
            wait_timeout_s: float = 0.0) -> list[pb.Assignment]:
    return list(self.lease_response(generator_id, max_groups, wait_timeout_s).assignments)

  def lease_response(self, generator_id: str, max_groups: int = 1, wait_timeout_s: float = 0.0,
                     held_versions: Sequence[int] = (), max_eval_groups: int = 0
                     ) -> pb.LeaseResponse:
    """LeasePrompts with the versions this generator holds (evaluation groups pinned to one of them
    come first); the response also lists the versions open evaluations pin (`eval_versions`)."""
    req = pb.LeaseRequest(generator_id=generator_id, max_groups=max_groups,
                          wait_timeout_s=wait_timeout_s, held_versions=list(held_versions),
                          max_eval_groups=max_eval_groups)
    return self._retry(lambda: self._lease(req, metadata=self._md, timeout=wait_timeout_s + 30))

  # ---- evaluation lane ---------------------------------------------------------------------------
  def submit_eval(self, request: pb.EvalRequest) -> pb.EvalAck:
    """Opens an evaluation (idempotent on eval_id, so retried on UNAVAILABLE)."""
    return self._retry(lambda: self._submit_eval(request, metadata=self._md, timeout=60))

  def push_eval(self, results: Sequence[pb.EvalGroupResult]) -> pb.EvalPushResponse:
    """Reports evaluation groups' rewards (a re-sent group counts as a duplicate)."""
    req = pb.EvalPushRequest(results=list(results))
    return self._retry(lambda: self._push_eval(req, metadata=self._md, timeout=60))

  def collect_eval(self, eval_id: int, timeout_s: float = 0.0, cancel: bool = False
                   ) -> pb.EvalResult:
    req = pb.EvalCollectRequest(eval_id=eval_id, timeout_s=timeout_s, cancel=cancel)
    return self._retry(lambda: self._collect_eval(req, metadata=self._md, timeout=timeout_s + 30))

  def push(self, rollouts: Sequence[pb.Rollout | bytes], batch_bytes: int = 4 << 20
           ) -> list[pb.Ack]:
    """Streams rollouts (messages or pre-serialized bytes), packed into PushRequests of about
    `batch_bytes`; returns one Ack per rollout, in order. On UNAVAILABLE the rollouts not yet
    acknowledged are re-sent on a new stream (the server stores each rollout id once)."""
    raws = [r if isinstance(r, (bytes, memoryview)) else r.SerializeToString() for r in rollouts]
    acks: list[pb.Ack] = []

    def once() -> list[pb.Ack]:   # a retry re-sends only what is not acknowledged yet
      for resp in self._push(pack_push_requests(raws[len(acks):], batch_bytes),
                             metadata=self._md):
        acks.extend(resp.acks)
      return acks
    return self._retry(once)

  def push_stream(self, requests: Iterable[bytes]) -> Iterator[pb.PushResponse]:
    """One long-lived stream (no retry) of serialized PushRequests (see `pack_push_requests`)."""
    return self._push(iter(requests), metadata=self._md)

  def heartbeat(self, generator_id: str, version: int = 0,
                group_ids: Sequence[int] | None = None,
                held_versions: Sequence[int] | None = None,
                stats: Mapping[str, float] | None = None, relay_address: str = "",
                relay_fanout: int = 0) -> pb.HeartbeatResponse:
    """Extends this generator's leases: only `group_ids` (the groups it is working on) when
    given, else every incomplete group leased to it; `held_versions` (when given) tells the
    buffer which versions' weights it holds; `stats`: its cumulative counters (see
    HeartbeatRequest in rollout.proto); `relay_address` / `relay_fanout`: its weight relay
    (the response's `relay_parents` are the relays it fetches from, weights/relay.py)."""
    req = pb.HeartbeatRequest(generator_id=generator_id, version=version,
                              group_ids=list(group_ids or ()), lists_groups=group_ids is not None,
                              held_versions=list(held_versions or ()),
                              lists_held=held_versions is not None, stats=dict(stats or {}),
                              relay_address=relay_address, relay_fanout=relay_fanout)
    return self._retry(lambda: self._heartbeat(req, metadata=self._md, timeout=30))

  def release(self, generator_id: str, group_ids: Sequence[int] | None = None,
              timeout_s: float = 5.0) -> int:
    """Gives this generator's incomplete training groups (only `group_ids` when given) back to
    the buffer now (a generator leaving on SIGTERM); one try, no retries (the pod's grace period
    is short). Returns how many groups went back."""
    req = pb.HeartbeatRequest(generator_id=generator_id, group_ids=list(group_ids or ()),
                              lists_groups=group_ids is not None, release=True)
    return int(self._heartbeat(req, metadata=self._md, timeout=timeout_s).leases_extended)

  def fetch_version(self, have_version: int = -1, wait_timeout_s: float = 0.0) -> Optional[int]:
    """The newest weight version above `have_version` once fully fetched (its chunks read and
    dropped), or None when none arrived within `wait_timeout_s`: for generators without weights
    (fakes, fault tests); a real one fetches the params with weights.stream.StreamFetcher."""
    deadline = time.time() + wait_timeout_s

    def once() -> Optional[tuple[int, bool]]:
      req = pb.FetchWeightsRequest(have_version=have_version, streamed=True,
                                   wait_timeout_s=max(0.0, deadline - time.time()))
      head, chunks = None, set()
      for c in self._fetch(req, metadata=self._md, timeout=wait_timeout_s + 600):
        if head is None:
          head = c
        else:
          chunks.add(c.chunk_index)
      if head is None:
        return None
      manifest = json.loads(head.manifest)      # remote ("sources"): the chunks are not here
      return head.version, "sources" in manifest or len(chunks) == len(manifest["chunks"])
    while True:
      got = self._retry(once)
      if got is None:
        return None
      version, complete = got
      if complete:
        return version
      if time.time() > deadline:     # the stream ended short (superseded or stalled): try again
        return None
  def fetch_raw(self, request: pb.FetchWeightsRequest, timeout: float) -> Iterator[bytes]:
    """FetchWeights without parsing (serialized WeightChunks; weights.stream.StreamFetcher)."""
    return self._fetch_raw(request, metadata=self._md, timeout=timeout)

  def bulk_address(self, timeout: float = 10.0) -> str:
    """The bulk weight channel ("host:port", weights/bulk.py) of the weight source this client
    talks to; "" when it has none (UNIMPLEMENTED: the buffer, an older source)."""
    try:
      return bytes(self._bulk_address(b"", metadata=self._md, timeout=timeout)).decode()
    except grpc.RpcError as e:
      if e.code() == grpc.StatusCode.UNIMPLEMENTED:
        return ""
      raise

  @property
  def token(self) -> str:
    """The bearer token this client authenticates with (the bulk channel sends it too)."""
    return self._token

  @property
  def max_message_bytes(self) -> int:
    """The largest message this client accepts (the bulk channel's frame limit too)."""
    return self._max_message_bytes

  def publish_raw(self, messages: Iterator[bytes], timeout: float = 600) -> pb.PublishAck:
    """PublishWeights from serialized WeightChunks (no retry; weights.stream.StreamPublisher)."""
    return self._publish(messages, metadata=self._md, timeout=timeout)

  def watch_versions(self, have_version: int = -1) -> Iterator[pb.VersionNotice]:
    """Server-stream of notices, one per newly visible weight version (cancel by closing)."""
    return self._watch(pb.WatchRequest(have_version=have_version), metadata=self._md)

  # ---- learner -----------------------------------------------------------------------------------
  def pull_batch(self, step: int, timeout_s: float = 60.0) -> Batch:
    """Blocks until the batch for `step` is complete (DEADLINE_EXCEEDED after timeout_s)."""
    def once() -> Batch:
      groups, summary = [], None
      req = pb.PullRequest(step=step, timeout_s=timeout_s)
      for item in self._pull(req, metadata=self._md, timeout=timeout_s + 60):
        if item.HasField("group"):
          groups.append(item.group)
        else:
          summary = item.summary
      if summary is None:
        raise IOError(f"PullBatch({step}) ended without a summary")
      return Batch(step, groups, summary)
    return self._retry(once)

  def pull_raw(self, step: int, timeout_s: float = 60.0) -> Iterator[bytes]:
    """PullBatch without parsing: yields serialized BatchItem messages (for benchmarks)."""
    call = self._ch.unary_stream(f"/{SERVICE}/PullBatch", pb.PullRequest.SerializeToString, _ident)
    return call(pb.PullRequest(step=step, timeout_s=timeout_s), metadata=self._md)

  def status(self) -> pb.Status:
    return self._retry(lambda: self._status(pb.StatusRequest(), metadata=self._md, timeout=30))


def pack_push_requests(raws: Sequence[bytes], batch_bytes: int = 4 << 20) -> Iterator[bytes]:
  """Packs serialized Rollouts into serialized PushRequests of about `batch_bytes` each."""
  parts, size = [], 0
  for raw in raws:
    parts += (b"\x0a", varint(len(raw)), raw)          # PushRequest field 1, wire type 2
    size += len(raw)
    if size >= batch_bytes:
      yield b"".join(parts)
      parts, size = [], 0
  if parts:
    yield b"".join(parts)


def assignment_prompt(a: pb.Assignment) -> PromptSpec:
  """The PromptSpec (for `Generator.generate`) of a leased assignment."""
  return PromptSpec(int(a.prompt_id), codec.decode(a.prompt_tokens, pb.INT32, "prompt", 1 << 31),
                    a.answer)


def batch_to_arrays(batch: Batch, pad_id: int = 0) -> dict[str, np.ndarray]:
  """Pads a batch into the learner's arrays (docs/ARCHITECTURE.md "Rollout batch"), [B*G, T], plus
  `prompt_lengths` / `completion_lengths` [B*G] (each row's real tokens, for the compute ledger)."""
  rows = [(g.group_id, r) for g in batch.groups for r in g.rollouts]
  dec = [(gid, codec.decode(r.prompt_tokens, pb.INT32, "p", 1 << 31), codec.rollout_to_completion(r))
         for gid, r in rows]
  T = max((len(p) + len(c.tokens) for _, p, c in dec), default=0)
  n = len(dec)
  with_routes = n > 0 and all(c.routes is not None for _, _, c in dec)
  out = dict(tokens=np.full((n, T), pad_id, np.int32), gen_logprobs=np.zeros((n, T), np.float32),
             loss_mask=np.zeros((n, T), bool), rewards=np.zeros((n,), np.float32),
             prompt_ids=np.zeros((n,), np.int32), versions=np.zeros((n, T), np.int32),
             prompt_lengths=np.zeros((n,), np.int32), completion_lengths=np.zeros((n,), np.int32))
  if with_routes:   # MoE routing replay: int32 [B*G, T, R, K] (padding rows / tokens: expert 0)
    r0 = dec[0][2].routes
    assert r0 is not None                # with_routes: every completion has its routes
    out["routes"] = np.zeros((n, T, *r0.shape[1:]), np.int32)
  for i, (gid, p, c) in enumerate(dec):
    P, L = len(p), len(c.tokens)
    if with_routes:
      assert c.routes is not None
      out["routes"][i, :P + L] = c.routes
    out["tokens"][i, :P], out["tokens"][i, P:P + L] = p, c.tokens
    out["gen_logprobs"][i, P:P + L] = c.logprobs
    out["loss_mask"][i, P:P + L] = c.policy_mask
    out["versions"][i, P:P + L] = c.versions
    out["rewards"][i] = c.reward
    out["prompt_ids"][i] = gid
    out["prompt_lengths"][i], out["completion_lengths"][i] = P, L
  return out
