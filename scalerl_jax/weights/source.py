"""Learner-hosted weight serving: generators fetch each learner host's chunks from that host.

The buffer path (weight_store.py) moves every weight byte twice: learner -> buffer -> generator.
With a `WeightSource` in each learner process the buffer only announces a version (a "remote"
manifest: chunk table + "sources", one address per learner process, + "owners", the source of each
chunk) and the generators fetch the chunks straight from the learner hosts: one hop, and the load
is spread over every learner host's NIC instead of one buffer host (docs/SCALE.md).

Learner (weights.stream.StreamPublisher does this when given `source=`):
  src = WeightSource(token)                      # a gRPC server on this host (FetchWeights only)
  src.begin(version, manifest_msg, n_own)        # fetchers may connect from now on ...
  src.add(version, index, chunk_msg) ...         # ... and get each chunk as soon as it is staged
Generator: weights.stream.StreamFetcher follows a remote manifest's sources by itself.

A source serves exactly the version asked for (`FetchWeightsRequest.resume_version`, skipping
`have_chunks`): the chunks of one version must all come from the same version on every host. It
keeps the newest `keep` versions; asked for an older one it answers NOT_FOUND (the fetcher then asks
the buffer for the newest). Staged chunk messages are copies (encoded once, CRC'd once), so the
learner may update its params while generators still fetch. Every RPC needs the buffer's bearer
token (UNAUTHENTICATED otherwise); requests are parsed strictly (INVALID_ARGUMENT). This module must
not import jax.
"""
from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
import time
from typing import Optional

import grpc

from scalerl_jax import config as common
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.rpc import SERVICE, TLS, AuthInterceptor, add_port, channel_options
from scalerl_jax.protocol import validation as val
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.protocol.wire import Malformed, abort, parser, serialize
from scalerl_jax.weights.bulk import BulkServer

log = logging.getLogger("scalerl.weight_source")


def advertised_host(bind: str) -> str:
  """The host name generators should dial for a server bound to `bind` (a wildcard bind is
  advertised as this host's resolved address)."""
  if bind not in ("0.0.0.0", "::", "[::]", ""):
    return bind
  try:
    return socket.gethostbyname(socket.gethostname())
  except OSError:
    return socket.gethostname()


class WeightSource:
  """A FetchWeights-only gRPC server in a learner process; see the module docstring."""

  def __init__(self, token: str, *, host: str = "127.0.0.1", port: int = 0,
               advertise: Optional[str] = None, keep: int = 2, max_message_bytes: int = 64 << 20,
               stall_s: float = 60.0, max_workers: int = 64, tls: Optional[TLS] = None,
               bulk: bool = True, bulk_port: int = common.Weights.bulk_port):
    """`advertise`: the host part generators dial (default: `host`, or this host's address for a
    wildcard bind). `keep`: versions held (the newest, plus older ones still being fetched).
    `tls` (rpc.TLS): serve over TLS, like the buffer (`TLS.from_config(config)`). `bulk`: also
    serve the chunks over the bulk channel (weights/bulk.py, same token and TLS) on `bulk_port`
    (`weights.bulk_port` / `weights.relay_bulk_port`; 0: any free port), announced by the
    `WeightBulkAddress` call."""
    if not token:
      raise ValueError("an auth token is required")
    self.keep, self.stall_s = max(1, int(keep)), float(stall_s)
    self.limits = val.Limits()
    self.cv = threading.Condition()
    self.versions: dict[int, ws.Version] = {}
    self.rejected = 0
    self.served_chunks = 0
    self.served_bytes = 0            # bytes of the chunk messages served (egress, both kinds)
    self.delta_streams = 0           # fetches answered with a delta stream
    self._server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=max_workers,
                                              thread_name_prefix="weight-source"),
        interceptors=[AuthInterceptor(token, self._count_reject)],
        options=channel_options(max_message_bytes), maximum_concurrent_rpcs=max_workers)
    self._server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            self._fetch, parser(pb.FetchWeightsRequest), serialize),
        "WeightBulkAddress": grpc.unary_unary_rpc_method_handler(
            lambda request, context: self.bulk_address.encode(), None, serialize)})])
    bind = f"[{host}]" if ":" in host and not host.startswith("[") else host
    self.port = add_port(self._server, f"{bind}:{port}", tls)
    if not self.port:
      raise OSError(f"weight source: cannot bind {host}:{port}")
    shown = advertise or advertised_host(host)
    self.address = f"{shown}:{self.port}"
    self._bulk: Optional[BulkServer] = None
    self.bulk_address = ""          # "host:port" of the bulk channel ("" = gRPC only)
    if bulk:
      self._bulk = BulkServer(self._fetch, token, self._count_reject, host=host,
                              port=int(bulk_port), tls=tls,
                              parse=parser(pb.FetchWeightsRequest))
      self.bulk_address = f"{shown}:{self._bulk.port}" + (
          f",{self._bulk.local}" if self._bulk.local else "")
    self._server.start()

  def stop(self, grace: float = 0.0) -> None:
    """Stops serving (fetches in progress end; their fetchers resume elsewhere)."""
    with self.cv:
      for v in self.versions.values():
        v.dropped = True
      self.cv.notify_all()
    if self._bulk is not None:
      self._bulk.stop()
    self._server.stop(grace)

  @property
  def ring_streams(self) -> int:
    """Streams its bulk channel served through a shared-memory ring (weights/bulk.py)."""
    return self._bulk.ring_streams if self._bulk is not None else 0

  def _count_reject(self, code: grpc.StatusCode) -> None:
    with self.cv:
      self.rejected += 1

  # ---- staging (the learner) ---------------------------------------------------------------------
  def begin(self, version: int, manifest_msg: bytes, own: int, max_bytes: int = 1 << 50,
            delta_base: int = -1, delta_msg: bytes = b"") -> None:
    """Starts holding `version` (its manifest message as sent to fetchers, `own` = how many of its
    chunks this host will add). Versions older than the newest `keep` are dropped. `delta_base`
    >= 0: chunks also come as exact deltas against that version (`delta_msg`: the delta
    stream's first message, weights/delta.py), served to fetchers that hold it."""
    head = ws.parse_weight_message(manifest_msg)
    if isinstance(head, Malformed):
      raise ValueError(head.err)
    h = head.head
    manifest, sizes = ws.check_manifest(h.manifest, max_bytes)
    local = dict(manifest)
    local.pop("sources", None)      # this holder has chunks: not remote here
    v = ws.Version(h.version, h.format, h.sha256, h.total_bytes, manifest_raw=manifest_msg,
                   sizes=sizes, manifest=local, expected=int(own))
    if delta_base >= 0:
      v.delta_base, v.delta_raw = int(delta_base), delta_msg
    with self.cv:
      self.versions[int(version)] = v
      for old in sorted(self.versions)[:-self.keep]:
        self.versions.pop(old).dropped = True
      self.cv.notify_all()

  def add(self, version: int, index: int, msg: bytes, delta_msg: Optional[bytes] = None) -> None:
    """Adds one encoded chunk message (weight_chunks.encode_chunk) of a begun version, and its
    delta message when the version has a delta base."""
    with self.cv:
      v = self.versions.get(int(version))
      if v is None:
        return                       # superseded while staging: nobody will ask for it
      if v.chunks[index] is None:
        v.chunks[index] = msg
        v.delta_chunks[index] = delta_msg
        v.order.append(index)
        v.missing -= 1
        head = ws.parse_weight_message(msg)
        if not isinstance(head, Malformed):
          v.crcs[index] = head.head.crc32
        if v.missing == 0:      # the version digest ends every stream of it from now on
          v.trailer = ws.digest_message(v.version, v.crcs)
      self.cv.notify_all()

  # ---- relaying (a generator passes on what it fetched: weights/relay.py) -------------------------
  def relay_begin(self, version: int, manifest_msg: bytes, delta_base: int = -1,
                  delta_msg: bytes = b"", max_bytes: int = 1 << 50) -> None:
    """Starts relaying `version` (idempotent): its full manifest message, and the delta header
    when the chunks come as deltas against `delta_base` (then only fetchers holding that base
    are served). Chunks are added as received (`relay_add`), the digest trailer at the end."""
    with self.cv:
      if int(version) in self.versions:
        return
    head = ws.parse_weight_message(manifest_msg)
    if isinstance(head, Malformed):
      raise ValueError(head.err)
    manifest, sizes = ws.check_manifest(head.head.manifest, max_bytes)
    local = {k: v for k, v in manifest.items() if k not in ("sources", "owners")}
    v = ws.Version(head.head.version, head.head.format, head.head.sha256, head.head.total_bytes,
                   manifest_raw=manifest_msg, sizes=sizes, manifest=local)
    v.relay = True
    if delta_base >= 0:
      v.delta_base, v.delta_raw = int(delta_base), delta_msg
    with self.cv:
      if int(version) in self.versions:
        return
      self.versions[int(version)] = v
      for old in sorted(self.versions)[:-self.keep]:
        self.versions.pop(old).dropped = True
      self.cv.notify_all()

  def relay_add(self, version: int, index: int, msg: bytes, is_delta: bool) -> None:
    """One received chunk message of a relayed version (a delta one only into a delta version)."""
    with self.cv:
      v = self.versions.get(int(version))
      if v is None or not v.relay or v.chunks[index] is not None:
        return
      if is_delta and v.delta_base < 0:      # a delta into a full version: stop relaying it
        self.versions.pop(int(version)).dropped = True
      else:
        v.chunks[index] = msg
        v.order.append(index)
        v.missing -= 1
      self.cv.notify_all()

  def relay_trailer(self, version: int, msg: bytes) -> None:
    """The digest trailer received at the end of a relayed version's stream."""
    with self.cv:
      v = self.versions.get(int(version))
      if v is not None and v.relay:
        v.trailer = msg
        self.cv.notify_all()

  def held(self) -> list[int]:
    """Versions held, oldest first."""
    with self.cv:
      return sorted(self.versions)

  # ---- serving (the generators) ------------------------------------------------------------------
  def _fetch(self, request, context):
    if isinstance(request, Malformed):
      self._count_reject(grpc.StatusCode.INVALID_ARGUMENT)
      abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.err)
    try:
      wait = val.check_timeout(request.wait_timeout_s, "wait_timeout_s", self.limits)
    except val.RejectError as e:
      self._count_reject(e.code)
      abort(context, e.code, e.message)
    want, end = int(request.resume_version), time.time() + max(wait, 1.0)
    with self.cv:
      while want not in self.versions:
        newest = max(self.versions, default=-1)
        if newest > want or time.time() > end or not context.is_active():
          self.rejected += 1
          context.abort(grpc.StatusCode.NOT_FOUND,
                        f"version {want} is not held by this learner weight source "
                        f"(held: {sorted(self.versions)})")
        self.cv.wait(0.25)
      v = self.versions[want]
    # An exact delta for a fetcher that holds its base bit for bit (weights/delta.py).
    delta = bool(request.want_delta) and 0 <= v.delta_base == int(request.have_version)
    if v.relay and v.delta_base >= 0 and not delta:   # relayed deltas: only for their base
      self.rejected += 1
      context.abort(grpc.StatusCode.NOT_FOUND, f"this relay holds version {want} as a delta "
                                               f"against version {v.delta_base} only")
    self.delta_streams += delta
    n = 0
    for k, msg in enumerate(ws.stream_chunks(self.cv, v, set(request.have_chunks), context,
                                             self.stall_s, delta=delta)):
      chunk = k > 0 and msg is not v.trailer   # the manifest and the digest are not chunks
      self.served_chunks += chunk
      self.served_bytes += len(msg) if chunk and msg is not None else 0
      n += chunk
      yield msg
    log.info("served weights version %d: %d chunks to %s", want, n, context.peer())
