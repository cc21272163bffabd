"""What both ends of every gRPC channel share: the service name, channel options, bearer-token auth.

The buffer, the learner's weight sources and every client import this module (no JAX)."""
from __future__ import annotations

import hmac

import grpc

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
