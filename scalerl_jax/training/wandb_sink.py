"""Weights & Biases as a second metrics sink beside TensorBoard (issue #17).

`config.wandb.project` set: the trainer logs every numeric scalar of every metrics.jsonl record to
W&B (x-axis `trainer_step`, so records logged late by the live forecast's thread are kept), and the
end-of-run fit and forecast plots as images. Without `WANDB_API_KEY` (or with `config.wandb.mode =
"offline"`) the run is written offline under WORKDIR/wandb/ (sync later with `wandb sync`), so it
works on machines without network. The run id is kept in WORKDIR/wandb_id.txt: a resumed run logs
to the same W&B run. `read_offline_history` reads an offline run back (tests).
"""
from __future__ import annotations

import glob
import json
import os
import secrets
import shutil
import struct
import tempfile
import time

from scalerl_jax import lazy
from scalerl_jax import storage

# W&B (~1 CPU-s to import) only for a run with wandb.project set: loaded at first use.
wandb = lazy.module("wandb")
wandb_pb = lazy.module("wandb.proto.wandb_internal_pb2")

_BLOCK = 32768
_HEADER = 7


class WandbSink:
  """One W&B run for one workdir."""

  def __init__(self, workdir: str, cfg, run_config: dict | None = None,
               local_dir: str | None = None):
    """`workdir` may be gs:// (scalerl_jax/storage.py): the run id file is an object there, W&B's
    own files (it appends to them) go to `local_dir` (default storage.local_dir(workdir)) and are
    uploaded to WORKDIR/wandb/ by `finish`."""
    self._wandb = wandb
    self.workdir = workdir
    self.local = workdir if not storage.is_remote(workdir) else (
        local_dir or storage.local_dir(workdir))
    mode = cfg.mode or "auto"
    if mode == "auto":
      mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
    id_path = storage.join(workdir, "wandb_id.txt")
    if storage.exists(id_path):
      run_id = storage.read_text(id_path).strip()
    else:
      run_id = secrets.token_hex(4)
      storage.write_text(id_path, run_id + "\n")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.makedirs(self.local, exist_ok=True)
    self.run = wandb.init(project=cfg.project, entity=cfg.entity or None, dir=self.local,
                          id=run_id, resume="allow", mode=mode, config=run_config or {},
                          name=cfg.name or storage.basename(storage.abspath(workdir)))
    self.run.define_metric("trainer_step")
    self.run.define_metric("*", step_metric="trainer_step")
    self.mode = mode

  def log(self, record: dict) -> None:
    """The record's numeric scalars (bools and strings are left out, like TensorBoard)."""
    row = {k: v for k, v in record.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
    if row:
      self.run.log({"trainer_step": int(record["step"]), **row})

  def log_images(self, images: dict, step: int) -> None:
    """PNG files as W&B images, e.g. {"fit/curves": path}."""
    row, tmp = {}, []
    for k, p in images.items():
      if not p or not storage.exists(p):
        continue
      if storage.is_remote(p):        # W&B reads a local file: fetch the object first
        fd, local = tempfile.mkstemp(suffix=os.path.splitext(p)[1])
        with os.fdopen(fd, "wb") as f, storage.open(p, "rb") as src:
          shutil.copyfileobj(src, f)
        tmp.append(local)
        p = local
      row[k] = self._wandb.Image(p)
    if row:
      self.run.log({"trainer_step": int(step), **row})
    for t in tmp:
      os.remove(t)

  def finish(self) -> None:
    self.run.finish()
    src = os.path.join(self.local, "wandb")
    if storage.is_remote(self.workdir) and os.path.isdir(src):
      # wandb-core may still be flushing its offline file after finish(): upload once the run's
      # files stopped growing (at most ~20 s).
      size = lambda: sum(os.path.getsize(f) for f in glob.glob(os.path.join(src, "**", "*"),
                                                                recursive=True) if os.path.isfile(f))
      last, end = -1, time.time() + 20
      while time.time() < end and size() != last:
        last = size()
        time.sleep(0.5)
      storage.copy_tree(src, storage.join(self.workdir, "wandb"))


def _records(path: str):
  """Raw records of a .wandb file (a LevelDB-style log: 7-byte file header, 32 KiB blocks, chunks
  with a 7-byte header: crc32, little-endian length, type FULL=1 FIRST=2 MIDDLE=3 LAST=4)."""
  data = open(path, "rb").read()
  if data[:4] != b":W&B":
    raise ValueError(f"{path} is not a W&B run file")
  pos, buf = _HEADER, b""
  while pos + _HEADER <= len(data):
    left = _BLOCK - pos % _BLOCK
    if left < _HEADER:
      pos += left
      continue
    _, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
    if n == 0 and kind == 0:
      pos += left
      continue
    chunk = data[pos + _HEADER:pos + _HEADER + n]
    pos += _HEADER + n
    if kind == 1:
      yield chunk
    elif kind == 2:
      buf = chunk
    elif kind == 3:
      buf += chunk
    elif kind == 4:
      yield buf + chunk
      buf = b""


def read_offline_history(workdir: str) -> list[dict]:
  """History rows of the offline W&B runs under WORKDIR/wandb/ (in file order)."""
  pb = wandb_pb
  rows = []
  with storage.local_copy(storage.join(workdir, "wandb")) as d:    # gs://: a temporary copy
    paths = sorted(glob.glob(os.path.join(d, "offline-run-*", "run-*.wandb")))
    data = {p: list(_records(p)) for p in paths}
  for path in paths:
    for raw in data[path]:
      # Record comes from a generated module picked by protobuf's major version (a star import)
      rec = pb.Record()  # pyright: ignore[reportAttributeAccessIssue]
      rec.ParseFromString(raw)
      if rec.WhichOneof("record_type") == "history":
        row = {}
        for i in rec.history.item:
          keys = [i.key] if i.key else list(i.nested_key)
          d = row
          for k in keys[:-1]:
            d = d.setdefault(k, {})
          d[keys[-1]] = json.loads(i.value_json)
        rows.append(row)
  return rows
