"""What both ends of every gRPC channel share: the service name, channel options, bearer-token auth,
and TLS credentials (`TLS`, `add_port`, `open_channel`: the one place servers and clients get them).

The buffer, the learner's weight sources and every client import this module (no JAX)."""
from __future__ import annotations

import argparse
import dataclasses
import hmac
import os
from typing import Optional, Sequence

import grpc

from scalerl_jax import hosts

SERVICE = "scalerl.rollout.v1.RolloutBuffer"


def channel_options(max_message_bytes: int) -> list:
  """Shared server/client channel options: message limits and large HTTP/2 windows/frames."""
  return [("grpc.max_receive_message_length", max_message_bytes),
          ("grpc.max_send_message_length", max_message_bytes),
          ("grpc.http2.max_frame_size", 16 * 1024 * 1024 - 1),
          ("grpc.http2.bdp_probe", 1),
          ("grpc.so_reuseport", 0)]


class AuthInterceptor(grpc.ServerInterceptor):
  """Rejects any call without `authorization: Bearer <token>` before its handler runs."""

  def __init__(self, token: str, on_reject):
    self._expected = f"Bearer {token}".encode()
    self._on_reject = on_reject

  def intercept_service(self, continuation, details) -> grpc.RpcMethodHandler | None:
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

    def deny(request, context) -> None:
      context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (False, True): grpc.unary_stream_rpc_method_handler,
             (True, False): grpc.stream_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}
    return kinds[(handler.request_streaming, handler.response_streaming)](deny)


@dataclasses.dataclass(frozen=True)
class TLS:
  """TLS of a run's gRPC channels (`config.tls`, docs/ROLLOUT.md "TLS"); all empty = plaintext.

  `cert`/`key`: PEM files of this process's certificate chain and private key (servers: the buffer
  and the learner weight sources; clients too when `mutual`). `ca`: PEM file of the CA that signed
  the servers' certificates: clients verify the server against it (empty: the system roots).
  `mutual`: servers require a client certificate signed by `ca` (mTLS). `server_name`: the name
  clients check in every server certificate instead of the dialed host (one certificate for the
  buffer service and the learner pods dialed by IP). The bearer token is checked on top of TLS."""
  cert: str = ""
  key: str = ""
  ca: str = ""
  mutual: bool = False
  server_name: str = ""

  @property
  def enabled(self) -> bool:
    return bool(self.cert or self.key or self.ca)

  @classmethod
  def from_config(cls, config) -> "TLS":
    """From `config.tls` (its files all "": plaintext)."""
    return cls.from_section(config.tls)

  @classmethod
  def from_section(cls, t) -> "TLS":
    """From a tls section (scalerl_jax.config.Tls, or its ConfigDict)."""
    return cls(cert=str(t.cert or ""), key=str(t.key or ""), ca=str(t.ca or ""),
               mutual=bool(t.mutual), server_name=str(t.server_name or ""))

  def check(self, server: bool = False) -> None:
    """Raises ValueError (one line) on an inconsistent setting or an unreadable PEM file."""
    if not self.enabled:
      if self.mutual or self.server_name:
        raise ValueError("tls.mutual / tls.server_name need tls.cert, tls.key and tls.ca")
      return
    if bool(self.cert) != bool(self.key):
      raise ValueError("tls.cert and tls.key go together (this process's certificate and its key)")
    if server and not self.cert:
      raise ValueError("a TLS server needs tls.cert and tls.key")
    if self.mutual and not (self.cert and self.ca):
      raise ValueError("tls.mutual=True needs tls.cert, tls.key (presented by clients too) and "
                       "tls.ca (to verify them)")
    for name in ("cert", "key", "ca"):
      path = getattr(self, name)
      if path:
        try:
          data = _read(path)
        except OSError as e:
          raise ValueError(f"tls.{name}={path!r} cannot be read: {e.strerror or e}") from None
        if b"-----BEGIN " not in data:
          raise ValueError(f"tls.{name}={path!r} is not a PEM file")

  def server_credentials(self) -> grpc.ServerCredentials:
    self.check(server=True)
    return grpc.ssl_server_credentials(
        [(_read(self.key), _read(self.cert))],
        root_certificates=_read(self.ca) if self.mutual else None,
        require_client_auth=self.mutual)

  def channel_credentials(self) -> grpc.ChannelCredentials:
    self.check()
    mine = self.mutual and self.cert
    return grpc.ssl_channel_credentials(
        root_certificates=_read(self.ca) if self.ca else None,
        private_key=_read(self.key) if mine else None,
        certificate_chain=_read(self.cert) if mine else None)

  def argv(self) -> list[str]:
    """Command-line flags of the buffer server process (`add_arguments` / `from_args`)."""
    out = []
    for name in ("cert", "key", "ca", "server_name"):
      if getattr(self, name):
        out += [f"--tls-{name.replace('_', '-')}", getattr(self, name)]
    return out + (["--tls-mutual"] if self.mutual else [])

  @staticmethod
  def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tls-cert", default="", help="PEM certificate chain (enables TLS)")
    ap.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    ap.add_argument("--tls-ca", default="", help="PEM CA (clients verify servers with it; "
                                                 "with --tls-mutual servers verify clients)")
    ap.add_argument("--tls-server-name", default="", help="name checked in server certificates")
    ap.add_argument("--tls-mutual", action="store_true", help="require client certificates")

  @classmethod
  def from_args(cls, a: argparse.Namespace) -> "TLS":
    return cls(cert=a.tls_cert, key=a.tls_key, ca=a.tls_ca, mutual=a.tls_mutual,
               server_name=a.tls_server_name)


def _read(path: str) -> bytes:
  with open(os.path.expanduser(path), "rb") as f:
    return f.read()


def add_port(server: grpc.Server, address: str, tls: Optional[TLS] = None) -> int:
  """Binds `address` on `server`, over TLS when `tls` is enabled; returns the port (0: failed).
  `$SCALERL_HOSTS` (scalerl_jax/hosts.py) may map the host, a wildcard included."""
  address = hosts.resolve(address)
  if tls is not None and tls.enabled:
    return server.add_secure_port(address, tls.server_credentials())
  return server.add_insecure_port(address)


def open_channel(address: str, tls: Optional[TLS] = None,
                 options: Sequence[tuple] = ()) -> grpc.Channel:
  """A client channel to `address`, over TLS (verifying the server) when `tls` is enabled.
  `$SCALERL_HOSTS` (scalerl_jax/hosts.py) may map the host name."""
  address = hosts.resolve(address)
  if tls is None or not tls.enabled:
    return grpc.insecure_channel(address, options=list(options))
  opts = list(options)
  if tls.server_name:
    opts.append(("grpc.ssl_target_name_override", tls.server_name))
  return grpc.secure_channel(address, tls.channel_credentials(), options=opts)
