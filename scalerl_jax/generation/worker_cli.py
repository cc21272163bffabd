"""The generator worker's command line (`python -m scalerl_jax.generation.worker`): its flags
only, so that the launch preflight parses a rendered pod command without importing the worker
(its generator stack, gRPC, JAX). No JAX; imports only the backend registry."""
from __future__ import annotations

import argparse

from scalerl_jax.generation import backends


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags of this entry point (launch tests parse the pod commands with it)."""
  ap = argparse.ArgumentParser(description="scalerl_jax generator worker")
  ap.add_argument("--run_config", required=True)
  ap.add_argument("--buffer", required=True)
  ap.add_argument("--generator_id", default=None,
                  help="default: $HOSTNAME, else the host name (the pod name)")
  ap.add_argument("--backend", choices=backends.names(), default=None)
  ap.add_argument("--workdir", default=None)
  ap.add_argument("--tensor_parallel", type=int, default=0,
                  help="vLLM engine tensor-parallel size (overrides config.generator.tensor_parallel)")
  ap.add_argument("--tls_cert", default=None, help="PEM certificate (overrides config.tls.cert)")
  ap.add_argument("--tls_key", default=None, help="PEM key (overrides config.tls.key)")
  ap.add_argument("--tls_ca", default=None,
                  help="PEM CA the buffer's certificate is verified with (overrides config.tls.ca)")
  ap.add_argument("--tls_server_name", default=None, help="overrides config.tls.server_name")
  ap.add_argument("--alive_file", default=None,
                  help="touched at start and every generator.heartbeat_s (liveness probe)")
  return ap
