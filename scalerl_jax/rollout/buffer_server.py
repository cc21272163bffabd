"""gRPC rollout buffer: one `RolloutBuffer` service (scalerl.rollout.v1) over `admission.BufferState`.

In-process:  srv = BufferServer(prompts, token="...", prompts_per_step=B, group_size=G, max_lag=k)
             srv.start(); srv.port; ...; srv.stop()
As a process:
  python -m scalerl_jax.rollout.buffer_server --port 0 --token-env SCALERL_BUFFER_TOKEN \
      --prompts prompts.jsonl --prompts-per-step 48 --group-size 16 --max-lag 8
  (prints one JSON line {"port": ...} once serving; prompts.jsonl: {"prompt_id", "tokens", "answer"}).

Security: every RPC needs `authorization: Bearer <token>` (checked by a server interceptor before any
handler runs). Requests are parsed by our own deserializers so garbage bytes become INVALID_ARGUMENT,
and every field is validated (validation.py). Rollout payloads are stored as the bytes received and
spliced unchanged into the learner's batches (no re-encoding). The weight RPCs (PublishWeights,
FetchWeights, WatchVersion) live in weight_store.py. This module must not import jax.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import hmac
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Optional, Sequence

import grpc
import numpy as np
from google.protobuf import message as pb_message
from google.protobuf import unknown_fields

from scalerl_jax.rollout import admission
from scalerl_jax.rollout import rollout_pb2 as pb
from scalerl_jax.rollout import validation as val
from scalerl_jax.rollout import wal as walmod
from scalerl_jax.rollout import weight_store
from scalerl_jax.rollout.generator import PromptSpec

SERVICE = "scalerl.rollout.v1.RolloutBuffer"
log = logging.getLogger("scalerl.buffer")


def channel_options(max_message_bytes: int) -> list:
  """Shared server/client channel options: message limits and large HTTP/2 windows/frames."""
  return [("grpc.max_receive_message_length", max_message_bytes),
          ("grpc.max_send_message_length", max_message_bytes),
          ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
          ("grpc.http2.bdp_probe", 1),
          ("grpc.so_reuseport", 0)]


_Malformed = weight_store.Malformed   # one type: weight requests are parsed in weight_store


def _unknown(msg, name: str) -> Optional[str]:
  """Strict parsing: unknown or mistyped fields (e.g. a message of another type) are refused."""
  u = unknown_fields.UnknownFieldSet(msg)
  if len(u):
    nums = sorted({f.field_number for f in u})
    return f"{name}: unknown or mistyped field number(s) {nums[:8]}"
  return None


_ROLLOUT_SUBMESSAGES = ("prompt_tokens", "completion_tokens", "logprobs", "versions",
                        "policy_mask", "timing")


def _parser(cls):
  name = cls.DESCRIPTOR.name

  def parse(data: bytes):
    try:
      m = cls.FromString(data)
    except (pb_message.DecodeError, ValueError, RuntimeError) as e:
      return _Malformed(f"cannot parse {name}: {e}")
    err = _unknown(m, name)
    return _Malformed(err) if err else m
  return parse


def _parse_push(data: bytes):
  """Splits a PushRequest into (Rollout, raw bytes view) pairs without copying the payload.

  The outer message may only contain field 1 (rollouts); each element is parsed on its own so the
  stored bytes are exactly the bytes that were validated."""
  view, pos, n, out = memoryview(data), 0, len(data), []
  try:
    while pos < n:
      tag, pos = _read_varint(view, pos)
      if tag != 0x0A:
        return _Malformed(f"PushRequest: unexpected field {tag >> 3} (wire type {tag & 7})")
      size, pos = _read_varint(view, pos)
      if pos + size > n:
        return _Malformed("PushRequest: truncated rollout")
      raw = view[pos:pos + size]
      r = pb.Rollout.FromString(raw)
      err = _unknown(r, f"rollouts[{len(out)}]") or next(
          (e for f in _ROLLOUT_SUBMESSAGES if (e := _unknown(getattr(r, f), f"rollouts[{len(out)}].{f}"))),
          None)
      if err:
        return _Malformed(err)
      out.append((r, raw))
      pos += size
  except (pb_message.DecodeError, ValueError, RuntimeError, IndexError) as e:
    return _Malformed(f"cannot parse PushRequest: {e}")
  if not out:
    return _Malformed("PushRequest carries no rollouts")
  return out


def _read_varint(view: memoryview, pos: int) -> tuple[int, int]:
  result = shift = 0
  while True:
    if shift > 63:
      raise ValueError("varint too long")
    b = view[pos]
    pos += 1
    result |= (b & 0x7F) << shift
    if not b & 0x80:
      return result, pos
    shift += 7


def _serialize(x) -> bytes:
  return x if isinstance(x, bytes) else x.SerializeToString()


class _AuthInterceptor(grpc.ServerInterceptor):
  """Rejects any call without `authorization: Bearer <token>` before its handler runs."""

  def __init__(self, token: str, on_reject):
    self._expected = f"Bearer {token}".encode()
    self._on_reject = on_reject

  def intercept_service(self, continuation, details):
    for key, value in details.invocation_metadata or ():
      if key == "authorization":
        got = value.encode() if isinstance(value, str) else bytes(value)
        if hmac.compare_digest(got, self._expected):
          return continuation(details)
        break
    handler = continuation(details)
    if handler is None:
      return None
    self._on_reject(grpc.StatusCode.UNAUTHENTICATED)

    def deny(request, context):
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](deny)


class BufferServer:
  """The rollout buffer service; see the module docstring."""

  def __init__(self, prompts: Sequence[PromptSpec], *, token: str, prompts_per_step: int,
               group_size: int, max_lag: int, mode: str = "pipeline", host: str = "127.0.0.1",
               port: int = 0, max_message_bytes: int = 64 << 20,
               max_weight_bytes: int = 64 << 30, weight_chunk_bytes: int = 4 << 20,
               lease_ttl_s: float = 120.0, limits: val.Limits = val.Limits(),
               verifier: Optional[val.Verifier] = None, max_workers: int = 256,
               shuffle_seed: Optional[int] = None, npr_threshold: Optional[float] = None,
               wal_dir: Optional[str] = None, wal_fsync: str = "batch",
               wal_fsync_interval_s: float = 1.0):
    if not token:
      raise ValueError("an auth token is required")
    self.state = admission.BufferState(
        prompts, prompts_per_step=prompts_per_step, group_size=group_size, max_lag=max_lag,
        mode=mode, lease_ttl_s=lease_ttl_s, limits=limits, verifier=verifier,
        shuffle_seed=shuffle_seed, npr_threshold=npr_threshold)
    self.limits, self.max_weight_bytes = limits, max_weight_bytes
    self.weight_chunk_bytes = weight_chunk_bytes
    self.weights = weight_store.WeightStore(self)
    self.wal: Optional[walmod.WAL] = None
    self.wal_report: dict = {}
    if wal_dir:
      self._open_wal(wal_dir, wal_fsync, wal_fsync_interval_s)
    self._rejected: collections.Counter = collections.Counter()
    self._bytes_in = self._bytes_out = 0
    self._mlock = threading.Lock()
    self._server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="buffer"),
        interceptors=[_AuthInterceptor(token, self._count_reject)],
        options=channel_options(max_message_bytes), maximum_concurrent_rpcs=max_workers)
    self._server.add_generic_rpc_handlers([self._handlers()])
    self.port = self._server.add_insecure_port(f"{host}:{port}")
    if self.port == 0:
      raise RuntimeError(f"could not bind {host}:{port}")
    self.address = f"{host}:{self.port}"

  @classmethod
  def from_config(cls, config, prompts: Sequence[PromptSpec], token: Optional[str] = None,
                  **overrides) -> "BufferServer":
    """Builds the server from a run config (`rollout` and `buffer` sections of configs/common.py).

    The token defaults to the env var named by `config.buffer.auth_token_env`."""
    if token is None:
      token = os.environ.get(config.buffer.auth_token_env, "")
      if not token:
        raise ValueError(f"auth token env var {config.buffer.auth_token_env} is empty or unset")
    host, _, port = config.buffer.address.rpartition(":")
    r = config.rollout
    kw = dict(token=token, prompts_per_step=r.prompts_per_step,
              group_size=r.generations_per_prompt, max_lag=r.max_lag, mode=r.mode,
              host=host or "127.0.0.1", port=int(port or 0),
              max_message_bytes=config.buffer.max_message_bytes)
    kw.update(overrides)
    return cls(prompts, **kw)

  def _open_wal(self, wal_dir: str, fsync: str, interval_s: float) -> None:
    """Replays `wal_dir` (truncating a torn tail), reloads the latest weights, compacts the state
    into a fresh segment and logs every later change (docs/RELIABILITY.md)."""
    os.makedirs(wal_dir, exist_ok=True)
    t0 = time.time()
    records, report = walmod.read_all(wal_dir, truncate=True)
    report["restored"] = self.state.restore(records)
    got = walmod.load_weights(wal_dir)
    if got is not None:
      head, payload = got
      self.weights.restore(head, payload)
      if head["version"] > self.state.version:   # crash between weights.bin and its VERSION record
        self.state.version = head["version"]
        self.state.weights_meta = dict(head)
      report["weights_version"] = head["version"]
    self.wal = walmod.WAL(wal_dir, fsync=fsync, fsync_interval_s=interval_s)
    report["segment"] = self.state.attach_wal(self.wal)
    report["replay_s"] = round(time.time() - t0, 3)
    self.wal_report = report
    log.info("WAL %s: replayed %s -> %s", wal_dir, report["records"], report["restored"])

  # ---- lifecycle ---------------------------------------------------------------------------------
  def start(self) -> "BufferServer":
    self._server.start()
    return self

  def stop(self, grace: float = 0.5) -> None:
    self._server.stop(grace).wait()
    if self.wal is not None:
      self.wal.close()

  def wait(self) -> None:
    self._server.wait_for_termination()

  # ---- plumbing ----------------------------------------------------------------------------------
  def _handlers(self):
    h = {
        "LeasePrompts": grpc.unary_unary_rpc_method_handler(
            self._lease, _parser(pb.LeaseRequest), _serialize),
        "PushRollouts": grpc.stream_stream_rpc_method_handler(
            self._push, _parse_push, _serialize),
        "PullBatch": grpc.unary_stream_rpc_method_handler(
            self._pull, _parser(pb.PullRequest), _serialize),
        "PublishWeights": grpc.stream_unary_rpc_method_handler(
            self.weights.publish, weight_store.parse_weight_message, _serialize),
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            self.weights.fetch, _parser(pb.FetchWeightsRequest), _serialize),
        "WatchVersion": grpc.unary_stream_rpc_method_handler(
            self.weights.watch, _parser(pb.WatchRequest), _serialize),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            self._status, _parser(pb.StatusRequest), _serialize),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            self._heartbeat, _parser(pb.HeartbeatRequest), _serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE, h)

  def _count_reject(self, code: grpc.StatusCode) -> None:
    with self._mlock:
      self._rejected[code.name] += 1

  def _abort(self, context, code: grpc.StatusCode, message: str):
    self._count_reject(code)
    context.abort(code, message)

  def _req(self, request, context):
    if isinstance(request, _Malformed):
      self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.err)
    return request

  def _call(self, context, fn, *args):
    try:
      return fn(*args)
    except val.RejectError as e:
      self._abort(context, e.code, e.message)

  # ---- handlers ----------------------------------------------------------------------------------
  def _lease(self, request, context):
    r = self._req(request, context)
    got = self._call(context, self.state.lease, r.generator_id, r.max_groups, r.wait_timeout_s)
    return pb.LeaseResponse(assignments=got, current_version=self.state.version)

  def _push(self, request_iterator, context):
    for item in request_iterator:
      items = self._req(item, context)
      acks = self._call(context, self.state.add_rollouts, items)
      new = sum(len(raw) for (_, raw), a in zip(items, acks) if not a.duplicate)
      with self._mlock:
        self._bytes_in += new
      yield pb.PushResponse(acks=acks)

  def _pull(self, request, context):
    r = self._req(request, context)
    if r.learner_id:
      self._call(context, val.check_id, r.learner_id, "learner_id", self.limits)
    batch = self._call(context, self.state.pull, r.step, r.timeout_s)
    yield from batch.groups          # pre-serialized BatchItem{group} messages
    with self._mlock:
      self._bytes_out += batch.num_bytes
    yield pb.BatchItem(summary=batch.summary)

  def _status(self, request, context):
    self._req(request, context)
    with self._mlock:
      rejected, bi, bo = dict(self._rejected), self._bytes_in, self._bytes_out
    return pb.Status(contents=self.state.contents(), rejected=rejected, bytes_in=bi, bytes_out=bo,
                     **self.state.status_fields())

  def _heartbeat(self, request, context):
    r = self._req(request, context)
    n = self._call(context, self.state.heartbeat, r.generator_id)
    return pb.HeartbeatResponse(current_version=self.state.version, leases_extended=n,
                                server_time_unix_s=time.time())


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 256 << 20) -> bool:
  """Keeps glibc from mmap/munmap-ing every multi-MB buffer (each fresh mapping costs a page fault
  per 4 KiB): large rollout/group buffers are then recycled from the heap. Process-wide; the server
  process calls it, other processes may opt in. Returns False where glibc's mallopt is missing."""
  try:
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, trim_threshold))
  except (OSError, AttributeError):
    return False


def load_prompts(path: str) -> list[PromptSpec]:
  """Reads a JSONL file of {"prompt_id": int, "tokens": [int...], "answer": str}."""
  out = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        d = json.loads(line)
        out.append(PromptSpec(int(d["prompt_id"]), np.asarray(d["tokens"], np.int32),
                              str(d.get("answer", ""))))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}:{n}: bad prompt line ({e})") from None
  return out


def main(argv: Optional[Sequence[str]] = None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--host", default="127.0.0.1")
  ap.add_argument("--port", type=int, default=0)
  ap.add_argument("--token-env", default="SCALERL_BUFFER_TOKEN",
                  help="name of the environment variable that holds the shared secret")
  ap.add_argument("--prompts", required=True, help="JSONL: prompt_id, tokens, answer")
  ap.add_argument("--prompts-per-step", type=int, default=48)
  ap.add_argument("--group-size", type=int, default=16)
  ap.add_argument("--max-lag", type=int, default=8)
  ap.add_argument("--mode", choices=admission.MODES, default="pipeline")
  ap.add_argument("--max-message-bytes", type=int, default=64 << 20)
  ap.add_argument("--lease-ttl-s", type=float, default=120.0)
  ap.add_argument("--max-weight-bytes", type=int, default=64 << 30)
  ap.add_argument("--weight-chunk-bytes", type=int, default=4 << 20,
                  help="FetchWeights chunk size of blob versions (streamed ones keep their chunks)")
  ap.add_argument("--max-completion-tokens", type=int, default=32768)
  ap.add_argument("--shuffle-seed", type=int, default=None)
  ap.add_argument("--npr-threshold", type=float, default=None,
                  help="No-Positive-Resampling: retire prompts whose pass rate reaches this")
  ap.add_argument("--max-workers", type=int, default=256,
                  help="server threads = max concurrent RPCs (long-polls and streams hold one each)")
  ap.add_argument("--wal-dir", default=None,
                  help="write-ahead log directory: acked rollouts, leases, deliveries and the latest "
                       "weights survive a crash; a restart with the same dir replays it")
  ap.add_argument("--wal-fsync", choices=walmod.FSYNC_POLICIES, default="batch",
                  help="batch: fsync per request batch (default); interval: at most every "
                       "--wal-fsync-interval-s; none: OS page cache only (survives kill -9)")
  ap.add_argument("--wal-fsync-interval-s", type=float, default=1.0)
  ap.add_argument("--no-tune-malloc", action="store_true", help="leave glibc malloc defaults")
  ap.add_argument("--switch-interval-s", type=float, default=0.0,
                  help="sys.setswitchinterval for the server process (0: Python's default 5 ms)")
  a = ap.parse_args(argv)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
  if not a.no_tune_malloc:
    tune_malloc()
  if a.switch_interval_s > 0:
    sys.setswitchinterval(a.switch_interval_s)   # the gRPC poller thread gets the GIL sooner
  token = os.environ.get(a.token_env, "")
  if not token:
    sys.exit(f"error: environment variable {a.token_env} (the auth token) is empty or unset")
  srv = BufferServer(load_prompts(a.prompts), token=token, prompts_per_step=a.prompts_per_step,
                     group_size=a.group_size, max_lag=a.max_lag, mode=a.mode, host=a.host,
                     port=a.port, max_message_bytes=a.max_message_bytes, lease_ttl_s=a.lease_ttl_s,
                     limits=val.Limits(max_completion_tokens=a.max_completion_tokens),
                     shuffle_seed=a.shuffle_seed, max_workers=a.max_workers,
                     npr_threshold=a.npr_threshold, wal_dir=a.wal_dir, wal_fsync=a.wal_fsync,
                     wal_fsync_interval_s=a.wal_fsync_interval_s,
                     max_weight_bytes=a.max_weight_bytes,
                     weight_chunk_bytes=a.weight_chunk_bytes).start()
  out = {"port": srv.port, "address": srv.address}
  if srv.wal is not None:
    out["wal"] = srv.wal_report
  print(json.dumps(out), flush=True)
  signal.signal(signal.SIGTERM, lambda *_: srv.stop(0))
  srv.wait()


if __name__ == "__main__":
  main()
