"""The HF export a vLLM generator writes at start, reused across restarts (issue 46).

`cached_export(dir, digest, write)` keeps `dir` when its marker names the same source digest and
every file it lists still has its size (skip the rewrite, log it); else it rewrites the export into
a sibling temporary directory, writes the marker last and renames it into place (a restart cut off
mid-write leaves no export that looks complete). `params_digest` is the source's checksum: sha256
over every leaf's path, dtype, shape and bytes, so a changed checkpoint (or version) rewrites."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from typing import Any, Callable

import numpy as np

log = logging.getLogger("scalerl.export_cache")

MARKER = "scalerl_export.json"


def params_digest(params: Any, extra: str = "") -> str:
  """sha256 (hex) of a params pytree (nested dicts of arrays) plus `extra` (e.g. the dtype)."""
  h = hashlib.sha256(extra.encode())

  def walk(prefix: str, node: Any) -> None:
    if isinstance(node, dict):
      for k in sorted(node, key=str):
        walk(f"{prefix}/{k}", node[k])
      return
    a = np.ascontiguousarray(np.asarray(node))
    h.update(f"{prefix}|{a.dtype.str}|{a.shape}".encode())
    h.update(a.reshape(-1).view(np.uint8).data)   # bytes view, no copy (bf16 too)
  walk("", params)
  return h.hexdigest()


def _intact(path: str, digest: str) -> bool:
  try:
    with open(os.path.join(path, MARKER)) as f:
      m = json.load(f)
  except (OSError, ValueError):
    return False
  if m.get("sha256") != digest or not m.get("files"):
    return False
  return all(os.path.isfile(p := os.path.join(path, n)) and os.path.getsize(p) == size
             for n, size in m["files"].items())


def cached_export(path: str, digest: str, write: Callable[[str], None]) -> bool:
  """Makes `path` hold the export of the source named by `digest`; `write(dir)` writes one.
  Returns True when it wrote, False when the export on disk was reused."""
  if _intact(path, digest):
    log.info("HF export %s reused: its checksum matches the source (sha256 %s...)", path, digest[:12])
    return False
  had = os.path.exists(path)
  tmp = path + ".writing"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  write(tmp)
  files = {n: os.path.getsize(os.path.join(tmp, n)) for n in sorted(os.listdir(tmp))
           if os.path.isfile(os.path.join(tmp, n))}
  with open(os.path.join(tmp, MARKER), "w") as f:
    json.dump({"sha256": digest, "files": files}, f)
  shutil.rmtree(path, ignore_errors=True)
  os.replace(tmp, path)
  log.info("HF export %s written (sha256 %s...; %s)", path, digest[:12],
           "it no longer matched the source" if had else "none on disk")
  return True
