"""`popen`: subprocess.Popen from a thread that lives as long as this process (no project imports).

PR_SET_PDEATHSIG fires when the *thread* that forked a child exits, so a child started from a
short-lived thread (a supervisor restart, a grading thread replacing a killed grading worker)
would otherwise be signalled as soon as that thread ends. Used by scalerl_jax/processes.py (run
children) and scalerl_jax/rewards/isolation.py (grading workers).
"""
from __future__ import annotations

import concurrent.futures
import subprocess
import threading

_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def popen(*args, **kw) -> subprocess.Popen:
  """subprocess.Popen(*args, **kw), run on the main thread or on one long-lived spawner thread."""
  global _spawner
  if threading.current_thread() is threading.main_thread():
    return subprocess.Popen(*args, **kw)
  with _spawner_lock:
    if _spawner is None:
      _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="spawner")
  return _spawner.submit(subprocess.Popen, *args, **kw).result()
