"""Child-process body of tests/protocol/test_grpc_logging.py: a buffer client, started the way our entry
points start (`python -m` imports the scalerl_jax package first), makes one call to ADDRESS and
prints how it ended. Its stderr is what the test reads."""
import logging
import sys
import time

import scalerl_jax  # noqa: F401  (what every `python -m scalerl_jax.<module>` runs first)


def main(address: str) -> None:
  import grpc
  from scalerl_jax.protocol.client import BufferClient
  logging.basicConfig(level=logging.DEBUG, stream=sys.stdout,
                      format="%(name)s %(levelname)s %(message)s")
  c = BufferClient(address, "token", retries=1, backoff_s=0.01)
  try:
    c.status()
    print("status: ok", flush=True)
  except grpc.RpcError as e:
    print(f"status: {e.code().name}: {e.details()}", flush=True)
  time.sleep(0.2)                 # any log line of the closing connection is written by now
  c.close()


if __name__ == "__main__":
  main(sys.argv[1])
