"""A TensorBoard writer thread that died (ENOSPC on its flush) must stop the run with an error, not
hang it: tensorboardX's add_scalar blocks forever on its bounded queue once the thread is gone
(found by the chaos harness's disk_full fault, docs/RELIABILITY.md "Chaos runs")."""
import pytest

from scalerl_jax.training.tracking import MetricsLog


def test_dead_tensorboard_writer_raises_instead_of_hanging(tmp_path):
  ml = MetricsLog(str(tmp_path))
  ml.write({"step": 1, "kind": "train", "loss": 0.5})
  worker = getattr(ml.tb.file_writer.event_writer, "_worker")  # noqa: B009 (a private attribute of tensorboardX, read on purpose)
  worker.stop()                       # what an exception in its flush does: the thread ends
  worker.join(10)
  assert not worker.is_alive()
  with pytest.raises(OSError, match="TensorBoard event writer .* died"):
    for s in range(2, 50):            # before the fix: blocks forever once the queue is full
      ml.write({"step": s, "kind": "train", "loss": 0.5})
