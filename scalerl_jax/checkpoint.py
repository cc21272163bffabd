"""Run checkpoints through orbax: the learner state plus a JSON sidecar of host-side run state.

Layout: WORKDIR/checkpoints/<step>/{state, meta, manifest.json}; WORKDIR may be gs:// (orbax and
tensorstore write there natively; the manifest goes through scalerl_jax/storage.py). `state` is the LearnerState pytree
(params, optimizer state, step); `meta` is JSON (compute ledger, No-Positive-Resampling history,
consumption offsets, RNG seeds, wall-clock time of the save; see `Trainer.save`). Orbax writes each
step atomically (temporary directory + rename) and keeps the newest `keep`.

`manifest.json` is written after orbax finalized the step: the size and sha256 of every file of the
step. A step without a manifest (crash between orbax's rename and the manifest) or whose files do
not match it (corruption) is not valid: `find_valid` moves it to WORKDIR/checkpoints_invalid/ and
falls back to the previous one with a WARNING naming the step and the reason.

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

import hashlib
import json
import logging
import os
import threading
import time

import jax
import orbax.checkpoint as ocp

from scalerl_jax import storage

log = logging.getLogger("scalerl.checkpoint")
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
  """A checkpoint could not be written (the message names the last good checkpoint)."""


def _hash_file(path: str) -> str:
  h = hashlib.sha256()
  with storage.open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 22), b""):
      h.update(block)
  return h.hexdigest()


def _files(step_dir: str) -> list[str]:
  return [rel for rel in storage.walk_files(step_dir) if rel != MANIFEST]


def write_manifest(step_dir: str, step: int) -> dict:
  """Writes `step_dir/manifest.json` (size + sha256 per file), atomically and fsynced."""
  files = {rel: dict(size=storage.getsize(storage.join(step_dir, rel)),
                     sha256=_hash_file(storage.join(step_dir, rel))) for rel in _files(step_dir)}
  man = dict(step=int(step), written_at_unix_s=time.time(), files=files)
  storage.write_text(storage.join(step_dir, MANIFEST), json.dumps(man))
  return man


def verify(step_dir: str) -> str | None:
  """None if the step's files match its manifest, else the reason it is not valid."""
  path = storage.join(step_dir, MANIFEST)
  if not storage.exists(path):
    return "no manifest.json (the save did not complete)"
  try:
    man = json.loads(storage.read_text(path))
  except (OSError, ValueError) as e:
    return f"unreadable manifest.json ({e})"
  present = set(_files(step_dir))
  for rel, want in man["files"].items():
    p = storage.join(step_dir, rel)
    if rel not in present:
      return f"{rel} is missing"
    if storage.getsize(p) != want["size"]:
      return f"{rel} has {storage.getsize(p)} bytes, manifest says {want['size']}"
    if _hash_file(p) != want["sha256"]:
      return f"{rel} sha256 mismatch"
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


def find_valid(workdir: str) -> tuple[int, dict, list[dict]] | None:
  """Newest valid checkpoint: (step, meta, skipped) where `skipped` lists the newer steps that were
  not valid ({"step", "reason", "moved_to"}); those are moved to WORKDIR/checkpoints_invalid/ so a
  resumed run can save those step numbers again. None when no step is valid."""
  skipped = []
  wd = storage.abspath(workdir)
  ck = storage.join(wd, "checkpoints")
  for n in storage.listdir(ck):
    if ".orbax-checkpoint-tmp" in n:           # a save interrupted by a crash or a full disk
      dest = storage.join(wd, "checkpoints_invalid", n)
      storage.move(storage.join(ck, n), dest)
      log.warning("unfinished checkpoint save %s moved to %s", n, dest)
  for step, path in reversed(step_dirs(workdir)):
    why = verify(path)
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

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = False):
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
    if self.async_save and hasattr(os, "setpriority"):
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

  def restore(self, abstract_state, step: int | None = None):
    """(state, meta) of `step` (default: the newest). `abstract_state` gives shapes/shardings."""
    step = self.manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self.directory}")
    target = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract_state)
    out = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()))
    return out.state, out.meta

  def close(self) -> None:
    """Waits for the save in flight (raising if it failed) and closes orbax's manager."""
    try:
      self.wait()
    finally:
      self.manager.wait_until_finished()
      self.manager.close()
