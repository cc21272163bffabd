"""The buffer's weight store: PublishWeights / FetchWeights / WatchVersion (docs/ROLLOUT.md "Weights").

Versions travel as `WeightChunk` messages (rollout.proto):
  streamed  a JSON manifest (tensors + chunk table, its sha256 in the header) then chunks in any
            order, each with its own checksum (the manifest's "checksum": "crc32c" (Castagnoli,
            hardware, ~25 GB/s) or "crc32" (zlib, the default when absent)), possibly from several
            publishers (one per host); chunks are kept as they arrive (a broken publish resumes from
            the missing ones, which PublishAck lists), and the version becomes visible once every
            chunk is present and verified. Fetchers get the manifest and then the chunks as the
            publishers' raw message bytes (no re-encoding, no server-side copy); a fetcher resumes
            with `have_chunks`.
  remote    a streamed manifest with "sources" (one learner weight server address per learner
            process, weights/source.py) and "owners" (the source index of each chunk): the chunks
            stay on the learner hosts and the buffer only announces the version (visible at once);
            fetchers read the manifest here and the chunks from the sources.

Requests are split by `parse_weight_message` without copying `data` (a memoryview into the bytes
gRPC handed over). A publish without a manifest (the removed one-payload "blob" protocol) is
INVALID_ARGUMENT, a fetch without `streamed` FAILED_PRECONDITION. This module must not import jax.
"""
from __future__ import annotations

import hashlib
import threading
import time
from typing import Iterator, Optional

import grpc

from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.protocol.weight_chunks import STREAM_PREFIX, Version, check_manifest, stream_chunks


class UnsupportedWeightsFormat(ValueError):
  """The WAL's weights.bin holds a version this buffer cannot serve (a blob of the removed
  protocol): it names the format."""


class WeightStore:
  """Newest visible weights + streamed versions being assembled; serves the three weight RPCs for
  a `BufferServer` (`srv`: abort, call, state, wal, limits, max_weight_bytes)."""

  def __init__(self, srv, max_pending: int = 2):
    self.srv, self.max_pending = srv, max_pending
    self.visible: Optional[Version] = None
    self.pending: dict[int, Version] = {}
    self.cv = threading.Condition()

  @property
  def version(self) -> int:
    return self.visible.version if self.visible else 0

  def restore(self, head: dict, payload: bytes) -> None:
    """Reloads the WAL's weights.bin (a packed streamed version, `Version.pack`). Raises
    UnsupportedWeightsFormat for any other format (a blob written before that protocol was removed)."""
    fmt = str(head.get("format", ""))
    if not fmt.startswith(STREAM_PREFIX):
      raise UnsupportedWeightsFormat(
          f"WAL weights.bin: version {head.get('version')} has format {fmt!r}, a one-payload blob "
          f"of the removed blob protocol; this buffer restores only streamed versions "
          f"({STREAM_PREFIX!r}...). Delete weights.bin (the learner republishes its version).")
    self.visible = Version.unpack(payload, self.srv.max_weight_bytes)

  # ---- publish -----------------------------------------------------------------------------------
  def publish(self, request_iterator, context) -> pb.PublishAck:
    """PublishWeights handler: the first message carries the manifest, the rest are chunks."""
    srv = self.srv
    first = next(iter(request_iterator), None)
    if first is None:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "no chunks sent")
    first = srv._req(first, context)
    h = first.head
    if h.version < 0:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"version {h.version} < 0")
    if h.total_bytes > srv.max_weight_bytes:
      srv._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 f"total_bytes {h.total_bytes} > limit {srv.max_weight_bytes}")
    if len(h.sha256) != 64 or any(ch not in "0123456789abcdef" for ch in h.sha256):
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "sha256 must be 64 lowercase hex chars")
    if len(h.format) > srv.limits.max_id_chars:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "format string too long")
    if not h.manifest:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                 "the first message carries no manifest (the one-payload blob protocol was "
                 "removed: publish with weights.stream.StreamPublisher)")
    return self._publish_streamed(first, request_iterator, context)

  def _check_newer(self, context, version: int, sha256: str) -> bool:
    """True if (version, sha256) is the visible version already (idempotent re-publish)."""
    cur = self.visible
    if cur is not None and version == cur.version and sha256 == cur.sha256:
      return True
    if cur is not None and cur.remote and version == cur.version:
      return False      # the same version re-announced from new sources (a restarted learner)
    if cur is not None and version <= cur.version:
      if self.srv.learner_resumed():      # a resumed learner republishes its checkpoint
        self.srv.abort_for_restart(context)
      self.srv._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                      f"version {version} is not newer than published version {cur.version}")
    return False

  def _publish_streamed(self, first, request_iterator, context):
    srv, h = self.srv, first.head
    if first.data or hashlib.sha256(h.manifest.encode()).hexdigest() != h.sha256:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                 "streamed publish: the first message carries only the manifest and its sha256")
    try:
      manifest, sizes = check_manifest(h.manifest, srv.max_weight_bytes)
    except OverflowError as e:
      srv._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
    except (ValueError, KeyError, TypeError, IndexError) as e:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"bad manifest: {e!r}"[:300])
    if sum(sizes) != h.total_bytes:
      srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                 f"total_bytes {h.total_bytes} != manifest's {sum(sizes)}")
    with self.cv:
      if self._check_newer(context, h.version, h.sha256):
        return pb.PublishAck(version=h.version, total_bytes=h.total_bytes, visible=True)
      v = self.pending.get(h.version)
      if v is not None and v.sha256 != h.sha256:
        srv._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                   f"version {h.version} is being assembled from a different manifest")
      if v is None:
        mraw = pb.WeightChunk(version=h.version, total_bytes=h.total_bytes, sha256=h.sha256,
                              format=h.format, manifest=h.manifest).SerializeToString()
        v = Version(h.version, h.format, h.sha256, h.total_bytes, manifest_raw=mraw, sizes=sizes,
                    manifest=manifest)
        if v.remote:       # announced: the chunks are served by the learner hosts
          self._make_visible(context, v)
          return pb.PublishAck(version=h.version, total_bytes=h.total_bytes, visible=True)
        self.pending[h.version] = v
        for old in sorted(self.pending)[:-self.max_pending]:   # bound memory: newest few only
          self.pending.pop(old).dropped = True
        self.cv.notify_all()                                  # pipelined fetchers may start
    for item in request_iterator:
      c = srv._req(item, context)
      ch = c.head
      if ch.version != h.version or ch.manifest:
        srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   "streamed publish: a chunk of another version, or a second manifest")
      i = ch.chunk_index
      if i >= len(sizes) or len(c.data) != sizes[i]:
        srv._abort(context, grpc.StatusCode.INVALID_ARGUMENT,
                   f"chunk {i}: index or size does not match the manifest")
      if v.checksum(c.data) != ch.crc32:
        srv._abort(context, grpc.StatusCode.DATA_LOSS, f"chunk {i}: checksum mismatch")
      with self.cv:
        if v.dropped:
          srv._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                     f"version {h.version} was superseded before it was complete")
        if v.chunks[i] is None:
          v.chunks[i] = c.raw
          v.order.append(i)
          v.missing -= 1
          if v.missing == 0:
            self._make_visible(context, v)
          else:
            self.cv.notify_all()
    with self.cv:
      return pb.PublishAck(version=h.version, total_bytes=h.total_bytes,
                           missing_chunks=v.missing_list(), visible=v.missing == 0)

  def _make_visible(self, context, v: Version) -> None:
    """Under cv: persist (WAL), admit the version, swap it in, wake fetchers and watchers."""
    srv = self.srv
    meta = dict(sha256=v.sha256, format=v.format, total_bytes=v.total_bytes)
    if srv.wal is not None:   # the payload file first: a replayed VERSION always has its weights
      packed = v.pack()
      try:
        srv.wal.save_weights(v.version, packed, hashlib.sha256(packed).hexdigest(),
                             STREAM_PREFIX + v.format)
      except OSError as e:
        srv._abort(context, grpc.StatusCode.UNAVAILABLE, f"cannot persist weights: {e}")
    # Admission first: a generator can only stamp the new version after fetching its payload.
    srv._call(context, srv.state.set_version, v.version, meta)
    self.visible = v
    for old in [k for k in self.pending if k <= v.version]:
      self.pending.pop(old).dropped = old != v.version
    self.cv.notify_all()

  # ---- fetch / watch -----------------------------------------------------------------------------
  def fetch(self, request, context) -> Iterator[Optional[bytes]]:
    """FetchWeights handler: long-polls for a version newer than have_version, then streams it."""
    srv = self.srv
    r = srv._req(request, context)
    timeout = srv._call(context, val.check_timeout, r.wait_timeout_s, "wait_timeout_s", srv.limits)
    if not r.streamed:
      srv._abort(context, grpc.StatusCode.FAILED_PRECONDITION,
                 "fetch with streamed=true (weights.stream.StreamFetcher): the one-payload blob "
                 "protocol was removed")
    end = time.time() + timeout
    with self.cv:
      while True:
        v = self._newest(r.have_version, timeout > 0)
        left = end - time.time()
        if v is not None or left <= 0 or not context.is_active():
          break
        self.cv.wait(min(left, 0.25))
    if v is None:
      return
    yield from stream_chunks(self.cv, v, set(r.have_chunks) if r.resume_version == v.version
                             else (), context, max(timeout, 10.0))

  def _newest(self, have: int, pipelined: bool) -> Optional[Version]:
    """Under cv: the newest version above `have`: the visible one, or when `pipelined` (a
    long-poll) also a version still being published (its chunks are forwarded as they arrive)."""
    best = self.visible if self.visible is not None and self.visible.version > have else None
    if pipelined and self.pending:
      top = self.pending[max(self.pending)]
      if top.version > have and (best is None or top.version > best.version):
        best = top
    return best

  def watch(self, request, context) -> Iterator[pb.VersionNotice]:
    """WatchVersion handler: one notice per newly visible version."""
    have = self.srv._req(request, context).have_version
    while context.is_active():
      with self.cv:
        v = self.visible
        if v is None or v.version <= have:
          self.cv.wait(0.25)
          continue
        have = v.version
      yield pb.VersionNotice(version=v.version, total_bytes=v.total_bytes, sha256=v.sha256)
