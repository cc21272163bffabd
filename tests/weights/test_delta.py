"""Exact bf16 weight deltas (issue 44, point 3): a version goes out as the change to the bits the
generator holds; after any number of deltas its weights are bit-identical to the learner's bf16
cast of its fp32 masters, through chunk loss, reordering, a generator restart mid-stream and a
corrupt delta (a counted fallback to the full version)."""
import json

import jax
import ml_dtypes
import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.types import PromptSpec, WeightUpdateError
from scalerl_jax.weights import delta as wd
from scalerl_jax.weights import stream as st
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher, flatten

TOKEN = "delta-test-token"
BF16 = np.dtype(ml_dtypes.bfloat16)


class Boom(Exception):
  pass


def _bits(x):
  return np.ascontiguousarray(x).reshape(-1).view(np.uint16)


def _bf16_of(params):
  """The reference: numpy's (ml_dtypes) round-to-nearest-even cast of every fp32 leaf."""
  return [_bits(np.asarray(leaf, np.float32).astype(BF16)) for _, leaf in flatten(params)]


def test_encode_apply_is_exact_and_refuses_what_does_not_check():
  rng = np.random.default_rng(0)
  base = rng.standard_normal((300, 70)).astype(BF16)
  new = base.copy()
  flip = rng.random(base.shape) < 0.03
  new[flip] = (base[flip].astype(np.float32) * 1.01).astype(BF16)
  payload = wd.encode(base, new)
  assert len(payload) < 0.2 * new.nbytes
  out = np.empty_like(base)
  wd.apply(base, payload, out)
  assert np.array_equal(_bits(out), _bits(new))
  same = wd.encode(base, base)                         # nothing changed: a header and two streams
  wd.apply(base, same, out)
  assert np.array_equal(_bits(out), _bits(base)) and len(same) < 64
  other = rng.standard_normal(base.shape).astype(BF16)
  with pytest.raises(wd.DeltaError, match="CRC-32C mismatch"):
    wd.apply(other, payload, out)                      # the wrong base
  with pytest.raises(wd.DeltaError, match="lengths"):
    wd.apply(base, payload[:-5], out)                  # truncated
  bad = bytearray(payload)
  bad[wd._HEAD.size + 2] ^= 0xFF
  with pytest.raises(wd.DeltaError):
    wd.apply(base, bytes(bad), out)                    # corrupt compressed bytes
  big = rng.standard_normal((8, 10)).astype(BF16)      # a strided box (a column shard)
  dst = np.zeros_like(big)
  nxt = big.copy()
  nxt[3, 7] = (big[3, 7].astype(np.float32) * 2).astype(BF16)
  wd.apply(big[:, 5:], wd.encode(big[:, 5:], nxt[:, 5:]), dst[:, 5:])
  assert np.array_equal(_bits(dst[:, 5:]), _bits(nxt[:, 5:])) and not dst[:, :5].any()
  f32 = rng.standard_normal(50).astype(np.float32)     # any width: compared as unsigned ints
  g32 = f32.copy()
  g32[7] = np.nextafter(g32[7], np.float32(9))
  out32 = np.empty_like(f32)
  wd.apply(f32, wd.encode(f32, g32), out32)
  assert np.array_equal(out32.view(np.uint32), g32.view(np.uint32))


def _break_after(n):
  seen = [0]

  def hook(i):
    seen[0] += 1
    if seen[0] == n:
      raise Boom()
  return hook


def _masters(seed=0):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((96, 64)).astype(np.float32),
          "layers": [{"w": (0.05 * rng.standard_normal((64, 64))).astype(np.float32),
                      "norm": np.ones((64,), np.float32)} for _ in range(3)]}


def _adam_like_step(params, rng, lr=5e-7):
  """A sign-like update of size lr (AdamW early on moves each weight by about lr): most bf16
  elements stay, a few per cent cross a rounding boundary."""
  return {k: (_adam_like_step(v, rng, lr) if isinstance(v, dict) else
              [_adam_like_step(x, rng, lr) for x in v] if isinstance(v, list) else
              (v - np.float32(lr) * np.sign(rng.standard_normal(v.shape)).astype(np.float32)
               - np.float32(1e-6) * v).astype(np.float32))
          for k, v in params.items()}


def test_fifty_five_versions_stay_bit_identical_through_loss_reorder_restart_and_corruption():
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  src = WeightSource(TOKEN, keep=3)
  enc = wd.DeltaEncoder(full_every=1000)
  rng = np.random.default_rng(1)
  try:
    params = _masters()
    f = StreamFetcher(c)
    full_bytes, delta_bytes, restarted = 0, [], False
    for v in range(56):
      if v:
        params = _adam_like_step(params, rng)
      pub = StreamPublisher(c, v, params, chunk_bytes=2048, source=src,
                            wire_dtype="bfloat16", delta=enc)
      if v == 20:                                          # chunks staged in a shuffled order
        pub.own = list(rng.permutation(pub.own))
      if v == 40:                                          # one delta chunk corrupted on the way
        add = src.add

        def corrupt(version, index, msg, delta_msg=None, add=add):
          if delta_msg is not None and index == 3:
            m = ws.parse_weight_message(delta_msg)
            payload = bytearray(m.data)
            payload[-1] ^= 0x01                            # still a valid CRC on the wire ...
            delta_msg = ws.with_data(m.head.__class__(
                version=version, chunk_index=index, format=wd.DELTA_FORMAT,
                crc32=ws.CHECKSUMS["crc32c"](bytes(payload))).SerializeToString(), bytes(payload))
          add(version, index, msg, delta_msg)
        src.add = corrupt
      pub.publish()
      src.add = WeightSource.add.__get__(src)
      served0 = src.served_bytes
      if v in (10, 30):                # a stream lost after 3 chunks: resumed (10) / restart (30)
        f.on_chunk = _break_after(3)
        with pytest.raises(Boom):
          f.fetch(v - 1, wait_timeout_s=10)
        f.on_chunk = None
        assert 3 <= len(f._partial["have"]) < len(pub.plan)
      if v == 30:                                          # the generator restarts mid-stream
        f, restarted = StreamFetcher(c), True
      dchunks = f.delta_chunks
      got = f.fetch(v - 1, wait_timeout_s=10)
      assert got.version == v
      ref = _bf16_of(params)
      out = [_bits(leaf) for _, leaf in flatten(got.params)]
      assert all(np.array_equal(a, b) for a, b in zip(out, ref)), f"version {v} differs"
      sent = src.served_bytes - served0
      if v == 0 or v == 30:
        assert f.delta_chunks == dchunks                   # new / restarted: the full version
        full_bytes = full_bytes or sent
      elif v not in (10, 40):
        assert f.delta_chunks > dchunks, v
        delta_bytes.append(sent)
    assert restarted and f.delta_fallbacks == 1 and f.delta_misses == 0
    assert f.bulk_streams >= 25 and f.bulk_fallbacks == 0          # over the bulk channel
    assert f.digests_checked >= 25                        # every version since the restart
    assert src.delta_streams >= 50
    assert max(delta_bytes) < 0.35 * full_bytes, (max(delta_bytes), full_bytes)
  finally:
    src.stop()
    c.close()
    srv.stop()


def test_version_digest_mismatch_is_caught_after_delta_and_full():
  """A source whose version digest disagrees with the bits the chunks gave: after a delta the
  fetcher falls back to full (counted); a full fetch then refuses the version by name."""
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  src = WeightSource(TOKEN)
  enc = wd.DeltaEncoder(full_every=100)
  try:
    p0 = _masters()
    StreamPublisher(c, 0, p0, chunk_bytes=4096, source=src, wire_dtype="bfloat16",
                    delta=enc).publish()
    f = StreamFetcher(c)
    assert f.fetch(-1, wait_timeout_s=10).version == 0 and f.digests_checked == 1
    p1 = _adam_like_step(p0, np.random.default_rng(3))
    StreamPublisher(c, 1, p1, chunk_bytes=4096, source=src, wire_dtype="bfloat16",
                    delta=enc).publish()
    v = src.versions[1]
    v.trailer = ws.digest_message(1, {**v.crcs, 0: v.crcs[0] ^ 1})
    with pytest.raises(WeightUpdateError, match="version 1 failed.*version digest"):
      f.fetch(0, wait_timeout_s=10)
    assert f.delta_fallbacks == 1 and f.delta_chunks > 0
  finally:
    src.stop()
    c.close()
    srv.stop()


def test_full_version_every_n_and_fp32_wire_keeps_full_versions():
  enc = wd.DeltaEncoder(full_every=5)
  m = {"tensors": [{"name": ["a"], "dtype": "bfloat16", "itemsize": 2, "shape": [4]}],
       "chunks": [[0, [0], [4]]]}
  assert enc.base_for(1, m) == -1                          # nothing published yet
  enc.finish(4, m)
  assert enc.base_for(5, m) == -1 and enc.base_for(6, m) == 4   # 5 % 5 == 0: full
  assert enc.base_for(6, dict(m, chunks=[[0, [0], [2]], [0, [2], [2]]])) == -1   # new layout
  assert common.delta_on(common.Weights()) is True        # default: bf16 wire, deltas on
  assert common.delta_on(common.Weights(wire_dtype="float32")) is False
  assert common.delta_on(common.Weights(delta=False)) is False
  with pytest.raises(common.ConfigError, match="delta_full_every"):
    common.Weights(delta_full_every=0).check()


def test_bf16_wire_casts_on_device_two_bytes_per_param_cross_device_get(monkeypatch):
  """fp32 params on a device: what crosses jax.device_get is bf16 (2 bytes per parameter)."""
  crossed = []
  real = jax.device_get

  def spy(x):
    crossed.append((x.dtype, x.size, x.nbytes))
    return real(x)
  monkeypatch.setattr(st.jax, "device_get", spy)
  params = jax.tree.map(jax.device_put, _masters())
  n = sum(int(np.size(leaf)) for _, leaf in flatten(params))
  pub = StreamPublisher(None, 1, params, chunk_bytes=4096, wire_dtype="bfloat16")
  for i in range(len(pub.plan)):
    pub.encode(i)
  assert crossed and all(d == BF16 for d, _, _ in crossed)
  assert sum(s for _, s, _ in crossed) == n and sum(b for _, _, b in crossed) == 2 * n
  assert json.loads(pub._first and pub.manifest and json.dumps(pub.manifest))["tensors"][0][
      "dtype"] == "bfloat16"


def test_trainer_logs_each_versions_delta_fraction():
  """Trainer.publish keeps `delta_frac` (logged as weights_delta_frac): a version's delta bytes
  over its full bf16 bytes, 1.0 for a version sent full (the first, every delta_full_every-th)."""
  import types
  from scalerl_jax.training.trainer import Trainer
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  src = WeightSource(TOKEN, keep=3)
  config = common.base_config()
  config.weights.delta_full_every = 3
  rng = np.random.default_rng(2)
  params = _masters()
  fake = types.SimpleNamespace(
      config=config, client=c, source=src, sources=None, _delta=None, delta_frac=None,
      beacon=types.SimpleNamespace(tick=lambda: None),
      evaluation=types.SimpleNamespace(before_publish=lambda v: None),
      learner=types.SimpleNamespace(state=types.SimpleNamespace(params=params)))
  try:
    fracs, sent = [], []
    for v in range(5):
      if v:
        fake.learner.state.params = _adam_like_step(fake.learner.state.params, rng)
      d0 = fake._delta.delta_bytes if fake._delta else 0
      Trainer.publish(fake, v)
      fracs.append(fake.delta_frac)
      sent.append(fake._delta.delta_bytes - d0)
  finally:
    c.close()
    srv.stop()
    src.stop()
  model = 2 * sum(x.size for _, x in flatten(params))             # bf16 bytes of a version
  assert fracs[0] == 1.0 and fracs[3] == 1.0 and sent[0] == sent[3] == 0   # full: first, 3 % 3
  for v in (1, 2, 4):
    assert 0 < sent[v] < 0.2 * model and fracs[v] == pytest.approx(sent[v] / model), (v, fracs)
