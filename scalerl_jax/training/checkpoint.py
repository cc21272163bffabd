"""Run checkpoints through orbax: the learner state plus a JSON sidecar of host-side run state.

Layout: WORKDIR/checkpoints/<step>/{state, meta, manifest.json}; WORKDIR may be gs:// (orbax and
tensorstore write there natively; the manifest goes through scalerl_jax/storage.py). `state` is the LearnerState pytree
(params, optimizer state, step); `meta` is JSON (compute ledger, No-Positive-Resampling history,
consumption offsets, RNG seeds, wall-clock time of the save; see `Trainer.save`). Orbax writes each
step atomically (temporary directory + rename) and keeps the newest `keep`.

`manifest.json` is written after orbax finalized the step: a fingerprint of every file of the step
(size; on gs:// the object's CRC-32C/MD5 from GCS metadata, nothing read back; locally sha256 +
mtime). A step without orbax's commit marker or a manifest (crash between orbax's rename and the
manifest) or whose files do not match it (corruption) is not valid: `find_valid` moves it to
WORKDIR/checkpoints_invalid/ and falls back to the previous one with a WARNING naming the step and
the reason. Verification reads metadata only by default (`checkpoint.verify="metadata"`);
"full" re-reads every byte (local debugging).

A save that fails (full disk, unwritable directory) raises `CheckpointError` naming the last good
step; orbax never touches finished steps while writing a new one, so that step stays intact.

Asynchronous saves (`RunCheckpointer(..., async_save=True)`, the trainer's default through
`config.checkpoint.async_save`): `save` returns once orbax holds a host copy of the state (its
blocking part); a background thread then waits for orbax to commit the step (tmp dir + rename),
hashes it into `manifest.json` and runs the caller's `on_done` (the trainer updates
WORKDIR/learner_state.json there, so the buffer never trusts a step before its manifest exists).
A crash at any point before the manifest is written leaves an invalid step that `find_valid`
skips: the previous checkpoint stays the newest valid one. The next `save`, `wait` or `close`
first waits for the save in flight; a background failure is raised (as `CheckpointError`) by the
next `check`, `save`, `wait` or `close`.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import struct
import threading
import time
from typing import Any

import crc32c
import jax
import orbax.checkpoint as ocp

from scalerl_jax import config as common
from scalerl_jax import storage

log = logging.getLogger("scalerl.checkpoint")
MANIFEST = "manifest.json"
COMMIT_MARKER = "commit_success.txt"   # orbax writes it when it finalized a step
VERIFY_MODES = common.VERIFY_MODES      # checkpoint.verify


class CheckpointError(RuntimeError):
  """A checkpoint could not be written (the message names the last good checkpoint)."""


def _hash_file(path: str) -> str:
  h = hashlib.sha256()
  with storage.open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def _crc32c_file(path: str) -> str:
  """CRC-32C of a file's bytes, base64 of the big-endian value (how GCS reports `crc32c`)."""
  v = 0
  with storage.open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      v = crc32c.crc32c(block, v)
  return base64.b64encode(struct.pack(">I", v)).decode()


def _md5_file(path: str) -> str:
  """MD5 of a file's bytes, base64 (how GCS reports `md5Hash`)."""
  h = hashlib.md5()
  with storage.open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return base64.b64encode(h.digest()).decode()


def _files(step_dir: str) -> list[str]:
  return [rel for rel in storage.walk_files(step_dir) if rel != MANIFEST]


def _fingerprint(path: str) -> dict:
  """A file's manifest entry. gs://: size + the object's server-side CRC-32C / MD5 from its
  metadata (GCS computed them on upload; no byte is read back). Local: size, sha256 (read once,
  from local disk) and mtime_ns (`verify` trusts an unchanged (size, mtime) and re-hashes
  otherwise)."""
  st = storage.stat(path)
  entry = {"size": st["size"]}
  if storage.is_remote(path) and ("crc32c" in st or "md5" in st):
    entry.update({k: st[k] for k in ("crc32c", "md5") if k in st})
  else:
    entry["sha256"] = _hash_file(path)
    if "mtime_ns" in st:
      entry["mtime_ns"] = st["mtime_ns"]
  return entry


def write_manifest(step_dir: str, step: int) -> dict:
  """Writes `step_dir/manifest.json` (a fingerprint per file: `_fingerprint`), atomically."""
  files = {rel: _fingerprint(storage.join(step_dir, rel)) for rel in _files(step_dir)}
  man = dict(step=int(step), written_at_unix_s=time.time(), files=files)
  storage.write_text(storage.join(step_dir, MANIFEST), json.dumps(man))
  return man


def _check_file(p: str, rel: str, want: dict, full: bool) -> str | None:
  """None if file `rel` at `p` matches its manifest entry, else the reason. Without `full` only
  metadata is read (object checksums, size, mtime), except for a local file whose mtime changed
  (or an old manifest without fingerprints): that file is re-hashed."""
  st = storage.stat(p)
  if st["size"] != want["size"]:
    return f"{rel} has {st['size']} bytes, manifest says {want['size']}"
  for key in ("crc32c", "md5"):
    if key in want and key in st:
      if st[key] != want[key]:
        return f"{rel} {key} mismatch (object metadata)"
      if not full:
        return None
  for key, fn in (("crc32c", _crc32c_file), ("md5", _md5_file)):
    if key in want:          # full, or the store reported no checksum: re-read the bytes
      return None if fn(p) == want[key] else f"{rel} {key} mismatch (bytes re-read)"
  if "sha256" not in want:
    return f"{rel}: no checksum in the manifest and none in the object metadata"
  if not full and "mtime_ns" in want and st.get("mtime_ns") == want["mtime_ns"]:
    return None
  if _hash_file(p) != want["sha256"]:
    return f"{rel} sha256 mismatch"
  return None


def verify(step_dir: str, full: bool = False) -> str | None:
  """None if the step is committed and its files match its manifest, else the reason it is not
  valid. Committed: orbax finalized it (its commit marker `commit_success.txt` exists; orbax
  writes it last, locally and on GCS) and our manifest exists. Files: present, sizes and
  checksums as `_check_file` compares them: by default from metadata only (~0 bytes read for a
  gs:// checkpoint, instead of re-reading every byte: ~96 GB for 8B); `full=True`
  (`checkpoint.verify="full"`, for local debugging) re-reads every byte."""
  path = storage.join(step_dir, MANIFEST)
  if not storage.exists(path):
    return "no manifest.json (the save did not complete)"
  try:
    man = json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    return f"unreadable manifest.json ({e})"
  present = set(_files(step_dir))
  if COMMIT_MARKER not in present:
    return f"not committed by orbax (no {COMMIT_MARKER})"
  for rel, want in man["files"].items():
    if rel not in present:
      return f"{rel} is missing"
    why = _check_file(storage.join(step_dir, rel), rel, want, full)
    if why is not None:
      return why
  try:
    read_meta(step_dir)
  except (OSError, ValueError) as e:
    return f"meta unreadable ({e})"
  return None


def read_meta(step_dir: str) -> dict:
  """The JSON run state of one checkpoint step (no orbax, no jax)."""
  return json.loads(storage.read_text(storage.join(step_dir, "meta", "metadata")))


def step_dirs(workdir: str) -> list[tuple[int, str]]:
  """(step, dir) of every finished orbax step under WORKDIR/checkpoints, oldest first."""
  d = storage.join(storage.abspath(workdir), "checkpoints")
  return sorted((int(n), storage.join(d, n)) for n in storage.listdir(d) if n.isdigit())


def finished_steps(workdir: str) -> list[int]:
  """Steps under WORKDIR/checkpoints whose save finished (a manifest is written), oldest first;
  [] when there is no checkpoint directory yet."""
  d = storage.join(storage.abspath(workdir), "checkpoints")
  if not storage.exists(d):
    return []
  return [s for s, p in step_dirs(workdir) if storage.exists(storage.join(p, MANIFEST))]


def find_valid(workdir: str, full: bool = False) -> tuple[int, dict, list[dict]] | None:
  """Newest valid checkpoint (`verify`, `full` re-reads every byte): (step, meta, skipped) where
  `skipped` lists the newer steps that were not valid ({"step", "reason", "moved_to"}); those are
  moved to WORKDIR/checkpoints_invalid/ so a resumed run can save those step numbers again. None
  when no step is valid."""
  skipped = []
  wd = storage.abspath(workdir)
  ck = storage.join(wd, "checkpoints")
  for n in storage.listdir(ck):
    if ".orbax-checkpoint-tmp" in n:           # a save interrupted by a crash or a full disk
      dest = storage.join(wd, "checkpoints_invalid", n)
      storage.move(storage.join(ck, n), dest)
      log.warning("unfinished checkpoint save %s moved to %s", n, dest)
  for step, path in reversed(step_dirs(workdir)):
    why = verify(path, full=full)
    if why is None:
      if skipped:
        log.warning("resuming from checkpoint %d instead (fell back from %s)", step,
                    ", ".join(str(s["step"]) for s in skipped))
      return step, read_meta(path), skipped
    dest = storage.join(wd, "checkpoints_invalid", f"{step}-{time.strftime('%Y%m%d-%H%M%S')}")
    storage.move(path, dest)
    log.warning("checkpoint %d is not valid: %s; moved to %s, falling back to the previous one",
                step, why, dest)
    skipped.append(dict(step=step, reason=why, moved_to=dest))
  return None


class RunCheckpointer:
  """Saves and restores (LearnerState, meta) pairs under WORKDIR/checkpoints."""

  @classmethod
  def for_section(cls, workdir: str, checkpoint: common.Checkpoint) -> "RunCheckpointer":
    """The checkpointer of a run's checkpoint section (keep, async_save)."""
    return cls(workdir, keep=checkpoint.keep, async_save=checkpoint.async_save)

  def __init__(self, workdir: str, keep: int = common.Checkpoint.keep, async_save: bool = False):
    self.directory = storage.join(storage.abspath(workdir), "checkpoints")
    handlers = None
    if storage.is_remote(workdir) and storage.configure_emulator():
      # tensorstore's OCDBT format cannot read back what it wrote to gcp-storage-emulator
      # ("Malformed StorageGeneration": conditional writes); real GCS keeps orbax's default.
      handlers = {"state": ocp.StandardCheckpointHandler(use_ocdbt=False),
                  "meta": ocp.JsonCheckpointHandler()}
    self.async_save = bool(async_save)
    # orbax writes asynchronously either way; the synchronous mode waits for it inside save().
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=None if handlers else ("state", "meta"), item_handlers=handlers)
    self._thread: threading.Thread | None = None
    self._error: CheckpointError | None = None
    self.saving_step: int | None = None      # the step being written in the background, if any
    self.timings: list[dict] = []            # per save: blocking and background seconds

  def _failed(self, step: int, good: list[int], e: BaseException) -> CheckpointError:
    last = good[-1] if good else None
    return CheckpointError(
        f"cannot write checkpoint {step} to {self.directory}: {type(e).__name__}: {e}. "
        f"The last good checkpoint is {last if last is not None else 'none'} (left intact); "
        f"free disk space / fix permissions and rerun the same command to resume from it.")

  def _finish(self, step: int, good: list[int], on_done, t0: float, blocking_s: float) -> None:
    """Waits for orbax to commit `step`, writes its manifest, then calls `on_done(step)`."""
    if self.async_save and os.name == "posix":
      try:   # Linux: this thread only (hashing for the manifest) yields the CPU to the train step
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
      except OSError:
        pass
    try:
      self.manager.wait_until_finished()
      if jax.process_index() == 0:        # multi-host: orbax saved collectively; one manifest
        write_manifest(storage.join(self.directory, str(step)), step)
    except Exception as e:  # noqa: BLE001 - orbax wraps OSError in several exception types
      err = self._failed(step, good, e)
      err.__cause__ = e
      if not self.async_save:
        raise err from e
      self._error = err
      log.error("%s", err)
      return
    finally:
      self.saving_step = None
    self.timings.append(dict(step=int(step), blocking_s=blocking_s,
                             total_s=time.time() - t0))
    if on_done is not None:
      on_done(step)

  def save(self, step: int, state, meta: dict, on_done=None) -> None:
    """Writes checkpoint `step` and its manifest, then calls `on_done(step)`. Synchronous: returns
    when all that is done. Asynchronous: returns once orbax holds a copy of `state`; the rest runs
    on a background thread (module docstring). Raises CheckpointError (naming the last good step,
    which stays intact) if this save, or the previous asynchronous one, failed."""
    # saved_at first: the caller's ledger snapshot is of now, and a resume books the wall time
    # since saved_at; waiting for the previous save below must not fall outside both.
    meta = json.loads(json.dumps({**meta, "saved_at_unix_s": time.time(), "step": int(step)}))
    self.wait()
    good = self.all_steps()
    t0 = time.time()
    try:
      self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # noqa: BLE001
      raise self._failed(step, good, e) from e
    blocking = time.time() - t0
    self.saving_step = int(step)
    if not self.async_save:
      self._finish(step, good, on_done, t0, blocking)
      return
    self._thread = threading.Thread(target=self._finish, args=(step, good, on_done, t0, blocking),
                                    name=f"checkpoint-{step}", daemon=True)
    self._thread.start()

  def check(self) -> None:
    """Raises the CheckpointError of a failed background save (once)."""
    if self._error is not None:
      err, self._error = self._error, None
      raise err

  def wait(self) -> None:
    """Waits for the save in flight (manifest included); raises if it failed."""
    if self._thread is not None:
      self._thread.join()
      self._thread = None
    self.check()

  def all_steps(self) -> list[int]:
    """Steps that have a manifest (finished saves), oldest first."""
    return finished_steps(storage.dirname(self.directory))

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def restore(self, abstract_state, step: int | None = None) -> tuple[Any, Any]:
    """(state, meta) of `step` (default: the newest). `abstract_state` gives shapes/shardings."""
    step = self.manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out["state"], out["meta"]

  def close(self) -> None:
    """Waits for the save in flight (raising if it failed) and closes orbax's manager."""
    try:
      self.wait()
    finally:
      self.manager.wait_until_finished()
      self.manager.close()
