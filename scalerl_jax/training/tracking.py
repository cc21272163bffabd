"""Where a run's metrics go (docs/METRICS.md): the `Tracker` interface and its implementations.

`MetricsLog` writes WORKDIR/metrics.jsonl (the record every tool reads: analysis/, the forecast,
audits), TensorBoard event files and, with `config.wandb.project`, W&B (`wandb_sink.WandbSink`).
`NoTracker` is what the non-main processes of a multi-host learner hold. A new sink is a Tracker
(or one more sink inside MetricsLog.write); the trainer only calls the four methods below.
"""
from __future__ import annotations

import os
import threading

from analysis.metrics import append_metrics
from scalerl_jax import storage
from scalerl_jax.training.wandb_sink import WandbSink


class Tracker:
  """A metrics sink: `write` one record (a dict with `step` and `kind`), `log_images` at the end
  of a run, `close` (flush; the run may still log images), `finish`. Defaults do nothing."""

  lock = None       # a threading.Lock when other threads write too (the live forecast)

  def write(self, record: dict) -> None:
    """Logs one metrics record."""

  def log_images(self, images: dict, step: int) -> None:
    """Logs end-of-run plots {name: PNG path}."""

  def close(self) -> None:
    """Flushes and closes what the run's last records need no more."""

  def finish(self) -> None:
    """Ends the tracker's run (after the end-of-run plots)."""


class MetricsLog(Tracker):
  """metrics.jsonl (docs/METRICS.md) + TensorBoard event files (+ W&B with `wandb_cfg.project`).

  For a gs:// workdir the TensorBoard writer (tensorboardX appends to a local file) writes into
  LOCAL_DIR/tb, which is uploaded to WORKDIR/tb after every evaluation and at close."""

  def __init__(self, workdir: str, purge_step: int | None = None, wandb_cfg=None,
               run_config: dict | None = None, local_dir: str | None = None):
    self._append = append_metrics
    self.workdir = workdir
    self.lock = threading.Lock()   # the live forecast writes (and reads the file) from its thread
    self.tb_dir = storage.join(workdir, "tb")
    self.tb_local = (os.path.join(local_dir or storage.local_dir(workdir), "tb")
                     if storage.is_remote(workdir) else self.tb_dir)
    try:
      from tensorboardX import SummaryWriter  # local: it imports torch (~2 CPU-s)

      # purge_step: a resumed run hides the events the crashed run logged after its checkpoint.
      # max_queue: roomy, so the queue never fills before `_check_tb` sees a dead writer thread.
      self.tb = SummaryWriter(self.tb_local, purge_step=purge_step, max_queue=4096)
    except ImportError:   # pragma: no cover - tensorboardX is in requirements.txt
      self.tb = None
    self.wandb = None
    if wandb_cfg is not None and wandb_cfg.project:
      self.wandb = WandbSink(workdir, wandb_cfg, run_config, local_dir=local_dir)

  def _check_tb(self) -> None:
    """tensorboardX writes events on a thread; when that thread dies (a full disk: ENOSPC on its
    flush) every later add_scalar blocks forever on its bounded queue, and the run hangs. Found by
    the chaos harness (harness/chaos.py, disk_full): raise instead, so the run stops like on any other
    failed write and the same command resumes it once there is space."""
    fw = getattr(self.tb, "file_writer", None)
    worker = getattr(getattr(fw, "event_writer", None), "_worker", None)
    if worker is not None and not worker.is_alive():
      raise OSError(f"the TensorBoard event writer for {self.tb_local} died (disk full?); free "
                    f"space and rerun the same command to resume from the last checkpoint")

  def write(self, record: dict) -> None:
    with self.lock:
      self._append(self.workdir, record)
      if self.tb is not None:
        self._check_tb()
        for k, v in record.items():
          if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
            self.tb.add_scalar(k, v, record["step"])
        if record.get("kind") == "eval":
          self._upload_tb()
      if self.wandb is not None:
        self.wandb.log(record)

  def log_images(self, images: dict, step: int) -> None:
    """End-of-run plots (fit, forecast) to W&B."""
    if self.wandb is not None:
      with self.lock:
        self.wandb.log_images(images, step)

  def _upload_tb(self) -> None:
    if self.tb_local != self.tb_dir:   # gs://: the local event files, uploaded whole
      assert self.tb is not None        # both callers check it
      self.tb.flush()
      storage.copy_tree(self.tb_local, self.tb_dir)

  def close(self):
    """Closes TensorBoard; the W&B run stays open for the end-of-run plots (`finish`)."""
    if self.tb is not None:
      self.tb.close()
      self._upload_tb()

  def finish(self):
    if self.wandb is not None:
      self.wandb.finish()
      self.wandb = None


class NoTracker(Tracker):
  """The tracker of the non-main processes of a multi-host learner (process 0 logs)."""
