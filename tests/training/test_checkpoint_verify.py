"""Checkpoint verification reads metadata, not the checkpoint's bytes (issue 24): orbax's commit
marker + the manifest's fingerprints (GCS object CRC-32C / MD5 from metadata; locally size + mtime,
re-hashing a file whose mtime changed). A corrupt or uncommitted step is still refused;
`full=True` (checkpoint.verify="full") re-reads every byte."""
import os

import jax.numpy as jnp
import pytest

from scalerl_jax.training import checkpoint
from scalerl_jax import storage


def _save(workdir, steps=(1, 2)):
  ck = checkpoint.RunCheckpointer(workdir, keep=3)
  for s in steps:
    ck.save(s, {"w": jnp.arange(64 * 1024, dtype=jnp.float32) * s}, {"s": s})
  ck.close()
  return storage.join(storage.abspath(workdir), "checkpoints")


class _ReadCounter:
  """Wraps storage.open: bytes read per file (the manifest and meta JSON are metadata)."""

  def __init__(self, monkeypatch):
    self.bytes = {}
    real = storage.open

    def counting(p, mode="r", **kw):
      f = real(p, mode, **kw)
      if "r" in mode:
        read = f.read

        def counted(*a):
          out = read(*a)
          self.bytes[str(p)] = self.bytes.get(str(p), 0) + len(out)
          return out
        f.read = counted
      return f
    monkeypatch.setattr(storage, "open", counting)

  def data_bytes(self) -> int:
    return sum(n for p, n in self.bytes.items()
               if not p.endswith((checkpoint.MANIFEST, os.path.join("meta", "metadata"),
                                  "meta/metadata")))


def _biggest(step_dir):
  return max((os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs),
             key=os.path.getsize)


def test_local_verify_reads_no_checkpoint_bytes_and_catches_corruption(tmp_path, monkeypatch):
  ck = _save(str(tmp_path))
  step_dir = os.path.join(ck, "2")
  big = _biggest(step_dir)
  assert os.path.getsize(big) >= 64 * 1024          # the array data file
  reads = _ReadCounter(monkeypatch)
  assert checkpoint.verify(step_dir) is None
  assert reads.data_bytes() == 0, reads.bytes       # metadata only
  assert checkpoint.verify(step_dir, full=True) is None
  total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(step_dir) for f in fs
              if f != checkpoint.MANIFEST)
  assert reads.data_bytes() >= total - 4096         # full: every byte re-read (meta excluded)
  # In-place corruption (same size): the rewrite moves the mtime, so the file is re-hashed.
  st = os.stat(big)
  with open(big, "r+b") as f:
    f.seek(st.st_size // 2)
    chunk = f.read(16)
    f.seek(-len(chunk), 1)
    f.write(bytes(x ^ 0xFF for x in chunk))
  os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))   # force a distinct mtime
  rel = os.path.relpath(big, step_dir)
  assert checkpoint.verify(step_dir) == f"{rel} sha256 mismatch"
  # A truncated file: caught from its size alone.
  with open(big, "r+b") as f:
    f.truncate(st.st_size - 8)
  assert "bytes, manifest says" in checkpoint.verify(step_dir)


def test_uncommitted_step_is_refused_and_find_valid_falls_back(tmp_path):
  ck = _save(str(tmp_path))
  os.remove(os.path.join(ck, "2", checkpoint.COMMIT_MARKER))
  assert checkpoint.verify(os.path.join(ck, "2")) == \
      f"not committed by orbax (no {checkpoint.COMMIT_MARKER})"
  step, meta, skipped = checkpoint.find_valid(str(tmp_path))
  assert step == 1 and meta["s"] == 1 and skipped[0]["step"] == 2


def test_copied_checkpoint_with_new_mtimes_is_rehashed_not_refused(tmp_path):
  """A copy that does not keep mtimes (cp without -p) is still valid: changed mtimes only make
  verification re-hash those files."""
  ck = _save(str(tmp_path), steps=(1,))
  for r, _, fs in os.walk(os.path.join(ck, "1")):
    for f in fs:
      os.utime(os.path.join(r, f), ns=(1, 1))
  assert checkpoint.verify(os.path.join(ck, "1")) is None


@pytest.mark.xdist_group("gcs")
def test_gcs_verify_uses_object_checksums_only(tmp_path, monkeypatch):
  """gs:// (the GCS emulator): the manifest holds the objects' CRC-32C/MD5 from metadata (nothing
  read back at write time either); verification reads no checkpoint byte; an object rewritten
  with other bytes of the same size fails on its metadata checksum; no commit marker fails."""
  import sys
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  from gcs_emulator import running_emulator
  with running_emulator(str(tmp_path)) as url:
    for k in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL",
              "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"):
      monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", url)
    storage.configure_emulator()
    storage._fs().mkdir("verify-bucket")
    wd = "gs://verify-bucket/run"
    reads = _ReadCounter(monkeypatch)
    ck = _save(wd)
    step_dir = storage.join(ck, "2")
    man = __import__("json").loads(storage.read_text(storage.join(step_dir, checkpoint.MANIFEST)))
    assert all("crc32c" in e and "sha256" not in e for e in man["files"].values()), man
    assert reads.data_bytes() == 0, reads.bytes      # the manifest read no object back
    assert checkpoint.verify(step_dir) is None
    assert reads.data_bytes() == 0, reads.bytes
    assert checkpoint.verify(step_dir, full=True) is None
    assert reads.data_bytes() > 64 * 1024 * 4 // 2
    rel = max(man["files"], key=lambda r: man["files"][r]["size"])
    p = storage.join(step_dir, rel)
    with storage.open(p, "rb") as f:
      data = f.read()
    storage.write_bytes(p, bytes(x ^ 0xFF for x in data[:16]) + data[16:])
    assert checkpoint.verify(step_dir) == f"{rel} crc32c mismatch (object metadata)"
    storage.remove(storage.join(storage.join(ck, "1"), checkpoint.COMMIT_MARKER))
    assert "not committed by orbax" in checkpoint.verify(storage.join(ck, "1"))
