"""Processes of tests/test_weights/stream.py (run as `python tests/weight_stream_procs.py ROLE ...`).

learner ADDRESS VERSION CHUNK_BYTES: publishes a warm-up version 1, then a sharded tiny Llama on 8
  simulated CPU devices (XLA_FLAGS set by the test) streams its params as VERSION; prints JSON with
  the per-leaf sha256s, model bytes, shard count, the Python-heap peak (tracemalloc) and the peak
  RSS growth during the publish.
generator ADDRESS: fetches the first version newer than 1 into fresh arrays, loads it into a
  JaxSampler; prints JSON with per-leaf sha256s, the tracemalloc peak and peak RSS growth.
Both read the buffer token from SCALERL_BUFFER_TOKEN.
"""
import hashlib
import json
import os
import sys
import time
import tracemalloc

import numpy as np


def model():
  from scalerl_jax import models
  return models.get_preset("tiny_llama3", vocab_size=2048, d_model=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=64, ffn_dim=768, dtype="float32")


def rss_now() -> int:
  """Resident set size now, bytes (peak growth = ru_maxrss afterwards minus this)."""
  with open("/proc/self/status") as f:
    return int(f.read().split("VmRSS:")[1].split()[0]) * 1024


class RssPeak:
  """Samples VmRSS every millisecond in a thread: the peak while the block runs, minus the start.

  (ru_maxrss would also count peaks from before the block, e.g. JAX start-up.)"""

  def __enter__(self):
    import threading
    self.start, self.peak, self._stop = rss_now(), 0, threading.Event()

    def poll():
      while not self._stop.is_set():
        self.peak = max(self.peak, rss_now())
        self._stop.wait(0.001)
    self._t = threading.Thread(target=poll, daemon=True)
    self._t.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join()
    self.peak = max(self.peak, rss_now())
    self.growth = max(0, self.peak - self.start)


def leaf_hashes(params):
  from scalerl_jax.weights.stream import flatten
  return {"/".join(map(str, p)): hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()
                                                ).hexdigest() for p, x in flatten(params)}


def learner(address, version, chunk_bytes):
  import jax
  from scalerl_jax.config import DEFAULT_RULES
  from scalerl_jax import sharding
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.weights.stream import StreamPublisher
  cfg = model()
  mesh = sharding.make_mesh((("data", 1), ("fsdp", 4), ("tensor", 2), ("expert", 1)))
  params, _ = sharding.sharded_init(cfg, jax.random.PRNGKey(int(version)), mesh, DEFAULT_RULES)
  jax.block_until_ready(params)
  leaves = jax.tree.leaves(params)
  model_bytes = sum(x.nbytes for x in leaves)
  largest = max(x.nbytes for x in leaves)
  n_sharded = sum(not x.sharding.is_fully_replicated for x in leaves)
  c = BufferClient(address, os.environ["SCALERL_BUFFER_TOKEN"])
  # Warm-up: version 1, one small leaf (connects the channel; the generator waits for > 1).
  StreamPublisher(c, 1, {"warm_up": np.zeros(4, np.float32)}).publish()
  tracemalloc.start()
  t0 = time.perf_counter()
  with RssPeak() as rss:
    pub = StreamPublisher(c, int(version), params, chunk_bytes=int(chunk_bytes))
    ack = pub.publish()
  dt = time.perf_counter() - t0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  rss_growth = rss.growth
  print(json.dumps(dict(
      hashes=leaf_hashes(params), rss_growth=rss_growth, model_bytes=model_bytes,
      largest_leaf_bytes=largest,
      devices=jax.device_count(), sharded_leaves=n_sharded, chunks=len(pub.plan),
      sent_chunks=pub.sent_chunks, visible=ack.visible, publish_s=dt, traced_peak=peak,
      peak_chunk_bytes=pub.peak_chunk_bytes)))


def generator(address):
  import jax
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.generation.sampler import JaxSampler
  from scalerl_jax.weights.stream import StreamFetcher
  cfg = model()
  c = BufferClient(address, os.environ["SCALERL_BUFFER_TOKEN"])
  f = StreamFetcher(c)
  tracemalloc.start()
  t0 = time.perf_counter()
  with RssPeak() as rss:
    version, params = f.fetch(1, wait_timeout_s=60)
  dt = time.perf_counter() - t0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  sampler = JaxSampler(cfg, params, version=version)          # the generator takes them as is
  hashes = leaf_hashes(sampler.params)
  print(json.dumps(dict(version=version, hashes=hashes, fetch_s=dt, traced_peak=peak,
                        received_bytes=f.received_bytes, peak_message_bytes=f.peak_message_bytes,
                        rss_growth=rss.growth, devices=jax.device_count())))


if __name__ == "__main__":
  role, args = sys.argv[1], sys.argv[2:]
  {"learner": learner, "generator": generator}[role](*args)
