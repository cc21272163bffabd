"""The bulk weight channel: a weight source's chunks over a plain stream socket, outside gRPC's
per-message path (issue 44, "at the limit of the machine").

Why: a FetchWeights stream through gRPC copies each 8 MB chunk about four times in user space
(gRPC's send slices, its receive slices, the Python `bytes` it hands over, the fetcher's copy into
its box) and runs every message through the Python iterator protocol on both ends (profile in
docs/SCALE.md). Here the sender writes each staged chunk message's bytes straight from the held
message (`socket.sendall` of a memoryview) and the receiver reads them straight into the
generator's destination array (`recv_into` the chunk's box): one copy into the socket, one out.

Transports. Every server listens on TCP and, on Linux, on a Unix socket with an abstract name
("@scalerl-bulk-<port>-<random>": no file, reachable only from the same network namespace, i.e.
the same host and pod). `WeightBulkAddress` answers "host:port,@name"; a client tries the local
name first and uses TCP where it does not exist (another host or pod; not a fallback). On a local
connection without TLS the client may ask for a shared-memory ring (`_Ring`): the server passes a
memfd of RING_SLOTS x RING_SLOT_BYTES once (SCM_RIGHTS), copies each chunk into a free slot and
announces it; the client copies the slot into its box and acknowledges it. One copy on each side
and none through the kernel's socket buffers (docs/SCALE.md: 0.35-0.38 of memcpy per stream against
0.25-0.29 over loopback TCP on a 2-core EPYC).

Same security as the gRPC channel: the bearer token is the first thing a client sends (compared in
constant time; a wrong or missing token gets one UNAUTHENTICATED line and the connection closed,
counted in the source's `rejected`), and with `tls` enabled both ends wrap the socket in the run's
TLS (`rpc.TLS`: the same certificate, CA, mutual and server_name settings as every gRPC channel),
on the local socket too (then without a ring: every byte goes through TLS). Nothing is trusted
more than on gRPC: every chunk keeps its CRC-32C (checked by the fetcher after `recv_into` or the
slot copy, before the chunk counts), deltas their result CRC, versions their digest trailer.

Wire (little-endian):
  client -> server: MAGIC (or MAGIC_RING: the same, asking for a ring), u16 token length, token,
                    u32 request length, FetchWeightsRequest; with a ring, then u32 slot indices
                    (acknowledgements: the slot's bytes were copied out)
  server -> client: frames of <kind u8, head_len u32, data_len u64>, head, data
    MSG   (0): head = one whole serialized WeightChunk (manifest, delta manifest, digest trailer)
    CHUNK (1): head = a WeightChunk without its data field, data = the chunk's bytes
    ERR   (2): head = "<grpc status name>: <message>" (the gRPC path's abort), then close
    END   (3): the stream ended (a short stream is resumed by the fetcher, as on gRPC)
    RING  (4): head = <u32 slots, u32 bytes per slot>, the memfd passed with it (a ring's first
               frame, before any other)
    SLOT  (5): head = a WeightChunk without its data field + u32 slot; data_len = the chunk's
               bytes, which are in that slot (not on the socket)
A frame larger than the client's `max_bytes`, a slot outside the ring, a ring frame without its
descriptor or a stream that ends inside a frame is a clear `BulkError` (an IOError: the fetcher's
transport handling resumes or falls back); an acknowledgement of a slot not in use ends the
stream with INVALID_ARGUMENT. Discovery: a WeightSource with a bulk listener answers the unary
gRPC method `WeightBulkAddress` (token-checked like every call); a fetcher that gets none (an
older source, the buffer) uses gRPC. No JAX.
"""
from __future__ import annotations

import hmac
import logging
import mmap
import os
import secrets
import socket
import ssl
import struct
import threading
from typing import Callable, Iterator, Optional

import numpy as np

from scalerl_jax import hosts
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.protocol.rpc import TLS
from scalerl_jax.protocol.wire import Malformed

log = logging.getLogger("scalerl.weight_bulk")
MAGIC = b"SCALERL-BULK-1\n"
MAGIC_RING = b"SCALERL-BULK-R\n"    # the same, asking for a shared-memory ring (local, no TLS)
MSG, CHUNK, ERR, END, RING, SLOT = 0, 1, 2, 3, 4, 5
FRAME = struct.Struct("<BIQ")
RING_HEAD = struct.Struct("<II")     # a RING frame's head: slots, bytes per slot
SLOT_INDEX = struct.Struct("<I")     # after a SLOT frame's chunk head; a client's ack of a slot
RING_SLOTS = 4
RING_SLOT_BYTES = 8 << 20            # the default chunk size: larger chunks go inline
RING_SPARE = 2                       # idle rings a server keeps for its next local connections
MAX_HELLO = 1 << 20                  # token + request bytes a server reads before auth


class BulkError(IOError):
  """A bulk stream that failed: `code` is the gRPC status name the gRPC path would have raised
  ("NOT_FOUND", "UNAUTHENTICATED", "DATA_LOSS" for a malformed or truncated stream, ...)."""

  def __init__(self, code: str, message: str):
    super().__init__(f"bulk weight stream: {code}: {message}")
    self.code_name = code


def _server_context(tls: TLS) -> ssl.SSLContext:
  tls.check(server=True)
  ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
  ctx.load_cert_chain(tls.cert, tls.key)
  if tls.mutual:
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_verify_locations(tls.ca)
  return ctx


def _client_context(tls: TLS) -> ssl.SSLContext:
  tls.check()
  ctx = ssl.create_default_context(cafile=tls.ca or None)
  if tls.mutual and tls.cert:
    ctx.load_cert_chain(tls.cert, tls.key)
  return ctx


def _recv_exact(sock, view: memoryview, what: str) -> None:
  """Fills `view` from the socket (recv_into, no intermediate buffer; a plain blocking socket
  waits in the kernel for all of it, MSG_WAITALL: one wake-up per chunk instead of one per
  socket buffer); BulkError if it ends."""
  got, n = 0, len(view)
  flags = socket.MSG_WAITALL if not isinstance(sock, ssl.SSLSocket) and \
      sock.gettimeout() is None else 0
  while got < n:
    try:
      k = sock.recv_into(view[got:], n - got, flags)
    except ConnectionError as e:
      raise BulkError("DATA_LOSS", f"the stream broke inside {what} ({got} of {n} bytes): "
                                   f"{e}") from None
    if not k:
      raise BulkError("DATA_LOSS", f"the stream ended inside {what} ({got} of {n} bytes)")
    got += k


LOCAL_SNDBUF = 8 << 20      # a local stream's send buffer (the kernel caps it at 2 x wmem_max)


def _tune(sock: socket.socket) -> None:
  """TCP: no Nagle delay on the small frame headers; socket buffers stay auto-tuned (a fixed
  SO_RCVBUF would cap them at net.core.rmem_max). Unix: a send buffer as large as the kernel
  allows (what a local stream has in flight; its default, ~200 KB, costs a wake-up per 200 KB)."""
  if sock.family == socket.AF_UNIX:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOCAL_SNDBUF)
  else:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Context:
  """What WeightSource._fetch needs of a gRPC ServicerContext, for a bulk connection."""

  def __init__(self, peer: str):
    self._peer, self.closed = peer, False

  def is_active(self) -> bool:
    return not self.closed

  def peer(self) -> str:
    return self._peer

  def abort(self, code, message: str):
    raise BulkError(code.name, message)


class BulkServer:
  """The bulk listener of one WeightSource (see the module docstring): `serve(request, context)`
  is the source's FetchWeights generator (messages as staged); `token` its bearer token,
  `on_reject` counts refused connections."""

  def __init__(self, serve: Callable, token: str, on_reject: Callable, *, host: str, port: int = 0,
               tls: Optional[TLS] = None, parse: Callable = pb.FetchWeightsRequest.FromString):
    self._serve, self._expected, self._on_reject = serve, token.encode(), on_reject
    self._parse = parse             # the source's strict request parser (Malformed on bad bytes)
    self._ssl = _server_context(tls) if tls is not None and tls.enabled else None
    host = hosts.resolve_host(host)   # as the gRPC servers bind (rehearsal: 0.0.0.0 -> the pod's IP)
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    self._sock = socket.socket(family, socket.SOCK_STREAM)
    self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._sock.bind((host.strip("[]"), int(port)))
    self._sock.listen(64)
    self.port = self._sock.getsockname()[1]
    self._stopped = threading.Event()
    self._conns: set = set()
    self._lock = threading.Lock()
    self.local = ""                 # "@name": the same-network-namespace listener ("" = none)
    self.ring_streams = 0           # streams served through a shared-memory ring
    self._rings: list = []          # idle rings (`_Ring`), at most RING_SPARE
    self.rings_made = 0
    self._local: Optional[socket.socket] = None
    if hasattr(socket, "AF_UNIX"):
      name = f"scalerl-bulk-{self.port}-{secrets.token_hex(8)}"
      try:
        self._local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._local.bind("\0" + name)       # Linux abstract name: no file, gone with the socket
        self._local.listen(64)
        self.local = "@" + name
      except OSError as e:                  # not Linux: TCP only
        log.info("bulk weight channel: no local listener (%s)", e)
        self._local = None
    for lst in (self._sock, self._local):
      if lst is not None:
        threading.Thread(target=self._accept, args=(lst,), daemon=True,
                         name="weight-bulk-accept").start()

  def stop(self) -> None:
    """Closes the listener and every open connection (their fetchers resume elsewhere)."""
    self._stopped.set()
    with self._lock:
      rings, self._rings = self._rings, []
    for r in rings:
      r.close()
    for lst in (self._sock, self._local):
      try:
        if lst is not None:
          lst.close()
      except OSError:
        pass
    with self._lock:
      conns = list(self._conns)
    for c in conns:
      try:
        c.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass

  def _accept(self, lst: socket.socket) -> None:
    while not self._stopped.is_set():
      try:
        conn, addr = lst.accept()
      except OSError:
        return
      if lst.family == socket.AF_UNIX:
        addr = ("local", self.local)
      threading.Thread(target=self._handle, args=(conn, addr), daemon=True,
                       name="weight-bulk").start()

  def _hello(self, conn):
    """Reads and checks the client's hello: the token first (nothing else is parsed before it
    matches), then its FetchWeightsRequest."""
    head = bytearray(len(MAGIC) + 2)
    _recv_exact(conn, memoryview(head), "the hello")
    magic = bytes(head[:len(MAGIC)])
    if magic not in (MAGIC, MAGIC_RING):
      raise BulkError("UNAUTHENTICATED", "not a scalerl bulk weight client")
    (n,) = struct.unpack_from("<H", head, len(MAGIC))
    token = bytearray(n)
    _recv_exact(conn, memoryview(token), "the token")
    if not hmac.compare_digest(bytes(token), self._expected):
      raise BulkError("UNAUTHENTICATED", "missing or wrong bearer token")
    size = bytearray(4)
    _recv_exact(conn, memoryview(size), "the request size")
    (n,) = struct.unpack("<I", size)
    if n > MAX_HELLO:
      raise BulkError("INVALID_ARGUMENT", f"a request of {n} bytes > {MAX_HELLO}")
    raw = bytearray(n)
    _recv_exact(conn, memoryview(raw), "the request")
    return self._parse(bytes(raw)), magic == MAGIC_RING

  def _handle(self, raw_conn, addr) -> None:
    conn, ctx, ring = raw_conn, _Context(f"bulk:{addr[0]}:{addr[1]}"), None
    with self._lock:
      self._conns.add(raw_conn)
    try:
      _tune(raw_conn)
      if self._ssl is not None:
        conn = self._ssl.wrap_socket(raw_conn, server_side=True)
      try:
        req, ring_wanted = self._hello(conn)
      except BulkError as e:
        if e.code_name == "UNAUTHENTICATED":
          self._on_reject(e.code_name)
        _send_error(conn, e)
        return
      # A ring only where no byte may need TLS: a local socket of a server without it.
      if ring_wanted and conn is raw_conn and raw_conn.family == socket.AF_UNIX:
        with self._lock:
          ring = self._rings.pop() if self._rings else None
        if ring is None:
          ring = _Ring()
          self.rings_made += 1
        ring.attach(conn)           # (closed below if this fails)
        self.ring_streams += 1
      try:
        for msg in self._serve(req, ctx):
          c = ws.parse_weight_message(msg)
          if ring is None or not ring.send(c):
            _send_message(conn, msg, c)
        if ring is not None:
          ring.drain()              # every slot back: nothing unread when the socket closes
        conn.sendall(FRAME.pack(END, 0, 0))
        if ring is not None:        # clean: the next local connection may use it
          with self._lock:
            if len(self._rings) < RING_SPARE:
              self._rings.append(ring)
              ring = None
      except BulkError as e:       # the source's abort (NOT_FOUND, INVALID_ARGUMENT, ...)
        _send_error(conn, e)
    except (OSError, ssl.SSLError) as e:
      log.info("bulk weight connection from %s ended: %s", addr, e)
    finally:
      ctx.closed = True
      if ring is not None:
        ring.close()
      with self._lock:
        self._conns.discard(raw_conn)
      try:
        conn.close()
      except OSError:
        pass


class _Mapped:
  """A ring's slots: `map` (an mmap of the memfd) viewed as `slots` (slots x bytes per slot)."""
  map: mmap.mmap
  slots: np.ndarray

  def close(self) -> None:
    """Drops the view, then unmaps (a view still exported elsewhere: freed with it)."""
    self.slots = np.empty((0, 0), np.uint8)
    try:
      self.map.close()
    except BufferError:
      pass


class _Ring(_Mapped):
  """The server side of a shared-memory ring (a local connection that asked for one): RING_SLOTS
  slots of RING_SLOT_BYTES in a memfd, whose descriptor goes to the client once (a RING frame with
  SCM_RIGHTS). A chunk that fits is copied into a free slot and announced by a SLOT frame (its
  head + the slot index, data_len = its bytes); the client copies the slot into its box and
  acknowledges the slot index, which frees it. One copy on each side, none through the kernel's
  socket buffers. The client maps the ring read-only and checks every chunk's CRC-32C after its
  copy, as on every path. A ring whose stream ended cleanly (every slot acknowledged) serves the
  next local connection (BulkServer keeps RING_SPARE idle ones); one that broke is closed."""

  def __init__(self):
    self.conn: Optional[socket.socket] = None
    self.free = list(range(RING_SLOTS))
    self.fd = os.memfd_create("scalerl-bulk-ring", os.MFD_CLOEXEC)
    os.ftruncate(self.fd, RING_SLOTS * RING_SLOT_BYTES)
    self.map = mmap.mmap(self.fd, RING_SLOTS * RING_SLOT_BYTES,
                         flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
    self.slots = np.frombuffer(self.map, np.uint8).reshape(RING_SLOTS, RING_SLOT_BYTES)
    self._ack = bytearray(SLOT_INDEX.size)

  def attach(self, conn: socket.socket) -> None:
    """Serves `conn` from now on: its client gets the ring's descriptor (a RING frame)."""
    self.conn, self.free = conn, list(range(RING_SLOTS))
    head = RING_HEAD.pack(RING_SLOTS, RING_SLOT_BYTES)
    socket.send_fds(conn, [FRAME.pack(RING, len(head), 0) + head], [self.fd])

  def send(self, c: ws.WeightMsg | Malformed) -> bool:
    """Sends a parsed chunk message through a slot; False for anything else (sent inline)."""
    if isinstance(c, Malformed) or not 0 < len(c.data) <= RING_SLOT_BYTES:
      return False
    if not self.free:                       # wait for the client to release one
      self._ack_one()
    k = self.free.pop()
    n = len(c.data)
    np.copyto(self.slots[k, :n], np.frombuffer(c.data, np.uint8))    # the GIL released
    head = c.head.SerializeToString() + SLOT_INDEX.pack(k)
    assert self.conn is not None, "send before attach"
    self.conn.sendall(FRAME.pack(SLOT, len(head), n) + head)
    return True

  def _ack_one(self) -> None:
    _recv_exact(self.conn, memoryview(self._ack), "a slot acknowledgement")
    (k,) = SLOT_INDEX.unpack(self._ack)
    if k >= RING_SLOTS or k in self.free:
      raise BulkError("INVALID_ARGUMENT", f"acknowledged slot {k} is not in use")
    self.free.append(k)

  def drain(self) -> None:
    """Waits until the client has released every slot."""
    while len(self.free) < RING_SLOTS:
      self._ack_one()

  def close(self) -> None:
    super().close()
    os.close(self.fd)


def _send_error(conn, e: BulkError) -> None:
  text = f"{e.code_name}: {e}".encode()[:4096]
  try:
    conn.sendall(FRAME.pack(ERR, len(text), 0) + text)
  except OSError:
    pass


def _send_message(conn, msg: bytes, c: ws.WeightMsg | Malformed) -> None:
  """One staged message (`c`: it parsed): a chunk as its header + its bytes (sent from the
  message itself, no copy), anything else whole."""
  if isinstance(c, Malformed) or not len(c.data):
    conn.sendall(FRAME.pack(MSG, len(msg), 0) + msg)
    return
  head = c.head.SerializeToString()
  conn.sendall(FRAME.pack(CHUNK, len(head), len(c.data)) + head)
  conn.sendall(c.data)


def split_address(address: str) -> tuple[str, str]:
  """("host:port", "@local name" or "") of a WeightBulkAddress answer ("host:port[,@name]")."""
  tcp, _, local = address.partition(",")
  return tcp, local if local.startswith("@") else ""


def _dial_local(name: str) -> Optional[socket.socket]:
  """A connection to a same-network-namespace listener, None where it is not reachable (another
  host or pod: its abstract name does not exist here)."""
  s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  try:
    s.connect("\0" + name[1:])
    return s
  except OSError:
    s.close()
    return None


def connect(address: str, token: str, request: pb.FetchWeightsRequest, *,
            tls: Optional[TLS] = None, timeout: float = 60.0, ring: bool = True):
  """An authenticated bulk connection to `address` ("host:port[,@name]", as WeightBulkAddress
  answers) with `request` sent: over the source's local listener when this process shares its
  network namespace (same host, same pod), else over TCP. `ring`: on a local connection without
  TLS, ask for the shared-memory ring (`_Ring`: chunk bytes through shared memory instead of the
  socket)."""
  tcp, local = split_address(address)
  host, _, port = hosts.resolve(tcp).rpartition(":")
  host = host.strip("[]")
  raw = _dial_local(local) if local else None
  if raw is None:
    raw = socket.create_connection((host, int(port)), timeout=timeout)
  _tune(raw)
  raw.settimeout(None)          # blocking (MSG_WAITALL), the stall limit in the kernel instead:
  raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                 struct.pack("ll", int(timeout), int(timeout % 1 * 1e6)))
  sock = raw
  if tls is not None and tls.enabled:
    sock = _client_context(tls).wrap_socket(raw, server_hostname=tls.server_name or host)
  body = request.SerializeToString()
  t = token.encode()
  magic = MAGIC_RING if sock is raw and raw.family == socket.AF_UNIX and ring else MAGIC
  sock.sendall(magic + struct.pack("<H", len(t)) + t + struct.pack("<I", len(body)) + body)
  return sock


def _recv_header(sock, hdr: bytearray, fds: list) -> None:
  """Reads a frame header; on a local socket with recvmsg, so that a descriptor passed with it
  (a RING frame's) lands in `fds` instead of being dropped."""
  if isinstance(sock, ssl.SSLSocket) or sock.family != socket.AF_UNIX:
    _recv_exact(sock, memoryview(hdr), "a frame header")
    return
  try:
    k, anc, _, _ = sock.recvmsg_into([hdr], socket.CMSG_SPACE(SLOT_INDEX.size),
                                     socket.MSG_WAITALL)
  except ConnectionError as e:
    raise BulkError("DATA_LOSS", f"the stream broke inside a frame header: {e}") from None
  for level, kind, data in anc:
    if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
      fds.extend(struct.unpack(f"{len(data) // 4}i", data[:len(data) - len(data) % 4]))
  if not k:
    raise BulkError("DATA_LOSS", f"the stream ended inside a frame header (0 of {len(hdr)} bytes)")
  if k < len(hdr):
    _recv_exact(sock, memoryview(hdr)[k:], "a frame header")


class _ClientRing(_Mapped):
  """The client side of a `_Ring`: the memfd mapped read-only."""

  def __init__(self, fd: int, head: bytes):
    try:
      if len(head) != RING_HEAD.size:
        raise BulkError("DATA_LOSS", f"a ring frame head of {len(head)} bytes")
      self.n, self.size = RING_HEAD.unpack(head)
      if not 0 < self.n <= 64 or not 0 < self.size <= 1 << 30:
        raise BulkError("DATA_LOSS", f"a ring of {self.n} x {self.size} bytes")
      self.map = mmap.mmap(fd, self.n * self.size, flags=mmap.MAP_SHARED | getattr(
          mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ)
    except (OSError, ValueError) as e:
      raise BulkError("DATA_LOSS", f"the ring cannot be mapped: {e}") from None
    finally:
      os.close(fd)
    self.slots = np.frombuffer(self.map, np.uint8).reshape(self.n, self.size)

  def take(self, sock, k: int, dst: memoryview) -> None:
    """Copies slot k's first len(dst) bytes into dst, then releases the slot to the server."""
    if k >= self.n or len(dst) > self.size:
      raise BulkError("DATA_LOSS", f"slot {k} of {self.n} with {len(dst)} bytes (at most "
                                   f"{self.size})")
    np.copyto(np.frombuffer(dst, np.uint8), self.slots[k, :len(dst)])   # the GIL released
    try:
      sock.sendall(SLOT_INDEX.pack(k))
    except OSError:        # the server is gone: the chunk is whole; the next read says the end
      pass


def messages(sock, place: Callable[[pb.WeightChunk, int], Optional[memoryview]],
             max_bytes: int) -> Iterator[ws.WeightMsg]:
  """The frames of a bulk stream as parsed WeightMsgs. A chunk's bytes are read straight into
  `place(head, nbytes)` (a writable memoryview of exactly nbytes: the fetcher's box; then the
  WeightMsg is marked `placed`) or, when it returns None, into a fresh buffer; from the socket, or
  copied out of the shared-memory ring's slot. Ends at END; BulkError on ERR, an oversize frame,
  a bad ring or slot, or a stream that ends inside a frame."""
  hdr, fds, ring = bytearray(FRAME.size), [], None
  try:
    while True:
      _recv_header(sock, hdr, fds)
      kind, hn, dn = FRAME.unpack(hdr)
      if kind == END:
        return
      if kind not in (MSG, CHUNK, ERR, RING, SLOT) or hn > max_bytes or dn > max_bytes:
        raise BulkError("DATA_LOSS", f"bad frame (kind {kind}, {hn} + {dn} bytes; at most "
                                     f"{max_bytes} each)")
      head = bytearray(hn)
      _recv_exact(sock, memoryview(head), "a frame head")
      if kind == ERR:
        code, _, text = bytes(head).decode(errors="replace").partition(": ")
        raise BulkError(code or "UNKNOWN", text)
      if kind == RING:
        if ring is not None or len(fds) != 1:
          raise BulkError("DATA_LOSS", f"a ring frame with {len(fds)} descriptors"
                                       + (" after the ring" if ring is not None else ""))
        ring = _ClientRing(fds.pop(), bytes(head))
        continue
      slot = -1
      if kind == SLOT:
        if ring is None or hn < SLOT_INDEX.size:
          raise BulkError("DATA_LOSS", "a slot frame without a ring")
        (slot,) = SLOT_INDEX.unpack_from(head, hn - SLOT_INDEX.size)
        head = head[:hn - SLOT_INDEX.size]
      m = ws.parse_weight_message(bytes(head))
      if isinstance(m, Malformed):
        raise BulkError("DATA_LOSS", m.err)
      if kind == MSG:
        yield m
        continue
      dst = place(m.head, dn)
      placed = dst is not None and len(dst) == dn
      buf = dst if placed else memoryview(bytearray(dn))
      assert buf is not None
      if kind == SLOT:
        assert ring is not None
        ring.take(sock, slot, buf)
      else:
        _recv_exact(sock, buf, f"chunk {m.head.chunk_index}")
      yield ws.WeightMsg(m.head, buf, b"", placed)
  finally:
    for fd in fds:                 # descriptors nobody asked for
      os.close(fd)
    if ring is not None:
      ring.close()
