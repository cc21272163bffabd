"""gRPC's C-core log lines in the processes we start (issue #28): a server shutting down with a
client's call open sends GOAWAY (INTERNAL_ERROR, "Cancelling all calls"); grpcio 1.85 logs
`chttp2_transport.cc:1403] ...: Got goaway [2] err=UNAVAILABLE:GOAWAY received; ...` at INFO on
the client, which reached every generator's log at a run's end. scalerl_jax/__init__.py sets
GRPC_VERBOSITY=ERROR unless the environment sets it: no such line by default, the line is back with
GRPC_VERBOSITY=INFO, and gRPC's ERROR lines still print.

The server is a scripted HTTP/2 peer that sends exactly the frames a gRPC server sends when it
shuts down with a call open (GOAWAY with error 2 and that text, then RST_STREAM) and keeps the
socket open afterwards. A real server closes the socket right after, and whether the client
parses the GOAWAY before the close is a race (the line appeared in 1 of 6 runs here), so the test
forces the condition instead.
"""
import os
import socket
import struct
import subprocess
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SETTINGS, HEADERS, RST_STREAM, GOAWAY = 4, 1, 3, 7


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
  return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) \
      + payload


def _read(conn, n: int) -> bytes:
  buf = b""
  while len(buf) < n:
    chunk = conn.recv(n - len(buf))
    if not chunk:
      raise EOFError
    buf += chunk
  return buf


class ShuttingDownServer:
  """Accepts one HTTP/2 connection, waits for the client's call (HEADERS on stream 1), then sends
  GOAWAY(last stream 1, `error`, `text`) and RST_STREAM(1, CANCEL) and holds the socket open until
  the client closes it. Later connections (a retry) get the same."""

  def __init__(self, error: int, text: bytes, last_stream: int | None = None):
    self.error, self.text, self.last_stream = error, text, last_stream
    self.sock = socket.create_server(("127.0.0.1", 0))
    self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
    self.goaways = 0                # GOAWAYs sent (gRPC retries an unseen call once itself)
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self):
    while True:
      try:
        conn, _ = self.sock.accept()
      except OSError:
        return
      threading.Thread(target=self._conn, args=(conn,), daemon=True).start()

  def _conn(self, conn):
    with conn:
      try:
        assert _read(conn, len(PREFACE)) == PREFACE
        conn.sendall(_frame(SETTINGS, 0, 0))
        while True:
          length, kind, flags, stream = struct.unpack(">I", b"\0" + _read(conn, 3))[0], \
              *_read(conn, 2), struct.unpack(">I", _read(conn, 4))[0] & 0x7FFFFFFF
          _read(conn, length)
          if kind == SETTINGS and not flags & 1:
            conn.sendall(_frame(SETTINGS, 1, 0))              # ACK
          if kind == HEADERS and stream:
            last = stream if self.last_stream is None else self.last_stream
            conn.sendall(_frame(GOAWAY, 0, 0, struct.pack(">II", last, self.error) + self.text)
                         + (_frame(RST_STREAM, 0, stream, struct.pack(">I", 8))
                            if last >= stream else b""))
            self.goaways += 1
      except (EOFError, OSError):
        return

  def close(self):
    self.sock.close()


def _client(address: str, **env) -> subprocess.CompletedProcess:
  e = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}   # the pytest process's
  e.update(PYTHONPATH=ROOT, **env)                                     # own default is not it
  return subprocess.run([sys.executable, os.path.join(ROOT, "tests", "grpc_log_procs.py"),
                         address], env=e, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.fixture
def shutting_down():
  srv = ShuttingDownServer(2, b"Cancelling all calls")    # what grpc's server sends at shutdown
  yield srv
  srv.close()


def test_goaway_on_shutdown_prints_no_line_by_default(shutting_down):
  r = _client(shutting_down.address)
  assert r.returncode == 0, r.stderr
  assert shutting_down.goaways >= 1                        # the client did get the GOAWAY
  assert "status: CANCELLED" in r.stdout, r.stdout
  assert "goaway" not in r.stderr.lower(), r.stderr


def test_goaway_line_comes_back_with_grpc_verbosity_info(shutting_down):
  r = _client(shutting_down.address, GRPC_VERBOSITY="INFO")
  assert r.returncode == 0, r.stderr
  lines = [l for l in r.stderr.splitlines() if "Got goaway [2]" in l]
  assert len(lines) >= 1 and "Cancelling all calls" in lines[0], r.stderr


def test_grpc_errors_still_print_by_default():
  """A GOAWAY gRPC logs at ERROR (the server refuses the client's keepalive pings) still does."""
  srv = ShuttingDownServer(11, b"too_many_pings")          # ENHANCE_YOUR_CALM
  try:
    r = _client(srv.address)
  finally:
    srv.close()
  assert r.returncode == 0, r.stderr
  assert [l for l in r.stderr.splitlines() if l.startswith("E") and "too_many_pings" in l], \
      r.stderr


def test_retried_unavailable_goes_to_python_debug_log():
  """What gRPC no longer prints reaches Python logging at debug level where our client handles it:
  a GOAWAY whose last stream id is below the call's leaves the call unseen, which the channel ends
  as UNAVAILABLE carrying the GOAWAY's text; BufferClient's retry logs it on `scalerl.rpc`."""
  srv = ShuttingDownServer(2, b"Cancelling all calls", last_stream=0)
  try:
    r = _client(srv.address)
  finally:
    srv.close()
  assert r.returncode == 0, r.stderr
  debug = [l for l in r.stdout.splitlines() if l.startswith("scalerl.rpc DEBUG")]
  assert len(debug) == 1 and "UNAVAILABLE" in debug[0] and "GOAWAY received; Error code: 2" in \
      debug[0] and "Cancelling all calls" in debug[0] and debug[0].endswith("retry 1"), r.stdout
  assert "status: UNAVAILABLE" in r.stdout
  assert "goaway" not in r.stderr.lower(), r.stderr
