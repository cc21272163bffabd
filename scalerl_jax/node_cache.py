"""One local copy per node of a gs:// checkpoint directory, shared by the node's generator pods.

A vLLM engine loads from a local path, so a generator started on a gs:// `model.hf_checkpoint`
needs a copy on its node's disk (216 GB for Llama-4 Scout). `node_copy(src, root)` makes that copy
once per node and lets every other pod on the node reuse it:

* `root` is a node-local directory every generator pod of the node mounts (a hostPath volume in
  the rendered manifests, `generator.ckpt_cache_dir`); the copy lives at ROOT/gs/BUCKET/PATH.
* An exclusive `flock` on ROOT/gs/BUCKET/PATH.lock lets one process fetch while the others wait;
  the kernel drops the lock when its holder dies, so a killed fetcher never blocks the node.
  Checking an existing copy takes the lock shared, so the node's pods check side by side.
* The fetch goes to a sibling `.partial-PID-…` directory; its manifest (`MANIFEST`: every file's
  size and MD5, checked against the object's GCS md5Hash when GCS has one) is written last, then
  the directory is renamed into place in one `rename`. A copy without a manifest is never trusted;
  partial directories a dead fetcher left are removed by the next lock holder.
* Before reuse the copy is checked against its manifest (sizes always; MD5s too with
  `verify=True`); a copy that does not match is moved aside and fetched again.
* Each file is fetched by parallel ranged reads (`storage.RangedFile`: one ranged GET per piece
  of `piece_bytes`, `workers` threads, written in place with `os.pwrite`), not one stream.

No JAX here (generation/vllm/engine.py and the pod self-test call it).
"""
from __future__ import annotations

import base64
import concurrent.futures as cf
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from typing import Iterator

from tqdm import tqdm

from scalerl_jax import storage

log = logging.getLogger(__name__)

MANIFEST = ".scalerl_copy.json"
HASH_CHUNK = 8 << 20


def cache_path(src: str, root: str) -> str:
  """Where `node_copy` keeps gs:// directory `src` under `root`: ROOT/gs/BUCKET/PATH."""
  scheme, rest = str(src).rstrip("/").split("://", 1)
  return os.path.join(root, scheme, *rest.strip("/").split("/"))


@contextlib.contextmanager
def node_lock(path: str, shared: bool = False) -> Iterator[None]:
  """A lock on `path` for every process of the node (flock: released by the kernel when the
  holder exits or dies): exclusive (a fetch), or `shared` (checks of a copy, run side by side).
  Logs once when it has to wait for another holder."""
  os.makedirs(os.path.dirname(path), exist_ok=True)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
  try:
    try:
      fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except BlockingIOError:
      log.info("node cache: waiting for another process's fetch (%s)", path)
      t0 = time.monotonic()
      fcntl.flock(fd, mode)
      log.info("node cache: lock free after %.1f s", time.monotonic() - t0)
    yield
  finally:
    os.close(fd)     # releases the lock


def file_md5(path: str) -> str:
  """Hex MD5 of a local file (read in HASH_CHUNK pieces)."""
  h = hashlib.md5()
  with open(path, "rb") as f:
    while chunk := f.read(HASH_CHUNK):
      h.update(chunk)
  return h.hexdigest()


def problems(dest: str, verify: bool = True, workers: int = 8) -> list[str]:
  """Why the copy at `dest` cannot be trusted ([] = complete and matching its manifest): no
  manifest, a file missing or of another size, or (verify) another MD5 than the manifest's."""
  try:
    with open(os.path.join(dest, MANIFEST)) as f:
      files = json.load(f)["files"]
  except (OSError, ValueError, KeyError) as e:
    return [f"no valid {MANIFEST} ({type(e).__name__})"]
  bad = []
  for rel, m in files.items():
    p = os.path.join(dest, *rel.split("/"))
    if not os.path.isfile(p) or os.path.getsize(p) != int(m["size"]):
      bad.append(f"{rel}: missing or not {m['size']} bytes")
  if verify and not bad:
    names = sorted(files)
    with cf.ThreadPoolExecutor(max(1, workers)) as ex:   # hashlib releases the GIL
      sums = list(ex.map(lambda r: file_md5(os.path.join(dest, *r.split("/"))), names))
    bad += [f"{r}: MD5 {s} != manifest {files[r]['md5']}" for r, s in zip(names, sums)
            if s != files[r]["md5"]]
  return bad


def fetch_file(src: str, dest: str, workers: int, piece_bytes: int) -> tuple[int, str]:
  """Copies one object (or local file) `src` to local `dest` with up to `workers` concurrent
  ranged reads of `piece_bytes` each, written in place; the MD5 is computed on the way, in file
  order, while later pieces are still arriving (at most 2 x workers pieces in memory). Returns
  (byte count, hex MD5)."""
  h = hashlib.md5()
  with storage.RangedFile(src) as rf:
    size = int(rf.size)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
      os.ftruncate(fd, size)

      def one(offset: int) -> bytes:
        data = rf.read(offset, min(piece_bytes, size - offset))
        if len(data) != min(piece_bytes, size - offset):
          raise OSError(f"{src}: short read at {offset} ({len(data)} bytes)")
        os.pwrite(fd, data, offset)
        return data
      offsets = list(range(0, size, piece_bytes))
      window = 2 * max(1, workers)
      with cf.ThreadPoolExecutor(max(1, workers)) as ex:
        pending = {k: ex.submit(one, o) for k, o in enumerate(offsets[:window])}
        for k in range(len(offsets)):
          h.update(pending.pop(k).result())    # in file order; hashlib releases the GIL
          if k + window < len(offsets):
            pending[k + window] = ex.submit(one, offsets[k + window])
      os.fsync(fd)
    finally:
      os.close(fd)
  return size, h.hexdigest()


def _source_md5(meta: dict) -> str:
  """The object's MD5 as hex from GCS metadata ("" when GCS has none: composite objects)."""
  return base64.b64decode(meta["md5"]).hex() if meta.get("md5") else ""


def _fetch_dir(src: str, tmp: str, workers: int, piece_bytes: int) -> dict:
  """Every file of `src` into local `tmp` (each by parallel ranged reads); returns the manifest
  ({"source", "files": {rel: {"size", "md5"}}, "seconds"}), MD5s checked against GCS's."""
  t0 = time.monotonic()
  files = {}
  rels = storage.walk_files(src)
  if not rels:
    raise FileNotFoundError(f"{src}: no files to copy")
  for rel in tqdm(rels, desc="checkpoint copy", unit="file", disable=len(rels) < 2):
    s, d = storage.join(src, *rel.split("/")), os.path.join(tmp, *rel.split("/"))
    os.makedirs(os.path.dirname(d), exist_ok=True)
    meta = storage.stat(s)
    n, md5 = fetch_file(s, d, workers, piece_bytes)
    want = _source_md5(meta)
    if n != int(meta["size"]) or (want and md5 != want):
      raise OSError(f"{s}: fetched {n} bytes, MD5 {md5}; the object has {meta['size']} bytes, "
                    f"MD5 {want or '?'}")
    files[rel] = {"size": n, "md5": md5}
  return {"source": str(src), "files": files, "seconds": round(time.monotonic() - t0, 3)}


def node_copy(src: str, root: str, workers: int, piece_bytes: int, verify: bool = True) -> str:
  """A local directory holding gs:// directory `src`'s files: ROOT/gs/BUCKET/PATH, fetched once
  per node (module docstring: lock, manifest, atomic rename, check before reuse). A local `src`
  is returned as it is."""
  if not storage.is_remote(src):
    return str(src)
  dest = cache_path(src, root)
  with node_lock(dest + ".lock", shared=True):    # the common case: pods check a copy side by side
    if os.path.isdir(dest) and not problems(dest, verify, workers):
      log.info("node cache: reusing %s for %s", dest, src)
      return dest
  with node_lock(dest + ".lock"):                  # one fetcher; re-checked: one may just have run
    parent, name = os.path.dirname(dest), os.path.basename(dest)
    for stale in os.listdir(parent):    # a dead fetcher's leftovers: we hold the lock
      if stale.startswith(name + ".partial-") or stale.startswith(name + ".bad-"):
        shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    if os.path.isdir(dest):
      bad = problems(dest, verify, workers)
      if not bad:
        log.info("node cache: reusing %s for %s", dest, src)
        return dest
      log.warning("node cache: %s is not trusted (%s); fetching again", dest, "; ".join(bad[:3]))
      aside = f"{dest}.bad-{uuid.uuid4().hex[:8]}"
      os.rename(dest, aside)
      shutil.rmtree(aside, ignore_errors=True)
    tmp = f"{dest}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
      manifest = _fetch_dir(src, tmp, workers, piece_bytes)
      with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
      os.rename(tmp, dest)            # the complete copy appears at once
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    log.info("node cache: fetched %s to %s (%d files, %.1f s)", src, dest,
             len(manifest["files"]), manifest["seconds"])
    return dest
