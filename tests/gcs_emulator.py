"""A real GCS emulator for tests (gcp-storage-emulator from PyPI, in memory, on 127.0.0.1).

`running_emulator(log_dir)` starts it, waits until it accepts connections, yields its
`http://127.0.0.1:PORT` endpoint and stops it afterwards. The tests then set the one standard
variable `STORAGE_EMULATOR_HOST` (scalerl_jax.storage.configure_emulator derives the rest) in
their own process or in the environment of the processes they start.
"""
import contextlib
import os
import socket
import subprocess
import sys
import time

from helpers import free_port


@contextlib.contextmanager
def running_emulator(log_dir, timeout_s: float = 60.0):
  port = free_port()
  exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
  with open(os.path.join(log_dir, "emulator.log"), "w") as log:
    proc = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
      deadline = time.time() + timeout_s
      while True:
        try:
          socket.create_connection(("127.0.0.1", port), timeout=1).close()
          break
        except OSError:
          assert proc.poll() is None and time.time() < deadline, "emulator did not start"
          time.sleep(0.2)
      yield f"http://127.0.0.1:{port}"
    finally:
      proc.terminate()
      proc.wait(10)


@contextlib.contextmanager
def emulator_in_this_process(log_dir, bucket: str):
  """`running_emulator` with this process pointed at it: the one standard variable
  `STORAGE_EMULATOR_HOST` set (storage.configure_emulator derives the rest) and `bucket` made;
  the variables it touched are restored afterwards. Yields the endpoint."""
  from scalerl_jax import storage   # local: the plain emulator needs no project import
  import fsspec
  keys = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")
  with running_emulator(log_dir) as url:
    saved = {k: os.environ.get(k) for k in keys}
    try:
      os.environ["STORAGE_EMULATOR_HOST"] = url
      storage.configure_emulator()
      fsspec.filesystem("gs").mkdir(bucket)
      yield url
    finally:
      for k, v in saved.items():
        if v is None:
          os.environ.pop(k, None)
        else:
          os.environ[k] = v
