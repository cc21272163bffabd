"""Process of tests/faults/test_fault_buffer.py (run as `python tests/wal_procs.py full_disk WAL_DIR`).

full_disk WAL_DIR: a WAL whose disk fills up mid-commit, made real with RLIMIT_FSIZE (the kernel
  writes what fits, then fails the write with EFBIG, as a full disk does with ENOSPC): commits
  records A and B, then a large record C past the limit (must raise), then, with the limit lifted,
  record D. Prints JSON: the segment's size before and after the failed commit, the error, and the
  segment's path. A process of its own: the file-size limit is per process.
"""
import json
import os
import resource
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def full_disk(wal_dir: str) -> dict:
  from scalerl_jax.buffer import wal
  w = wal.WAL(wal_dir)
  w.start_snapshot(iter([wal.encode(wal.SNAPSHOT, dict(ns=0))]))
  for body in (b"A" * 100, b"B" * 100):
    w.append(wal.ROLLOUT, body)
    w.commit()
  seg = wal.segments(wal_dir)[-1][1]
  before = os.path.getsize(seg)
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)      # EFBIG instead of the signal's core dump
  soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
  resource.setrlimit(resource.RLIMIT_FSIZE, (before + 3000, hard))
  w.append(wal.ROLLOUT, b"C" * 10000)
  w.append(wal.DELIVER, dict(step=0, gids=[1]))
  err = None
  try:
    w.commit()
  except OSError as e:
    err = str(e)
  after_fail = os.path.getsize(seg)
  resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
  w.append(wal.ROLLOUT, b"D" * 100)
  w.commit()
  w.close()
  return dict(before=before, after_fail=after_fail, error=err, segment=seg)


if __name__ == "__main__":
  role, arg = sys.argv[1], sys.argv[2]
  print(json.dumps({"full_disk": full_disk}[role](arg)))
