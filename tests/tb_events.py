"""TensorBoard scalars read back from tensorboardX event files (tests; no tensorboard package needed)."""
import struct
from pathlib import Path


def tb_scalars(tb_dir) -> dict:
  """{tag: [(step, value), ...]} from every events.out.tfevents.* file under `tb_dir` (TFRecord
  framing: uint64 length, uint32 crc, payload, uint32 crc)."""
  from tensorboardX.proto import event_pb2
  out = {}
  for f in sorted(Path(tb_dir).glob("events.out.tfevents.*")):
    data = f.read_bytes()
    i = 0
    while i + 12 <= len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      for v in ev.summary.value:
        out.setdefault(v.tag, []).append((ev.step, v.simple_value))
  return out
