"""The bulk weight channel (weights/bulk.py): a weight source's chunks over a plain TCP stream, or
over its local (same network namespace) Unix socket where the fetcher can reach it.

Exactness: versions fetched over it are bit-identical to the publisher's, also when a stream breaks
mid-version (the fetch resumes with the chunks it holds) and when chunks are staged out of order;
the delta trajectory test (tests/weights/test_delta.py) runs over it too (it is the default). Security:
a connection without the right token is refused with one UNAUTHENTICATED line and counted; over TLS
(tests/protocol/test_tls.py) a plaintext client is refused. Bad streams: an oversize frame, a stream that ends
inside a frame, a chunk whose bytes do not match its CRC: each a clear error, nothing counted as held.
A bulk channel that does not connect is a counted fallback to gRPC; a local listener that is not
reachable (another host or pod) is TCP, not a fallback."""
import os
import socket
import struct

import numpy as np
import pytest

from helpers import weight_serving
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.types import WeightUpdateError
from scalerl_jax.weights import bulk as wb
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher, flatten

TOKEN = "bulk-test-token"


@pytest.fixture
def serving():
  with weight_serving(TOKEN, keep=3) as cs:
    yield cs


def _params(seed):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((96, 64)).astype(np.float32),
          "layers": [{"w": rng.standard_normal((64, 48)).astype(np.float32),
                      "b": rng.standard_normal((7,)).astype(np.float32)} for _ in range(3)]}


def _same(got, params) -> bool:
  return all(np.array_equal(np.asarray(a), np.asarray(b)) and np.asarray(a).dtype == b.dtype
             for (_, a), (_, b) in zip(flatten(got), flatten(params)))


TRANSPORTS = ("tcp", "local", "ring")


def _fetcher(c, transport: str) -> StreamFetcher:
  """A fetcher that reads over `transport`: TCP, the local socket, or its shared-memory ring."""
  f = StreamFetcher(c, delta=False)
  f.bulk_local, f.bulk_ring = transport != "tcp", transport == "ring"
  return f


def _on_chunk_send(monkeypatch, transport: str, edit) -> None:
  """Every chunk message the server sends goes through `edit(msg) -> msg` first (which may raise
  to break the connection), on the path `transport` sends chunks by (the server hands both paths
  the message parsed)."""
  def edited(c):
    return ws.parse_weight_message(edit(ws.with_data(c.head.SerializeToString(), c.data)))
  if transport == "ring":
    real_ring = wb._Ring.send
    monkeypatch.setattr(wb._Ring, "send", lambda self, c: real_ring(self, edited(c)) if len(
        c.data) else False)
  else:
    real = wb._send_message

    def send(conn, msg, c):
      if len(c.data):
        c = edited(c)
        msg = ws.with_data(c.head.SerializeToString(), c.data)
      real(conn, msg, c)
    monkeypatch.setattr(wb, "_send_message", send)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_versions_over_bulk_are_exact_through_break_resume_and_reorder(serving, monkeypatch,
                                                                        transport):
  c, src = serving
  f = _fetcher(c, transport)
  assert src.bulk_address and c.peer(src.address).bulk_address() == src.bulk_address
  for v in range(4):
    params = _params(v)
    pub = StreamPublisher(c, v, params, chunk_bytes=2048, source=src)
    if v == 2:
      pub.own = list(np.random.default_rng(0).permutation(pub.own))   # staged out of order
    pub.publish()
    if v == 1:                                # the server drops the connection after 3 chunks
      sent = [0]

      def drop(msg):
        sent[0] += 1
        if sent[0] == 4:
          raise OSError("connection dropped (test)")
        return msg
      with monkeypatch.context() as m:
        _on_chunk_send(m, transport, drop)
        with pytest.raises(wb.BulkError, match="DATA_LOSS|ended"):
          f.fetch(v - 1, wait_timeout_s=10)
      assert 1 <= len(f._partial["have"]) < len(pub.plan)
      held = len(f._partial["have"])
      served = src.served_chunks
    got = f.fetch(v - 1, wait_timeout_s=10)
    assert got.version == v and _same(got.params, params), v
    if v == 1:                                # resumed: only the missing chunks were sent again
      assert src.served_chunks - served == len(pub.plan) - held
  assert f.bulk_streams == 5 and f.bulk_fallbacks == 0 and f.digests_checked == 4
  assert f.local_streams == (0 if transport == "tcp" else 5)
  assert src.ring_streams == (5 if transport == "ring" else 0)


def test_unauthenticated_connection_is_refused_and_counted(serving):
  c, src = serving
  StreamPublisher(c, 0, _params(0), chunk_bytes=2048, source=src).publish()
  req = pb.FetchWeightsRequest(resume_version=0, streamed=True, wait_timeout_s=1)
  before = src.rejected
  tcp, local = wb.split_address(src.bulk_address)
  assert local.startswith("@scalerl-bulk-")
  for address in (src.bulk_address, tcp):            # the local listener, then TCP
    for token in ("wrong-token", ""):
      sock = wb.connect(address, token, req)
      assert sock.family == (socket.AF_UNIX if address == src.bulk_address else socket.AF_INET)
      with pytest.raises(wb.BulkError, match="UNAUTHENTICATED: .*bearer token"):
        list(wb.messages(sock, lambda h, n: None, 1 << 20))
      sock.close()
  host, port = tcp.rsplit(":", 1)
  raw = socket.create_connection((host, int(port)))
  raw.sendall(b"GET / HTTP/1.1\r\n\r\n")       # not a bulk client at all
  with pytest.raises(wb.BulkError, match="UNAUTHENTICATED"):
    list(wb.messages(raw, lambda h, n: None, 1 << 20))
  raw.close()
  assert src.rejected - before == 5 and src.served_chunks == 0
  ok = wb.connect(src.bulk_address, TOKEN, req)       # the right token: served
  got = list(wb.messages(ok, lambda h, n: None, 1 << 20))
  ok.close()
  assert len(got) == src.served_chunks + 2            # manifest + chunks + digest trailer


def _frames(*parts: bytes):
  """A client socket whose peer sent `parts` and closed."""
  a, b = socket.socketpair()
  b.sendall(b"".join(parts))
  b.close()
  return a


def test_oversize_truncated_and_bad_frames_are_clear_errors():
  head = pb.WeightChunk(version=3, chunk_index=0, crc32=1).SerializeToString()
  cases = [
      (_frames(wb.FRAME.pack(wb.CHUNK, len(head), 1 << 30), head), "bad frame .* at most 1024"),
      (_frames(wb.FRAME.pack(wb.CHUNK, len(head), 100), head, b"x" * 40), "ended inside chunk 0 "
                                                                          r"\(40 of 100 bytes\)"),
      (_frames(wb.FRAME.pack(wb.MSG, 10, 0), b"abc"), r"ended inside a frame head \(3 of 10"),
      (_frames(b"\x01\x02"), "ended inside a frame header"),
      (_frames(wb.FRAME.pack(7, 0, 0)), "bad frame"),
      (_frames(wb.FRAME.pack(wb.MSG, 3, 0), b"\xff\xff\xff"), "DATA_LOSS"),
  ]
  for sock, match in cases:
    with pytest.raises(wb.BulkError, match=match):
      list(wb.messages(sock, lambda h, n: None, 1024))
    sock.close()
  good = _frames(wb.FRAME.pack(wb.CHUNK, len(head), 4), head, b"abcd", wb.FRAME.pack(wb.END, 0, 0))
  dst = bytearray(4)
  (m,) = list(wb.messages(good, lambda h, n: memoryview(dst), 1024))
  assert m.placed and bytes(dst) == b"abcd" and m.head.version == 3 and m.head.chunk_index == 0


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_corrupted_chunk_over_bulk_is_refused_and_not_held(serving, monkeypatch, transport):
  """A chunk read in place (or copied out of the ring) whose bytes do not match its CRC:
  WeightUpdateError naming the tensor; the chunk is not counted as held (the next fetch gets it
  again, exact)."""
  c, src = serving
  params = _params(5)
  StreamPublisher(c, 0, params, chunk_bytes=2048, source=src).publish()

  def flip(msg):
    m = ws.parse_weight_message(msg)
    if m.head.chunk_index == 2:
      data = bytearray(m.data)
      data[0] ^= 1
      msg = ws.with_data(m.head.SerializeToString(), bytes(data))
    return msg
  f = _fetcher(c, transport)
  with monkeypatch.context() as m:
    _on_chunk_send(m, transport, flip)
    with pytest.raises(WeightUpdateError, match="chunk 2: checksum mismatch"):
      f.fetch(-1, wait_timeout_s=10)
  assert 2 not in f._partial["have"]
  got = f.fetch(-1, wait_timeout_s=10)
  assert got.version == 0 and _same(got.params, params)


def test_bulk_channel_that_does_not_connect_falls_back_to_grpc_counted(serving):
  c, src = serving
  params = _params(7)
  dead = socket.socket()
  dead.bind(("127.0.0.1", 0))
  port = dead.getsockname()[1]
  dead.close()                                   # nothing listens there
  src.bulk_address = f"127.0.0.1:{port}"
  StreamPublisher(c, 0, params, chunk_bytes=2048, source=src).publish()
  f = StreamFetcher(c, delta=False)
  got = f.fetch(-1, wait_timeout_s=10)
  assert got.version == 0 and _same(got.params, params)
  assert f.bulk_fallbacks == 1 and f.bulk_streams == 0 and src.served_chunks > 1


def test_local_listener_in_the_same_namespace_tcp_elsewhere(serving):
  """A fetcher in the source's network namespace reads over its local Unix socket (exact, counted
  in `local_streams`); with `bulk_local` off, or when the local name is not reachable (as from
  another host or pod, where the abstract name does not exist), over TCP: no fallback counted."""
  c, src = serving
  f = StreamFetcher(c, delta=False)
  for v, (local_on, bogus) in enumerate([(True, False), (False, False), (True, True)]):
    params = _params(20 + v)
    StreamPublisher(c, v, params, chunk_bytes=2048, source=src).publish()
    f.bulk_local = local_on
    if bogus:                                  # what a fetcher on another host is told
      f._bulk_of[src.address] = wb.split_address(src.bulk_address)[0] + ",@scalerl-bulk-absent"
    local_before, bulk_before = f.local_streams, f.bulk_streams
    got = f.fetch(v - 1, wait_timeout_s=10)
    assert got.version == v and _same(got.params, params)
    assert f.bulk_streams == bulk_before + 1 and f.bulk_fallbacks == 0
    assert f.local_streams == local_before + (local_on and not bogus), (v, local_on, bogus)
  assert wb.split_address("10.0.0.1:50054") == ("10.0.0.1:50054", "")
  assert wb.split_address("h:1,@n") == ("h:1", "@n")


def test_ring_is_local_only_reused_and_checks_its_input(serving):
  """The shared-memory ring: granted only on a local connection (a ring request over TCP gets
  inline chunks, exact); a clean stream's ring serves the next connection; a client that
  acknowledges a slot not in use gets INVALID_ARGUMENT (and that ring is not reused); a slot frame without a ring, a ring frame
  without its descriptor and a slot outside the ring are DATA_LOSS on the client."""
  c, src = serving
  params = _params(30)
  pub = StreamPublisher(c, 0, params, chunk_bytes=2048, source=src)
  pub.publish()
  req = pb.FetchWeightsRequest(resume_version=0, streamed=True, wait_timeout_s=1)
  tcp, local = wb.split_address(src.bulk_address)
  host, port = tcp.rsplit(":", 1)
  raw = socket.create_connection((host, int(port)))          # a ring asked for over TCP
  body = req.SerializeToString()
  raw.sendall(wb.MAGIC_RING + struct.pack("<H", len(TOKEN)) + TOKEN.encode() +
              struct.pack("<I", len(body)) + body)
  msgs = list(wb.messages(raw, lambda h, n: None, 1 << 20))
  raw.close()
  assert src.ring_streams == 0 and sum(len(m.data) > 0 for m in msgs) == len(pub.plan) > 1
  f = _fetcher(c, "ring")
  for v in (0, 1):
    if v:
      StreamPublisher(c, v, _params(31), chunk_bytes=2048, source=src).publish()
    got = f.fetch(v - 1, wait_timeout_s=10)
    assert got.version == v and _same(got.params, params if v == 0 else _params(31))
  assert src.ring_streams == 2 and src._bulk.rings_made == 1          # the second reused it
  bad = wb.connect(src.bulk_address, TOKEN, req)               # acknowledges slot 7 of 4
  hdr = bytearray(wb.FRAME.size)
  fds: list = []
  wb._recv_header(bad, hdr, fds)
  kind, hn, _ = wb.FRAME.unpack(hdr)
  assert kind == wb.RING and len(fds) == 1 and len(bad.recv(hn, socket.MSG_WAITALL)) == hn
  for fd in fds:
    os.close(fd)
  bad.sendall(wb.SLOT_INDEX.pack(7))
  while True:                                  # manifest, the slots it filled, the error
    hdr = bad.recv(wb.FRAME.size, socket.MSG_WAITALL)
    kind, hn, _ = wb.FRAME.unpack(hdr)
    head = bad.recv(hn, socket.MSG_WAITALL)
    if kind not in (wb.MSG, wb.SLOT):
      break
  assert kind == wb.ERR and b"INVALID_ARGUMENT" in head and b"slot 7 is not in use" in head
  bad.close()
  StreamPublisher(c, 2, _params(32), chunk_bytes=2048, source=src).publish()
  assert _same(f.fetch(1, wait_timeout_s=10).params, _params(32))
  assert src._bulk.rings_made == 2                              # the broken one was not reused
  head = pb.WeightChunk(version=3, chunk_index=0, crc32=1).SerializeToString()
  ring_head = wb.RING_HEAD.pack(wb.RING_SLOTS, wb.RING_SLOT_BYTES)
  for sock, match in [
      (_frames(wb.FRAME.pack(wb.SLOT, len(head) + 4, 4), head, wb.SLOT_INDEX.pack(0)),
       "a slot frame without a ring"),
      (_frames(wb.FRAME.pack(wb.RING, len(ring_head), 0), ring_head), "ring frame with 0 desc")]:
    with pytest.raises(wb.BulkError, match=match):
      list(wb.messages(sock, lambda h, n: None, 1024))
    sock.close()
  a, b = socket.socketpair()                                   # a real ring, slot 9 of 4
  fd = os.memfd_create("test-ring")
  os.ftruncate(fd, wb.RING_SLOTS * wb.RING_SLOT_BYTES)
  socket.send_fds(b, [wb.FRAME.pack(wb.RING, len(ring_head), 0) + ring_head], [fd])
  os.close(fd)
  b.sendall(wb.FRAME.pack(wb.SLOT, len(head) + 4, 4) + head + wb.SLOT_INDEX.pack(9))
  b.close()
  with pytest.raises(wb.BulkError, match="DATA_LOSS: slot 9 of 4"):
    list(wb.messages(a, lambda h, n: None, 1024))
  a.close()


def test_frame_header_layout():
  """Little-endian <kind u8, head_len u32, data_len u64> (docs/ROLLOUT.md "Bulk weight channel")."""
  assert wb.FRAME.size == 13
  assert wb.FRAME.pack(wb.CHUNK, 5, 1 << 33) == struct.pack("<BIQ", 1, 5, 1 << 33)
