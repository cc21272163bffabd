"""One path layer for run outputs: local paths and object storage (gs://) alike (docs/STORAGE.md).

Everything a run writes into its workdir goes through here: metrics.jsonl, config.json, the
learner-state file, checkpoint manifests (orbax/tensorstore write the checkpoint arrays to gs://
themselves), base_policy/, final_policy/, fit/, TensorBoard events, logs. Local paths use `os`;
gs:// paths use fsspec's `gcsfs` (the backend etils `epath` and orbax use for gs:// without
TensorFlow), so `path()` hands analysis code an `epath.Path` it can use like a `pathlib.Path`.

State that must stay on a local disk (the buffer's write-ahead log: fsync'd appends; child process
logs: open file descriptors; TensorBoard's event writer: appends) lives in `local_dir(workdir)`:
the workdir itself when it is local, else a fixed directory per workdir under the system temp dir
(or `config.local_dir`), so a rerun on the same machine finds its WAL again. Logs and TensorBoard
events are copied into the workdir at the end (`copy_tree`).

The GCS emulator's standard variable is honoured: with $STORAGE_EMULATOR_HOST set, gcsfs talks to
it anonymously, and `configure_emulator()` points tensorstore (orbax's array writer) at it too
($TENSORSTORE_GCS_HTTP_URL) and turns off gcsfs' hierarchical-namespace probe, which an emulator
does not answer ($GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; else ~60 s stall per bucket).

No JAX here: the buffer process and `analysis` import this module.
"""
from __future__ import annotations

import builtins
import contextlib
import os
import pathlib
import posixpath
import shutil
import socket
import tempfile
import urllib.parse
from typing import TYPE_CHECKING, Any, Iterator, Union

import numpy as np

from scalerl_jax import lazy

if TYPE_CHECKING:
  from etils import epath as epath_types

# gs:// only (costly imports a local run never needs): loaded at first use.
fsspec = lazy.module("fsspec")
epath = lazy.module("etils.epath")
google_auth = lazy.module("google.auth")
google_auth_exceptions = lazy.module("google.auth.exceptions")

REMOTE_SCHEMES = ("gs://",)
ENV_EMULATOR = "STORAGE_EMULATOR_HOST"


def is_remote(p) -> bool:
  """True for object-storage paths (gs://...)."""
  return str(p).startswith(REMOTE_SCHEMES)


def configure_emulator(env=None) -> str:
  """Points tensorstore and gcsfs at $STORAGE_EMULATOR_HOST when it is set (explicit settings
  win); returns the emulator URL or ""."""
  env = os.environ if env is None else env
  host = env.get(ENV_EMULATOR, "")
  if not host:
    return ""
  url = host if "://" in host else f"http://{host}"
  env.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
  env.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
  return url


def _fs():
  configure_emulator()
  return fsspec.filesystem("gs")


def _fresh_fs(p):
  """gcsfs caches listings; orbax/tensorstore write objects behind its back: forget them first."""
  fs = _fs()
  fs.invalidate_cache(_strip(p))
  return fs


def _strip(p) -> str:
  return str(p).rstrip("/")


AnyPath = Union[pathlib.Path, "epath_types.Path"]   # what `path` returns (the same API)


def path(p) -> AnyPath:
  """A path object: `pathlib.Path` for local paths, `etils.epath.Path` for gs:// (same API)."""
  if is_remote(p):
    configure_emulator()
    return epath.Path(str(p))
  return pathlib.Path(p)


def join(base, *parts) -> str:
  """os.path.join for local paths, '/'-join for gs:// (never produces a local 'gs:' folder)."""
  return posixpath.join(str(base), *parts) if is_remote(base) else os.path.join(base, *parts)


def abspath(p) -> str:
  return str(p) if is_remote(p) else os.path.abspath(p)


def dirname(p) -> str:
  return posixpath.dirname(_strip(p)) if is_remote(p) else os.path.dirname(p)


def basename(p) -> str:
  return posixpath.basename(_strip(p)) if is_remote(p) else os.path.basename(p)


def exists(p) -> bool:
  return _fresh_fs(p).exists(_strip(p)) if is_remote(p) else os.path.exists(p)


def isdir(p) -> bool:
  return _fresh_fs(p).isdir(_strip(p)) if is_remote(p) else os.path.isdir(p)


def isfile(p) -> bool:
  return _fresh_fs(p).isfile(_strip(p)) if is_remote(p) else os.path.isfile(p)


def listdir(p) -> list[str]:
  """Names directly under `p` ([] when it does not exist)."""
  if not is_remote(p):
    return os.listdir(p) if os.path.isdir(p) else []
  fs = _fresh_fs(p)
  if not fs.isdir(_strip(p)):
    return []
  return sorted({posixpath.basename(e.rstrip("/")) for e in fs.ls(_strip(p), detail=False)})


def makedirs(p) -> None:
  """Creates a local directory (and parents); a no-op for gs:// (object storage has no folders)."""
  if not is_remote(p):
    os.makedirs(p, exist_ok=True)


def getsize(p) -> int:
  return int(_fs().size(_strip(p))) if is_remote(p) else os.path.getsize(p)


def stat(p) -> dict:
  """A file's metadata, no content read: {"size"} plus, for gs://, the object's server-side
  checksums ("crc32c", "md5": base64 as GCS reports them, when present) and, locally, "mtime_ns"."""
  if not is_remote(p):
    st = os.stat(p)
    return {"size": int(st.st_size), "mtime_ns": int(st.st_mtime_ns)}
  info = _fs().info(_strip(p))
  out: dict[str, int | str] = {"size": int(info["size"])}
  for key, name in (("crc32c", "crc32c"), ("md5Hash", "md5")):
    if info.get(key):
      out[name] = str(info[key])
  return out


def open(p, mode: str = "r", **kw) -> Any:  # noqa: A001 - the layer's open
  """builtins.open for local paths, a gcsfs file for gs:// (written as one object on close)."""
  if not is_remote(p):
    return builtins.open(p, mode, **kw)
  if "b" not in mode:
    kw.setdefault("encoding", "utf-8")
  return _fs().open(_strip(p), mode, **kw)


def read_text(p) -> str:
  with open(p, "r") as f:
    return f.read()


def write_bytes(p, data: bytes) -> None:
  """Writes `p` atomically: local via a fsync'd temporary + rename, gs:// as one object."""
  if is_remote(p):
    with open(p, "wb") as f:
      f.write(data)
    return
  tmp = f"{p}.tmp"
  with builtins.open(tmp, "wb") as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, p)


def write_text(p, text: str) -> None:
  write_bytes(p, text.encode("utf-8"))


def append_text(p, text: str) -> None:
  """Appends `text` to `p`. gs:// objects cannot be appended to: the object is rewritten."""
  if not is_remote(p):
    with builtins.open(p, "a", encoding="utf-8") as f:
      f.write(text)
    return
  old = read_text(p) if exists(p) else ""
  write_text(p, old + text)


def remove(p) -> None:
  if is_remote(p):
    _fs().rm(_strip(p))
  else:
    os.remove(p)


def rmtree(p) -> None:
  if is_remote(p):
    fs = _fresh_fs(p)
    if fs.exists(_strip(p)):
      fs.rm(_strip(p), recursive=True)
  else:
    shutil.rmtree(p, ignore_errors=True)


def walk_files(d) -> list[str]:
  """Relative paths ('/'-separated) of every file under directory `d`, sorted."""
  out = []
  if is_remote(d):
    root = _strip(d)
    fs = _fresh_fs(d)
    prefix = root.split("://", 1)[-1] + "/"
    for full in fs.find(root):
      out.append(full.split("://", 1)[-1][len(prefix):])
    return sorted(out)
  for r, _, names in os.walk(d):
    for n in names:
      out.append(os.path.relpath(os.path.join(r, n), d).replace(os.sep, "/"))
  return sorted(out)


def copy_tree(src, dst, last: tuple[str, ...] = ()) -> None:
  """Copies every file of directory `src` to `dst` (either may be gs://); files named in `last`
  go last, so their presence means the copy is complete."""
  files = walk_files(src)
  files = [f for f in files if f not in last] + [f for f in files if f in last]
  for rel in files:
    target = join(dst, *rel.split("/"))
    if not is_remote(target):
      os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(join(src, *rel.split("/")), "rb") as fi, open(target, "wb") as fo:
      shutil.copyfileobj(fi, fo, 1 << 22)


def move(src, dst) -> None:
  """Moves a file or directory (local: one rename; gs://: copy, then delete the source)."""
  if not is_remote(src) and not is_remote(dst):
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    os.replace(src, dst)
    return
  if isdir(src):
    copy_tree(src, dst)
    rmtree(src)
  else:
    with open(src, "rb") as fi, open(dst, "wb") as fo:
      shutil.copyfileobj(fi, fo, 1 << 22)
    remove(src)


@contextlib.contextmanager
def staged_dir(dest, last: tuple[str, ...] = ("config.json",)) -> Iterator[str]:
  """Yields a local directory whose files end up in `dest`: `dest` itself when local, else a
  temporary directory uploaded to gs:// on success (files in `last` uploaded last) and removed."""
  if not is_remote(dest):
    os.makedirs(dest, exist_ok=True)
    yield dest
    return
  tmp = tempfile.mkdtemp(prefix="scalerl-stage-")
  try:
    yield tmp
    copy_tree(tmp, dest, last=last)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def local_copy(src) -> Iterator[str]:
  """Yields a local path holding directory `src`'s files (`src` itself when local)."""
  if not is_remote(src):
    yield src
    return
  tmp = tempfile.mkdtemp(prefix="scalerl-fetch-")
  try:
    copy_tree(src, tmp)
    yield tmp
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def local_dir(workdir, configured: str = "") -> str:
  """Where a run keeps what must be on a local disk (WAL, child logs, TensorBoard staging, the
  files its child processes read): `configured` if set, the workdir when local, else
  TMPDIR/scalerl-local/BUCKET/PATH (stable, so a rerun finds the buffer's WAL again)."""
  if configured:
    return configured
  if not is_remote(workdir):
    return workdir
  scheme, rest = str(workdir).split("://", 1)
  return os.path.join(tempfile.gettempdir(), "scalerl-local", scheme, *rest.strip("/").split("/"))


class RemoteStorageError(RuntimeError):
  """gs:// is unusable (no credentials, no such bucket, unreachable emulator); one-line message."""


def check_remote_writable(workdir: str, probe_name: str) -> None:
  """Writes and deletes one small object under `workdir` (gs://), raising RemoteStorageError with
  one actionable line when that is impossible. Never writes anything locally."""
  url = configure_emulator()
  bucket = str(workdir).split("://", 1)[1].split("/", 1)[0]
  if not bucket:
    raise RemoteStorageError(f"{workdir!r} names no bucket; use gs://BUCKET/PATH")
  if url:
    u = urllib.parse.urlparse(url)
    try:
      socket.create_connection((u.hostname, u.port or 80), timeout=5).close()
    except OSError as e:
      raise RemoteStorageError(f"${ENV_EMULATOR}={os.environ[ENV_EMULATOR]} is not reachable "
                               f"({e.strerror or e}); start the GCS emulator or unset it") from None
  else:
    try:
      google_auth.default()
    except google_auth_exceptions.DefaultCredentialsError:
      raise RemoteStorageError(
          f"no Google Cloud credentials for {workdir}: set GOOGLE_APPLICATION_CREDENTIALS, run "
          f"`gcloud auth application-default login`, use Workload Identity on GKE, or set "
          f"${ENV_EMULATOR} for a GCS emulator") from None
  probe = join(workdir, probe_name)
  try:
    write_bytes(probe, b"x" * 4096)
    remove(probe)
  except FileNotFoundError:
    raise RemoteStorageError(f"bucket gs://{bucket} does not exist (or this account cannot see "
                             f"it); create it or fix --workdir") from None
  except Exception as e:  # noqa: BLE001 - gcsfs raises auth / HTTP errors of many types
    raise RemoteStorageError(f"cannot write to {workdir}: {type(e).__name__}: {e}") from None



class RangedFile:
  """Byte-range reads of one file, local (`os.pread`) or gs:// (one ranged GET per range through
  gcsfs, several ranges concurrently): never a full copy. Counts `bytes_read` and `requests`."""

  def __init__(self, p):
    self.path = str(p)
    self.remote = is_remote(p)
    self.bytes_read = 0
    self.requests = 0
    if self.remote:
      self._fs = _fs()
      self.size = int(self._fs.size(_strip(p)))
    else:
      self._fd = os.open(p, os.O_RDONLY)
      self.size = os.fstat(self._fd).st_size

  def read(self, offset: int, n: int) -> bytes:
    """`n` bytes at `offset` (fewer only at the end of the file)."""
    return self.read_many([(offset, n)])[0]

  def read_many(self, ranges) -> list:
    """[(offset, n), ...] -> [bytes, ...] in order."""
    ranges = [(int(o), int(n)) for o, n in ranges]
    if self.remote:
      out = self._fs.cat_ranges([_strip(self.path)] * len(ranges), [o for o, _ in ranges],
                                [o + n for o, n in ranges])
      for r in out:
        if isinstance(r, Exception):
          raise r
    else:
      out = [os.pread(self._fd, n, o) for o, n in ranges]
    self.requests += len(ranges)
    self.bytes_read += sum(len(r) for r in out)
    return out

  def map(self, offset: int, n: int) -> np.memmap:
    """A read-only uint8 memory map of bytes [offset, offset + n) (local files only); its pages
    are read as they are touched. Counted as one request; callers count the bytes they use."""
    if self.remote:
      raise ValueError(f"{self.path}: memory maps are for local files")
    self.requests += 1
    return np.memmap(self.path, dtype=np.uint8, mode="r", offset=int(offset), shape=(int(n),))

  def close(self) -> None:
    if not self.remote and self._fd >= 0:
      os.close(self._fd)
      self._fd = -1

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
