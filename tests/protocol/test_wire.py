"""The rollout data path's wire helpers (scalerl_jax/protocol/wire.py) and WAL record parts."""
import numpy as np

from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.buffer import wal
from scalerl_jax.protocol import wire
from scalerl_jax.protocol.client import pack_push_requests


def _rollout(i: int) -> bytes:
  return pb.Rollout(rollout_id=f"r{i}", group_id=1, sample_index=i,
                    completion_tokens=codec.encode(np.arange(5), pb.INT32),
                    logprobs=codec.encode(-np.ones(5), pb.FLOAT32),
                    timing=pb.Timing(start_unix_s=1.0)).SerializeToString()


def test_varint_round_trip():
  for n in (0, 1, 127, 128, 300, 2 ** 21, 2 ** 35, 2 ** 63 - 1):
    enc = wire.varint(n)
    assert wire.read_varint(enc, 0) == (n, len(enc))


def test_parse_push_views_are_the_request_bytes():
  raws = [_rollout(i) for i in range(3)]
  (req,) = pack_push_requests(raws, batch_bytes=1 << 20)
  got = wire.parse_push(req)
  assert [r.rollout_id for r, _ in got] == ["r0", "r1", "r2"]
  for (_r, view), raw in zip(got, raws):
    assert isinstance(view, memoryview) and view.obj is req and bytes(view) == raw


def test_parse_push_rejects_malformed():
  good = _rollout(0)
  (req,) = pack_push_requests([good])
  cases = {
      "empty": b"",
      "other_field": b"\x12\x01x",
      "truncated": req[:-3],
      "garbage_rollout": b"\x0a\x03\xff\xff\xff",
      "unknown_in_rollout": b"\x0a" + wire.varint(len(good) + 3) + good + b"\xf8\x07\x01",
      "unknown_in_tensor": (lambda r: b"\x0a" + wire.varint(len(r)) + r)(
          pb.Rollout(rollout_id="x").SerializeToString() + b"\x32\x03\xa0\x06\x01"),
  }
  for name, data in cases.items():
    assert isinstance(wire.parse_push(data), wire.Malformed), name


def test_retain_copies_when_mostly_unstored():
  req = b"x" * 1000
  v = memoryview(req)
  kept = wire.retain([v[:300], v[300:600]])
  assert all(isinstance(x, memoryview) for x in kept)
  copied = wire.retain([v[:100]])
  assert isinstance(copied[0], bytes) and copied[0] == req[:100]


def test_wal_encode_parts_same_bytes_as_encode():
  body = _rollout(7)
  assert b"".join(wal.encode_parts(wal.ROLLOUT, memoryview(body))) == wal.encode(wal.ROLLOUT, body)
  assert b"".join(wal.encode_parts(wal.LEASE, {"gid": 1})) == wal.encode(wal.LEASE, {"gid": 1})
