"""Disk faults on the learner side (issue #8): a checkpoint write that fails (file size limit =
what a full disk does to a write) raises a clear error naming the last good checkpoint, which stays
valid and restorable; an unwritable workdir is refused up front with a clear message."""
import os
import resource
import signal

import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax.training import checkpoint
from scalerl_jax.training.checkpoint import CheckpointError, RunCheckpointer


class _FileSizeLimit:
  """RLIMIT_FSIZE for this process: writes past `nbytes` fail with EFBIG, like ENOSPC would."""

  def __init__(self, nbytes):
    self.nbytes = nbytes

  def __enter__(self):
    self.old = resource.getrlimit(resource.RLIMIT_FSIZE)
    self.sig = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (self.nbytes, self.old[1]))

  def __exit__(self, *exc):
    resource.setrlimit(resource.RLIMIT_FSIZE, self.old)
    signal.signal(signal.SIGXFSZ, self.sig)


def _state(x):
  w = np.random.default_rng(int(x)).standard_normal((256, 256)).astype(np.float32)
  return {"w": jnp.asarray(w), "step": jnp.int32(x)}


def test_failed_checkpoint_write_is_a_clear_error_and_keeps_the_last_good_one(tmp_path):
  wd = str(tmp_path)
  ck = RunCheckpointer(wd, keep=3)
  ck.save(1, _state(1.0), {"npr": {}, "ledger": {}})
  with _FileSizeLimit(4096):                  # the 256 KiB array cannot be written
    with pytest.raises(CheckpointError) as e:
      ck.save(2, _state(2.0), {"npr": {}, "ledger": {}})
  msg = str(e.value)
  assert "cannot write checkpoint 2" in msg and "last good checkpoint is 1 (left intact)" in msg
  assert "File too large" in msg or "Errno 27" in msg or "EFBIG" in msg or "too large" in msg, msg
  print("\n[disk-full]", msg[:300])
  found = checkpoint.find_valid(wd)
  assert found is not None and found[0] == 1      # step 2 never got a manifest
  ck2 = RunCheckpointer(wd, keep=3)
  state, meta = ck2.restore(_state(0.0), 1)
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(1.0)["w"]))
  assert meta["step"] == 1
  ck2.save(2, _state(2.0), {"npr": {}, "ledger": {}})   # space is back: the same step saves fine
  assert checkpoint.find_valid(wd)[0] == 2


def test_unwritable_workdir_is_refused_with_a_clear_message(tmp_path):
  from scalerl_jax.recipes import ConfigError, check_workdir
  with _FileSizeLimit(0):
    with pytest.raises(ConfigError, match=r"workdir .* is not writable: File too large"):
      check_workdir(str(tmp_path / "wd"))
  blocker = tmp_path / "file"
  blocker.write_text("x")
  with pytest.raises(ConfigError, match=r"is not writable"):
    check_workdir(str(blocker / "wd"))        # a path under a regular file
  check_workdir(str(tmp_path / "ok"))
  assert os.listdir(tmp_path / "ok") == []    # the probe is gone
