"""One start-checkpoint copy per node (scalerl_jax/node_cache.py) against a real GCS emulator
(gcp-storage-emulator on 127.0.0.1, in memory): two concurrent "pods" (processes) sharing one
cache directory fetch the checkpoint once, by ranged reads, and get byte-identical copies; a fetcher
killed with SIGKILL mid-fetch leaves no copy anyone trusts and does not block the next one; a
corrupted or truncated copy is detected and fetched again; vLLM's start directory goes through it.

This file is also the "pod": `python tests/core/test_node_cache.py fetch SRC ROOT DELAY_S`."""
import glob
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # also run as a script
from gcs_emulator import emulator_in_this_process  # noqa: E402

from scalerl_jax import node_cache, storage  # noqa: E402

pytestmark = [pytest.mark.xdist_group("node_cache")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "scalerl-node-cache"
PIECE = 256 << 10          # small pieces: many ranged reads per file
FILES = {"config.json": 300, "model-00001-of-00002.safetensors": 3 * PIECE + 123,
         "model-00002-of-00002.safetensors": 5 * PIECE, "sub/tokenizer.json": 1000}


def _worker(src, root, delay_s):
  """One "pod": node_copy with every ranged read counted (and slowed by `delay_s`)."""
  import logging
  logging.basicConfig(level=logging.INFO, stream=sys.stderr)
  storage.configure_emulator()
  counts = {"bytes": 0, "reads": 0}
  real = storage.RangedFile.read

  def read(self, offset, n):
    time.sleep(float(delay_s))
    data = real(self, offset, n)
    counts["bytes"] += len(data)
    counts["reads"] += 1
    return data
  storage.RangedFile.read = read
  t0 = time.monotonic()
  dest = node_cache.node_copy(src, root, workers=4, piece_bytes=PIECE)
  print(json.dumps({"dest": dest, "bytes_read": counts["bytes"], "reads": counts["reads"],
                    "seconds": time.monotonic() - t0}), flush=True)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  with emulator_in_this_process(tmp_path_factory.mktemp("emulator"), BUCKET) as url:
    yield url


@pytest.fixture
def ckpt(emulator, request):
  """A checkpoint directory on gs:// (random bytes) -> (gs:// path, {rel: bytes})."""
  rng = np.random.default_rng(abs(hash(request.node.name)) % 2**32)
  src = f"gs://{BUCKET}/{request.node.name}/ckpt"
  data = {rel: rng.integers(0, 256, n, dtype=np.uint8).tobytes() for rel, n in FILES.items()}
  for rel, b in data.items():
    storage.write_bytes(storage.join(src, *rel.split("/")), b)
  return src, data


def _same(dest, data):
  for rel, b in data.items():
    with open(os.path.join(dest, *rel.split("/")), "rb") as f:
      assert f.read() == b, rel


def _pod(src, root, delay_s, log):
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  return subprocess.Popen([sys.executable, os.path.abspath(__file__), "fetch", src, str(root),
                           str(delay_s)], env=env, stdout=subprocess.PIPE,
                          stderr=open(log, "w"), text=True)


def _partials(root):
  return glob.glob(os.path.join(str(root), "**", "*.partial-*"), recursive=True)


def _wait_for(cond, timeout=60.0):
  deadline = time.time() + timeout
  while not cond():
    assert time.time() < deadline, "timed out"
    time.sleep(0.05)


def test_two_pods_on_one_node_fetch_once_and_share_a_byte_identical_copy(ckpt, tmp_path):
  src, data = ckpt
  total = sum(len(b) for b in data.values())
  a = _pod(src, tmp_path / "node", 0.05, tmp_path / "a.log")   # ~13 reads x 0.05 s / 4 workers
  _wait_for(lambda: bool(_partials(tmp_path / "node")))         # pod a is fetching
  b = _pod(src, tmp_path / "node", 0.0, tmp_path / "b.log")
  outs = []
  for p in (a, b):
    so, _ = p.communicate(timeout=120)
    assert p.returncode == 0, open(tmp_path / ("a.log" if p is a else "b.log")).read()[-3000:]
    outs.append(json.loads(so.strip().splitlines()[-1]))
  assert outs[0]["dest"] == outs[1]["dest"] == node_cache.cache_path(src, str(tmp_path / "node"))
  # one fetch: pod a read every byte once, by ranged reads of at most PIECE; pod b read nothing
  want_reads = sum(-(-n // PIECE) for n in FILES.values())
  assert (outs[0]["bytes_read"], outs[0]["reads"]) == (total, want_reads), outs
  assert outs[1]["bytes_read"] == 0 and outs[1]["reads"] == 0, outs
  assert "waiting for another process's fetch" in open(tmp_path / "b.log").read()
  _same(outs[0]["dest"], data)
  man = json.load(open(os.path.join(outs[0]["dest"], node_cache.MANIFEST)))
  assert man["files"] == {rel: {"size": len(b), "md5": hashlib.md5(b).hexdigest()}
                          for rel, b in data.items()}
  assert not _partials(tmp_path / "node")


def test_a_killed_fetcher_leaves_no_trusted_copy_and_the_next_pod_fetches(ckpt, tmp_path):
  src, data = ckpt
  root = tmp_path / "node"
  dest = node_cache.cache_path(src, str(root))
  p = _pod(src, root, 0.5, tmp_path / "killed.log")     # slow: killed in the middle
  _wait_for(lambda: any(os.path.getsize(f) for d in _partials(root)
                        for f in glob.glob(os.path.join(d, "*"))
                        if os.path.isfile(f)))
  os.kill(p.pid, signal.SIGKILL)
  p.wait(30)
  assert _partials(root) and not os.path.exists(dest)    # a half copy, never at the trusted path
  assert node_cache.problems(_partials(root)[0])         # and not trustable by its manifest either
  t0 = time.monotonic()
  got = node_cache.node_copy(src, str(root), workers=4, piece_bytes=PIECE)   # lock was released
  assert got == dest and time.monotonic() - t0 < 60
  _same(dest, data)
  assert not _partials(root)                             # the dead fetcher's leftovers removed


def test_a_corrupted_or_truncated_copy_is_detected_and_fetched_again(ckpt, tmp_path, caplog):
  src, data = ckpt
  root = str(tmp_path / "node")
  dest = node_cache.node_copy(src, root, workers=4, piece_bytes=PIECE)
  big = os.path.join(dest, "model-00002-of-00002.safetensors")
  before = os.stat(big).st_ino
  assert node_cache.node_copy(src, root, workers=4, piece_bytes=PIECE) == dest
  assert os.stat(big).st_ino == before                   # a good copy is reused, not refetched
  with open(big, "r+b") as f:                            # one flipped byte, same size
    f.seek(PIECE + 7)
    b = f.read(1)
    f.seek(PIECE + 7)
    f.write(bytes([b[0] ^ 0xFF]))
  assert node_cache.problems(dest, verify=False) == []   # sizes alone cannot see it ...
  bad = node_cache.problems(dest, verify=True)
  assert len(bad) == 1 and "model-00002" in bad[0] and "MD5" in bad[0]   # ... the MD5s do
  with caplog.at_level("WARNING"):
    assert node_cache.node_copy(src, root, workers=4, piece_bytes=PIECE) == dest
  assert "not trusted" in caplog.text
  _same(dest, data)
  os.truncate(os.path.join(dest, "config.json"), 10)     # truncated: seen even without hashing
  assert node_cache.node_copy(src, root, workers=4, piece_bytes=PIECE, verify=False) == dest
  _same(dest, data)
  os.remove(os.path.join(dest, node_cache.MANIFEST))     # no manifest: never trusted
  assert node_cache.problems(dest)
  assert node_cache.node_copy(src, root, workers=4, piece_bytes=PIECE) == dest
  _same(dest, data)


def test_vllm_start_dir_copies_a_gs_checkpoint_once_per_node(ckpt, tmp_path):
  from scalerl_jax.config import base_config
  from scalerl_jax.generation.vllm.engine import vllm_start_dir
  src, data = ckpt
  c = base_config()
  c.model.hf_checkpoint = src
  c.generator.ckpt_cache_dir = str(tmp_path / "node")
  c.generator.ckpt_fetch_piece_mb = 1
  got = vllm_start_dir(c.model, c.generator, 0)
  assert got == node_cache.cache_path(src, str(tmp_path / "node"))
  _same(got, data)
  assert vllm_start_dir(c.model, c.generator, 3) == ""   # a later version: the fetched weights


if __name__ == "__main__":
  if sys.argv[1] == "fetch":
    _worker(*sys.argv[2:5])
