"""Processes of tests/test_weight_stream.py (run as `python tests/weight_stream_procs.py ROLE ...`).

learner ADDRESS VERSION CHUNK_BYTES: a sharded tiny Llama on 8 simulated CPU devices (XLA_FLAGS set
  by the test) streams its params; prints JSON with the per-leaf sha256s, model bytes, shard count
  and the Python-heap peak (tracemalloc) during the publish.
generator ADDRESS: fetches the newest streamed version into fresh arrays, loads it into a JaxSampler;
  prints JSON with per-leaf sha256s and the tracemalloc peak during the fetch.
Both read the buffer token from SCALERL_BUFFER_TOKEN.
"""
import hashlib
import json
import os
import resource
import sys
import time
import tracemalloc

import numpy as np


def model():
  from scalerl_jax import models
  return models.get_preset("tiny_llama3", vocab_size=2048, d_model=256, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=64, ffn_dim=768, dtype="float32")


def leaf_hashes(params):
  from scalerl_jax.rollout.weight_stream import flatten
  return {"/".join(map(str, p)): hashlib.sha256(np.ascontiguousarray(np.asarray(x)).tobytes()
                                                ).hexdigest() for p, x in flatten(params)}


def learner(address, version, chunk_bytes):
  import jax
  from configs.common import DEFAULT_RULES
  from scalerl_jax import sharding
  from scalerl_jax.rollout.client import BufferClient
  from scalerl_jax.rollout.weight_stream import StreamPublisher
  cfg = model()
  mesh = sharding.make_mesh((("data", 1), ("fsdp", 4), ("tensor", 2), ("expert", 1)))
  params, _ = sharding.sharded_init(cfg, jax.random.PRNGKey(int(version)), mesh, DEFAULT_RULES)
  jax.block_until_ready(params)
  leaves = jax.tree.leaves(params)
  model_bytes = sum(x.nbytes for x in leaves)
  largest = max(x.nbytes for x in leaves)
  n_sharded = sum(not x.sharding.is_fully_replicated for x in leaves)
  c = BufferClient(address, os.environ["SCALERL_BUFFER_TOKEN"])
  rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  tracemalloc.start()
  t0 = time.perf_counter()
  pub = StreamPublisher(c, int(version), params, chunk_bytes=int(chunk_bytes))
  ack = pub.publish()
  dt = time.perf_counter() - t0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  print(json.dumps(dict(
      hashes=leaf_hashes(params), model_bytes=model_bytes, largest_leaf_bytes=largest,
      devices=jax.device_count(), sharded_leaves=n_sharded, chunks=len(pub.plan),
      sent_chunks=pub.sent_chunks, visible=ack.visible, publish_s=dt, traced_peak=peak,
      peak_chunk_bytes=pub.peak_chunk_bytes,
      rss_growth=(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024)))


def generator(address):
  import jax
  from scalerl_jax.rollout.client import BufferClient
  from scalerl_jax.rollout.sampler import JaxSampler
  from scalerl_jax.rollout.weight_stream import StreamFetcher
  cfg = model()
  c = BufferClient(address, os.environ["SCALERL_BUFFER_TOKEN"])
  f = StreamFetcher(c)
  rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  tracemalloc.start()
  t0 = time.perf_counter()
  version, params = f.fetch(-1, wait_timeout_s=60)
  dt = time.perf_counter() - t0
  _, peak = tracemalloc.get_traced_memory()
  tracemalloc.stop()
  rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  sampler = JaxSampler(cfg, params, version=version)          # the generator takes them as is
  hashes = leaf_hashes(sampler.params)
  print(json.dumps(dict(version=version, hashes=hashes, fetch_s=dt, traced_peak=peak,
                        received_bytes=f.received_bytes, peak_message_bytes=f.peak_message_bytes,
                        rss_growth=(rss1 - rss0) * 1024, devices=jax.device_count())))


if __name__ == "__main__":
  role, args = sys.argv[1], sys.argv[2:]
  {"learner": learner, "generator": generator}[role](*args)
