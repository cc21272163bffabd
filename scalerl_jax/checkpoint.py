"""Run checkpoints through orbax: the learner state plus a JSON sidecar of host-side run state.

Layout: WORKDIR/checkpoints/<step>/{state, meta}. `state` is the LearnerState pytree (params,
optimizer state, step); `meta` is JSON (compute ledger, No-Positive-Resampling history, data and
buffer positions, wall-clock time of the save). Orbax writes each step atomically (temporary
directory + rename) and keeps the newest `keep`.
"""
from __future__ import annotations

import logging
import os
import time

import jax
import orbax.checkpoint as ocp

log = logging.getLogger("scalerl.checkpoint")


class RunCheckpointer:
  """Saves and restores (LearnerState, meta) pairs under WORKDIR/checkpoints."""

  def __init__(self, workdir: str, keep: int = 3):
    self.directory = os.path.join(os.path.abspath(workdir), "checkpoints")
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        item_names=("state", "meta"))

  def save(self, step: int, state, meta: dict, wait: bool = False) -> None:
    """Writes checkpoint `step` (asynchronously unless `wait`)."""
    meta = {**meta, "saved_at_unix_s": time.time(), "step": int(step)}
    self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))
    if wait:
      self.manager.wait_until_finished()

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
    self.manager.wait_until_finished()
    self.manager.close()
