"""Write-ahead log of the rollout buffer (docs/RELIABILITY.md): acknowledged state survives a crash.

Layout of `--wal-dir`:
  wal-00000007.log   append-only segments; replay reads from the newest segment that starts with a
                     SNAPSHOT record (written by the startup compaction) up to the newest segment.
  weights.bin        the latest published weights: one JSON header line + the payload (written to a
                     temp file, fsynced, renamed), so a restarted buffer can serve FetchWeights.

Record framing (little endian):  u32 length | u32 crc32(payload) | payload[length]
payload = 1 type byte + body.  ROLLOUT bodies are the serialized `Rollout` bytes exactly as acked;
every other body is UTF-8 JSON.  A record whose header is short, whose length runs past the end of
the file, or whose CRC does not match is a torn tail (crash mid-write): the segment is truncated at
the start of that record and the fact is logged (and returned in the replay report).

This module must not import jax (the buffer server process does not).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
import zlib
from typing import Any, Iterator, Optional

log = logging.getLogger("scalerl.wal")

# Record types.
SNAPSHOT = 1      # {"ns", counters..., "next_group_id", "round_start", "round_leased", ...}
LEASE = 2         # {"gid", "pid", "gen", "deadline", "min_v", "max_v"}
ROLLOUT = 3       # raw serialized pb.Rollout (group_id / sample_index / rollout_id inside)
EXPIRE = 4        # {"gid"}: lease ran out; its partial samples are discarded
DELIVER = 5       # {"step", "gids"}: these groups went to learner step `step`
VERSION = 6       # {"version", "sha256", "format", "total_bytes"} (payload is in weights.bin)
NPR = 7           # {"pid", "rewards"}: one No-Positive-Resampling history update
STALE = 8         # {"gid"}: complete group dropped because its deadline passed (never delivered)
SEEN = 9          # {"ids": {rollout_id: gid}}: ids of delivered rollouts (idempotency), snapshot only
NPR_STATE = 10    # PassRateHistory.to_dict(), snapshot only
LAST_BATCH = 11   # {"step", "gids"}: snapshot only; the groups are re-sent on a retried pull
QUEUE = 12        # {"queue": [pid...], "rng": bit_generator state | null, "returned": [gid...] (the
                  # front entries' groups: PromptQueue)}: snapshot only (sampler)
EPOCH = 13        # {"order": [pid...], "rng": state}: the prompt queue was refilled (a new epoch)
KEPT = 14         # {"step", "gids"}: snapshot only; delivered groups kept for a learner rewind
DROP = 15         # {"reason", "gids"}: groups a learner rewind dropped (audit trail; no replay effect)

NAMES = {SNAPSHOT: "snapshot", LEASE: "lease", ROLLOUT: "rollout", EXPIRE: "expire",
         DELIVER: "deliver", VERSION: "version", NPR: "npr", STALE: "stale", SEEN: "seen",
         NPR_STATE: "npr_state", LAST_BATCH: "last_batch", QUEUE: "queue", EPOCH: "epoch",
         KEPT: "kept", DROP: "drop"}

FSYNC_POLICIES = ("batch", "interval", "none")
_HEADER = struct.Struct("<II")
_SEG_RE = re.compile(r"^wal-(\d{8})\.log$")
WEIGHTS_FILE = "weights.bin"
ARCHIVE = "archive"          # compacted segments when WAL(archive=True) (tools/audit.py reads them)


def encode(rtype: int, body) -> bytes:
  """One framed record."""
  if not isinstance(body, (bytes, bytearray, memoryview)):
    body = json.dumps(body, separators=(",", ":")).encode()
  payload = bytes([rtype]) + bytes(body)
  return _HEADER.pack(len(payload), zlib.crc32(payload)) + payload


def encode_parts(rtype: int, body) -> tuple:
  """`encode` without concatenating: (header + type byte, body) for a bytes-like body, so a large
  rollout is written straight from the bytes the buffer received (one CRC pass, no copies)."""
  if not isinstance(body, (bytes, bytearray, memoryview)):
    return (encode(rtype, body),)
  t = bytes((rtype,))
  return (_HEADER.pack(len(body) + 1, zlib.crc32(body, zlib.crc32(t))) + t, body)


def decode_body(rtype: int, body: bytes) -> Any:
  return body if rtype == ROLLOUT else json.loads(body)


_IOV_MAX = 1024


def _write_all(fd: int, parts: list) -> None:
  """Writes every byte of `parts` with writev, resuming after short writes (a short write then
  an error is how a full disk shows itself)."""
  views = [memoryview(p).cast("B") for p in parts if len(p)]
  while views:
    n = os.writev(fd, views[:_IOV_MAX])
    if n <= 0:
      raise OSError(errno.ENOSPC, "writev wrote nothing")
    while n > 0:
      if n >= len(views[0]):
        n -= len(views[0])
        views.pop(0)
      else:
        views[0] = views[0][n:]
        n = 0


def segments(wal_dir: str) -> list[tuple[int, str]]:
  out = []
  for name in os.listdir(wal_dir):
    m = _SEG_RE.match(name)
    if m:
      out.append((int(m.group(1)), os.path.join(wal_dir, name)))
  return sorted(out)


def read_segment(path: str, truncate: bool = True) -> tuple[list[tuple[int, bytes]], Optional[dict]]:
  """All intact records of a segment, and a description of the torn tail if there was one (the file
  is truncated to its last intact record when `truncate`)."""
  with open(path, "rb") as f:
    data = f.read()
  out, pos, n, torn = [], 0, len(data), None
  while pos < n:
    why = None
    if n - pos < _HEADER.size:
      why = f"short header ({n - pos} bytes)"
    else:
      length, crc = _HEADER.unpack_from(data, pos)
      end = pos + _HEADER.size + length
      if length < 1 or end > n:
        why = f"record length {length} runs past end of file ({n - pos - _HEADER.size} bytes left)"
      else:
        payload = data[pos + _HEADER.size:end]
        if zlib.crc32(payload) != crc:
          why = "crc32 mismatch"
    if why:
      torn = dict(segment=os.path.basename(path), offset=pos, dropped_bytes=n - pos, reason=why)
      break
    out.append((payload[0], payload[1:]))
    pos = end
  if torn is not None:
    log.warning("WAL: torn tail in %s at offset %d (%s): truncated, %d bytes dropped",
                torn["segment"], torn["offset"], torn["reason"], torn["dropped_bytes"])
    if truncate:
      with open(path, "r+b") as f:
        f.truncate(pos)
        f.flush()
        os.fsync(f.fileno())
  return out, torn


def audit_segments(wal_dir: str) -> list[str]:
  """Every segment ever written when the WAL archives (DIR/archive/ then DIR/), oldest first."""
  arch = os.path.join(wal_dir, ARCHIVE)
  old = segments(arch) if os.path.isdir(arch) else []
  return [p for _, p in sorted(old + segments(wal_dir))]


def read_all(wal_dir: str, truncate: bool = True) -> tuple[list[tuple[int, bytes]], dict]:
  """Records to replay (from the newest snapshot segment on) and a report."""
  segs = segments(wal_dir)
  start = 0
  for i in range(len(segs) - 1, -1, -1):   # newest segment that begins with a snapshot
    with open(segs[i][1], "rb") as f:
      head = f.read(_HEADER.size + 1)
    if len(head) == _HEADER.size + 1 and head[-1] == SNAPSHOT:
      recs, _ = read_segment(segs[i][1], truncate=False)
      if recs and recs[0][0] == SNAPSHOT:
        start = i
        break
  records, torn = [], []
  for i, (_, path) in enumerate(segs[start:]):
    recs, t = read_segment(path, truncate=truncate)
    records += recs
    if t:
      torn.append(t)
      if start + i != len(segs) - 1:
        log.error("WAL: corruption in %s, which is not the newest segment; later segments are "
                  "still replayed", path)
  counts: dict = {}
  for t, _ in records:
    counts[NAMES.get(t, str(t))] = counts.get(NAMES.get(t, str(t)), 0) + 1
  return records, dict(segments=[os.path.basename(p) for _, p in segs[start:]], records=counts,
                       torn=torn)


class WAL:
  """Appender. `append` buffers records; `commit` writes them and applies the fsync policy:
    batch:    fsync every commit (one per PushRequest / lease / pull / publish) — the default.
    interval: flush to the OS every commit, fsync at most every `fsync_interval_s`.
    none:     flush to the OS every commit (survives kill -9 of the buffer, not a power loss).
  """

  def __init__(self, wal_dir: str, fsync: str = "batch", fsync_interval_s: float = 1.0,
               segment_bytes: int = 1 << 30, archive: bool = False):
    if fsync not in FSYNC_POLICIES:
      raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
    os.makedirs(wal_dir, exist_ok=True)
    self.dir, self.fsync, self.fsync_interval_s = wal_dir, fsync, fsync_interval_s
    self.segment_bytes = segment_bytes
    self.archive = archive     # compaction moves old segments to DIR/archive/ (audits) instead
    self._lock = threading.Lock()
    self._pending: list = []          # bytes-like parts of the appended records
    self._pending_records = 0
    self._fd: Optional[int] = None    # the active segment, opened O_APPEND, written unbuffered
    self._path = ""
    self._end = 0                     # its size after the last durable commit
    self._torn = False                # a failed commit's bytes may still be in the segment
    self._last_sync = 0.0
    self.bytes_written = self.records_written = self.commits = 0

  # ---- writing -----------------------------------------------------------------------------------
  def _next_index(self) -> int:
    segs = segments(self.dir)
    return segs[-1][0] + 1 if segs else 0

  def start_snapshot(self, records: Iterator[bytes]) -> str:
    """Compaction: writes `records` (the first must be a SNAPSHOT) into a new segment, fsyncs it,
    makes it the active segment and deletes the older ones. Returns the new segment's name."""
    with self._lock:
      self._close_fd()
      idx = self._next_index()
      path = os.path.join(self.dir, f"wal-{idx:08d}.log")
      tmp = path + ".tmp"
      with open(tmp, "wb") as f:
        for r in records:
          f.write(r)
        f.flush()
        os.fsync(f.fileno())
      os.rename(tmp, path)
      self._fsync_dir()
      for i, p in segments(self.dir):
        if i < idx:
          if self.archive:
            os.makedirs(os.path.join(self.dir, ARCHIVE), exist_ok=True)
            os.rename(p, os.path.join(self.dir, ARCHIVE, os.path.basename(p)))
          else:
            os.remove(p)
      self._fsync_dir()
      self._open(path)
      return os.path.basename(path)

  def append(self, rtype: int, body) -> None:
    self._pending.extend(encode_parts(rtype, body))
    self._pending_records += 1

  def discard(self) -> None:
    self._pending.clear()
    self._pending_records = 0

  def commit(self) -> None:
    """Writes the appended records; raises OSError if they could not be made durable.

    A failed commit leaves nothing behind: its bytes (a partial write at ENOSPC, or whole records
    whose fsync failed) are cut off the segment before the error is raised, so the records the
    caller was told failed never reappear at replay, and later records never sit behind a torn one
    (`read_segment` stops at the first bad record; everything after it would be invisible, then
    truncated away at the next start). The segment is written unbuffered (os.writev): no library
    buffer keeps a failed record's tail to write out with the next commit. If the cut itself fails,
    every later commit fails until it succeeds."""
    with self._lock:
      if not self._pending:
        return
      parts, n = self._pending, self._pending_records
      self._pending, self._pending_records = [], 0
      size = sum(len(p) for p in parts)
      if self._fd is None:
        raise OSError("WAL not opened (start_snapshot was not called)")
      self._cut()                        # a previous failed commit's bytes, if still there
      if self._end + size > self.segment_bytes and self._end > 0:
        self._rotate()
      try:
        _write_all(self._fd, parts)      # large parts are written from the caller's bytes
        now = time.time()
        if self.fsync == "batch" or (self.fsync == "interval"
                                     and now - self._last_sync >= self.fsync_interval_s):
          os.fsync(self._fd)
          self._last_sync = now
      except OSError:
        self._torn = True
        try:
          self._cut()
        except OSError:
          pass                           # still torn: the next commit retries the cut first
        raise
      self._end += size
      self.bytes_written += size
      self.records_written += n
      self.commits += 1

  def _cut(self) -> None:
    """Truncates the active segment back to its last durable commit after a failed one."""
    if not self._torn:
      return
    assert self._fd is not None          # torn bytes are only left by a commit to an open segment
    try:
      os.ftruncate(self._fd, self._end)
      os.fsync(self._fd)
    except OSError as e:
      raise OSError(e.errno, f"WAL segment {self._path} holds a failed commit's bytes past offset "
                             f"{self._end} that could not be cut off: {e.strerror}") from e
    self._torn = False

  def _open(self, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    self._close_fd()                     # only once the new segment exists
    self._fd, self._path = fd, path
    self._end = os.fstat(self._fd).st_size
    self._torn = False

  def _close_fd(self) -> None:
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

  def _rotate(self) -> None:
    assert self._fd is not None          # commit rotates the segment it checked is open
    os.fsync(self._fd)
    self._open(os.path.join(self.dir, f"wal-{self._next_index():08d}.log"))
    self._fsync_dir()

  def _fsync_dir(self) -> None:
    try:
      fd = os.open(self.dir, os.O_RDONLY)
      try:
        os.fsync(fd)
      finally:
        os.close(fd)
    except OSError:   # pragma: no cover - some filesystems refuse directory fsync
      pass

  def close(self) -> None:
    with self._lock:
      if self._fd is not None:
        try:
          self._cut()
          os.fsync(self._fd)
        finally:
          self._close_fd()

  # ---- weights -----------------------------------------------------------------------------------
  def save_weights(self, version: int, payload: bytes, sha256: str, fmt: str) -> None:
    """Atomically replaces weights.bin (header line + payload), fsynced."""
    path = os.path.join(self.dir, WEIGHTS_FILE)
    tmp = path + ".tmp"
    head = json.dumps(dict(version=version, sha256=sha256, format=fmt,
                           total_bytes=len(payload))).encode() + b"\n"
    with open(tmp, "wb") as f:
      f.write(head)
      f.write(payload)
      f.flush()
      os.fsync(f.fileno())
    os.rename(tmp, path)
    self._fsync_dir()


def lock_dir(wal_dir: str, timeout_s: float = 30.0) -> int:
  """Takes an exclusive POSIX lock on WAL_DIR/LOCK (per process, held until it exits), waiting up to
  `timeout_s` for a previous buffer (e.g. one still shutting down after its learner died) to let
  go: two buffers must never append to one log. Returns the descriptor; raises TimeoutError."""
  fd = os.open(os.path.join(wal_dir, "LOCK"), os.O_RDWR | os.O_CREAT, 0o644)
  end = time.time() + timeout_s
  while True:
    try:
      fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      return fd
    except OSError:
      if time.time() > end:
        os.close(fd)
        raise TimeoutError(f"WAL dir {wal_dir} is locked by another buffer process") from None
      time.sleep(0.05)


def load_weights(wal_dir: str) -> Optional[tuple[dict, bytes]]:
  """(header, payload) of weights.bin, or None if absent or damaged (size/sha256 checked)."""
  path = os.path.join(wal_dir, WEIGHTS_FILE)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    head = json.loads(f.readline())
    payload = f.read()
  if len(payload) != head["total_bytes"] or hashlib.sha256(payload).hexdigest() != head["sha256"]:
    log.error("WAL: %s is damaged (size or sha256 mismatch); ignored", path)
    return None
  return head, payload
