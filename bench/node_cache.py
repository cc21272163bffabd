"""Start-checkpoint copy from gs://: parallel ranged reads (node_cache.node_copy) vs one stream.

    python -m bench.node_cache [--mb 256 --files 2 --workers 8 --piece_mb 8 --rounds 3]

A real GCS emulator (gcp-storage-emulator, in memory, on 127.0.0.1) holds a checkpoint-like
directory (`--files` files of `--mb` MiB random bytes in all + a config.json). Each round copies
it to local disk both ways, in turn: ours = `node_cache.node_copy` (each file by `--workers`
concurrent ranged reads of `--piece_mb`, then its MD5 and the manifest), peer = `storage.copy_tree`
(what a generator pod did before: one stream per file, gcsfs's buffered reads), and
`ours_1worker` = node_copy with one worker (the same ranged reads, MD5 and fsync, one at a time:
`parallel_vs_1worker` isolates the concurrency). Reported: the median MB/s of each; the last line
is the JSON line (ratio = ours / peer throughput). The emulator
is one Python process on this machine: on real GCS the gain of concurrent ranged GETs is larger
(each GET stream is limited far below a node's NIC), so this is the floor, not the forecast.
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.common import free_port, last_line

BUCKET = "bench-node-cache"


def _start_emulator(log_dir: str):
  port = free_port()
  exe = os.path.join(os.path.dirname(sys.executable), "gcp-storage-emulator")
  log = open(os.path.join(log_dir, "emulator.log"), "w")
  proc = subprocess.Popen([exe, "start", "--host=127.0.0.1", f"--port={port}", "--in-memory"],
                          stdout=log, stderr=subprocess.STDOUT)
  deadline = time.time() + 60
  while True:
    try:
      socket.create_connection(("127.0.0.1", port), timeout=1).close()
      return proc, f"http://127.0.0.1:{port}"
    except OSError:
      if proc.poll() is not None or time.time() > deadline:
        raise RuntimeError("the GCS emulator did not start") from None
      time.sleep(0.2)


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--mb", type=int, default=256, help="MiB in all, split over --files files")
  p.add_argument("--files", type=int, default=2)
  p.add_argument("--workers", type=int, default=8)
  p.add_argument("--piece_mb", type=int, default=8)
  p.add_argument("--rounds", type=int, default=3)
  a = p.parse_args(argv)
  tmp = tempfile.mkdtemp(prefix="bench-node-cache-")
  proc, url = _start_emulator(tmp)
  try:
    os.environ["STORAGE_EMULATOR_HOST"] = url
    from scalerl_jax import node_cache, storage
    storage.configure_emulator()
    import fsspec
    fsspec.filesystem("gs").mkdir(BUCKET)
    src = f"gs://{BUCKET}/ckpt"
    rng = np.random.default_rng(0)
    per = (a.mb << 20) // a.files
    for i in range(a.files):
      storage.write_bytes(storage.join(src, f"model-{i + 1:05d}-of-{a.files:05d}.safetensors"),
                          rng.integers(0, 256, per, dtype=np.uint8).tobytes())
    storage.write_text(storage.join(src, "config.json"), "{}")
    total = a.files * per + 2
    secs: dict[str, list[float]] = {"ours": [], "peer": [], "ours_1worker": []}
    for r in range(a.rounds):
      for side in ("peer", "ours_1worker", "ours") if r % 2 else ("ours", "ours_1worker", "peer"):
        dest = os.path.join(tmp, side)
        shutil.rmtree(dest, ignore_errors=True)
        t0 = time.perf_counter()
        if side.startswith("ours"):
          node_cache.node_copy(src, dest, workers=a.workers if side == "ours" else 1,
                               piece_bytes=a.piece_mb << 20)
        else:
          storage.copy_tree(src, dest, last=("config.json",))
        secs[side].append(time.perf_counter() - t0)
        print(f"round {r} {side}: {secs[side][-1]:.2f} s", flush=True)
    rate = {k: total / 1e6 / statistics.median(v) for k, v in secs.items()}
    return last_line(round(rate["ours"], 1), round(rate["peer"], 1), "MB/s", bytes=total,
                     ours_1worker=round(rate["ours_1worker"], 1),
                     parallel_vs_1worker=round(rate["ours"] / rate["ours_1worker"], 3),
                     files=a.files, workers=a.workers, piece_mb=a.piece_mb, rounds=a.rounds,
                     seconds={k: [round(x, 2) for x in v] for k, v in secs.items()},
                     ours_includes="MD5 of every file + manifest")
  finally:
    proc.terminate()
    proc.wait(10)
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  main()
