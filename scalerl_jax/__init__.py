"""scalerl_jax: ScaleRL in JAX (docs/ARCHITECTURE.md).

Importing the package sets one process default before any gRPC channel or server exists:
GRPC_VERBOSITY=ERROR unless the environment sets it (docs/ROLLOUT.md "gRPC's own log lines").
grpcio >= 1.6x logs through its own copy of absl at absl's default level (INFO) when
GRPC_VERBOSITY is unset, so every client whose server shut down with calls open printed
`chttp2_transport.cc] ...: Got goaway [2] err=UNAVAILABLE:GOAWAY received; ... Cancelling all
calls` on stderr (the generators' logs, at every run's end). ERROR is gRPC's historical default:
errors still print; `GRPC_VERBOSITY=INFO` (or DEBUG) in the environment brings the rest back.
Every process we start runs `python -m scalerl_jax.<module>`, so this runs first there, and
children inherit the variable. Where our client retries an RPC, the error (a GOAWAY's text
included) goes to Python logging at debug level (logger `scalerl.rpc`).
"""
import os as _os

_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
