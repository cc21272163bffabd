"""Learner-hosted weight serving (weights/source.py): the buffer announces, the learner hosts
serve their chunks, generators fetch one hop; multi-source, resumable, authenticated, checksummed."""
import threading
import time

import grpc
import jax
import numpy as np
import pytest

from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.types import PromptSpec
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher, flatten

TOKEN = "source-test-token"


class Boom(Exception):
  pass


def _params(seed=0):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((64, 48)).astype(np.float32),
          "layers": [{"w": rng.standard_normal((48, 32)).astype(np.float32),
                      "b": rng.standard_normal((32,)).astype(np.float32)} for _ in range(3)],
          "step": np.arange(5, dtype=np.int32)}


def _same(a, b):
  fa, fb = flatten(a), flatten(b)
  return [p for p, _ in fa] == [p for p, _ in fb] and all(
      x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)
      for (_, x), (_, y) in zip(fa, fb))


@pytest.fixture()
def buf():
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  yield srv, c
  c.close()
  srv.stop()


def test_crc32c_is_castagnoli():
  """The chunk checksum is the standard CRC-32C (check value of b"123456789": 0xE3069283)."""
  assert ws.CHECKSUMS["crc32c"](b"123456789") == 0xE3069283
  assert ws.CHECKSUMS["crc32"](b"123456789") == 0xCBF43926


def test_one_source_one_hop_bit_exact_zero_copy(buf):
  """The buffer holds only the manifest; every chunk comes from the learner's source; the arrays
  arrive bit-exact, 64-byte aligned, and jax.device_put adopts them without a copy."""
  srv, c = buf
  src = WeightSource(TOKEN)
  try:
    params = _params(1)
    pub = StreamPublisher(c, 0, params, chunk_bytes=2048, source=src)
    n = len(pub.plan)
    assert pub.publish().visible and pub.manifest["checksum"] == "crc32c"
    v = srv.weights.visible
    assert v.version == 0 and v.remote and v.chunks == [] and srv.state.version == 0
    assert len(v.pack()) < 8192                       # the buffer persists the manifest only
    f = StreamFetcher(c)
    version, got = f.fetch(-1, wait_timeout_s=5)
    assert version == 0 and _same(got, params) and f.received_chunks == n == src.served_chunks
    for _, x in flatten(got):
      assert x.ctypes.data % 64 == 0
    emb = got["embed"]
    assert jax.device_put(emb).unsafe_buffer_pointer() == emb.ctypes.data   # no copy on CPU
    # A newer version replaces it; the older one stays served until `keep` is exceeded.
    params2 = _params(2)
    StreamPublisher(c, 1, params2, chunk_bytes=2048, source=src).publish()
    assert src.held() == [0, 1]
    version, got = f.fetch(0, wait_timeout_s=5)
    assert version == 1 and _same(got, params2)
    StreamPublisher(c, 2, _params(3), chunk_bytes=2048, source=src).publish()
    assert src.held() == [1, 2]
  finally:
    src.stop()


def test_two_sources_pipelined_and_resumable(buf):
  """Two learner processes, each serving its half: the fetcher streams process 0's chunks while
  process 1 has not staged yet, then the rest; a fetch broken mid-stream resumes with only the
  chunks it lacks."""
  srv, c = buf
  a, b = WeightSource(TOKEN), WeightSource(TOKEN)
  try:
    params = _params(4)
    n = len(StreamPublisher(c, 1, params, chunk_bytes=1024).plan)
    owners = [i % 2 for i in range(n)]
    kw = dict(chunk_bytes=1024, sources=[a.address, b.address], owners=owners)
    pa = StreamPublisher(c, 1, params, process_index=0, source=a, **kw)
    pb_ = StreamPublisher(c, 1, params, process_index=1, source=b, **kw)
    assert pa.sha256 == pb_.sha256 and sorted(pa.own + pb_.own) == list(range(n))
    assert pa.publish().visible               # process 0 announces; process 1 not staged yet
    out = {}
    f = StreamFetcher(c)
    t = threading.Thread(target=lambda: out.update(r=f.fetch(0, wait_timeout_s=20)))
    t.start()
    deadline = time.time() + 20
    while f.received_chunks < len(pa.own) and time.time() < deadline:
      time.sleep(0.02)
    time.sleep(0.2)
    assert f.received_chunks == len(pa.own) and t.is_alive()   # waiting for process 1's source
    pb_.publish()
    t.join(20)
    version, got = out["r"]
    assert version == 1 and _same(got, params) and f.received_chunks == n
    assert (a.served_chunks, b.served_chunks) == (len(pa.own), len(pb_.own))

    # One source's stream breaks after 5 chunks (the other may finish meanwhile): the next fetch
    # asks each source only for what is missing.
    g = StreamFetcher(c)
    g.on_chunk = lambda i: (_ for _ in ()).throw(Boom()) if g.received_chunks == 5 else None
    with pytest.raises(Boom):
      g.fetch(0, wait_timeout_s=5)
    held = len(g._partial["have"])
    assert 5 <= held < n
    g.on_chunk, g.received_chunks = None, 0
    version, got = g.fetch(0, wait_timeout_s=5)
    assert version == 1 and _same(got, params) and g.received_chunks == n - held
  finally:
    a.stop()
    b.stop()


def test_dead_source_then_restarted_learner_reannounces_same_version(buf):
  """The learner dies: fetching from its source fails (the worker retries); the restarted learner
  serves the same version from a new address and the buffer accepts the re-announcement."""
  srv, c = buf
  old = WeightSource(TOKEN)
  params = _params(5)
  StreamPublisher(c, 3, params, chunk_bytes=4096, source=old).publish()
  old.stop()
  f = StreamFetcher(BufferClient(srv.address, TOKEN))
  with pytest.raises(grpc.RpcError) as e:
    f.fetch(-1, wait_timeout_s=1)
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE
  new = WeightSource(TOKEN)
  try:
    assert new.address != old.address
    StreamPublisher(c, 3, params, chunk_bytes=4096, source=new).publish()
    assert srv.weights.visible.version == 3
    version, got = f.fetch(-1, wait_timeout_s=5)
    assert version == 3 and _same(got, params)
    with pytest.raises(grpc.RpcError) as e:           # an older version is still refused
      StreamPublisher(c, 2, params, chunk_bytes=4096, source=new).publish()
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
  finally:
    new.stop()


def test_source_rejects_bad_requests_and_detects_corruption(buf):
  """No token -> UNAUTHENTICATED; unknown version -> NOT_FOUND; garbage -> INVALID_ARGUMENT; a
  chunk altered on the source -> the fetcher's checksum check fails (nothing installed)."""
  srv, c = buf
  src = WeightSource(TOKEN)
  try:
    params = _params(6)
    pub = StreamPublisher(c, 7, params, chunk_bytes=4096, source=src)
    pub.publish()
    ch = grpc.insecure_channel(src.address)
    raw = ch.unary_stream(f"/{'scalerl.rollout.v1.RolloutBuffer'}/FetchWeights",
                          lambda x: x, lambda x: x)
    req = pb.FetchWeightsRequest(resume_version=7, streamed=True).SerializeToString()
    md = (("authorization", f"Bearer {TOKEN}"),)
    cases = [(req, (), grpc.StatusCode.UNAUTHENTICATED),
             (req, (("authorization", "Bearer wrong"),), grpc.StatusCode.UNAUTHENTICATED),
             (pb.FetchWeightsRequest(resume_version=5).SerializeToString(), md,
              grpc.StatusCode.NOT_FOUND),
             (b"\xff\xff\xff", md, grpc.StatusCode.INVALID_ARGUMENT),
             (pb.FetchWeightsRequest(resume_version=7, wait_timeout_s=-1).SerializeToString(), md,
              grpc.StatusCode.INVALID_ARGUMENT)]
    for body, meta, code in cases:
      with pytest.raises(grpc.RpcError) as e:
        list(raw(body, metadata=meta, timeout=10))
      assert e.value.code() == code, (body[:20], e.value.details())
    assert len(list(raw(req, metadata=md, timeout=10))) == 1 + len(pub.own) + 1   # + digest
    ch.close()
    v = src.versions[7]
    bad = bytearray(v.chunks[2])
    bad[-1] ^= 0xFF
    v.chunks[2] = bytes(bad)
    with pytest.raises(IOError, match="checksum mismatch"):
      StreamFetcher(c).fetch(-1, wait_timeout_s=5)
  finally:
    src.stop()


def test_buffer_rejects_bad_remote_manifests(buf):
  """'sources' / 'owners' / 'checksum' are validated before anything is announced."""
  srv, c = buf
  import hashlib
  import json
  pub = StreamPublisher(c, 1, _params(7), chunk_bytes=4096)
  good = dict(pub.manifest, sources=["127.0.0.1:1"], owners=[0] * len(pub.plan))
  for bad in [dict(good, sources=[]), dict(good, sources=["nohostport"]),
              dict(good, owners=[1] * len(pub.plan)), dict(good, owners=[0]),
              dict(good, checksum="md5")]:
    text = json.dumps(bad)
    first = pb.WeightChunk(version=1, total_bytes=pub.total_bytes, format=pub.manifest["format"],
                           sha256=hashlib.sha256(text.encode()).hexdigest(), manifest=text)
    with pytest.raises(grpc.RpcError) as e:
      c.publish_raw(iter([first.SerializeToString()]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad
  assert srv.weights.visible is None and srv.state.version == 0
