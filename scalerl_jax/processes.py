"""Child processes of a run (buffer server, generator workers): start, watch, stop — no orphans.

Every child is started in its own process group with PR_SET_PDEATHSIG=SIGTERM, so it dies with
the main process even on SIGKILL; `ProcessGroup.close()` sends SIGTERM, waits, then SIGKILLs.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time

_PR_SET_PDEATHSIG = 1


def _die_with_parent():
  try:
    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
  except OSError:   # pragma: no cover - non-glibc platforms
    pass
  os.setpgrp()


class ProcessGroup:
  """The run's children, each with a log file under WORKDIR/logs/."""

  def __init__(self, workdir: str):
    self.logdir = os.path.join(workdir, "logs")
    os.makedirs(self.logdir, exist_ok=True)
    self.procs: dict[str, subprocess.Popen] = {}

  def start(self, name: str, argv: list[str], env: dict | None = None) -> subprocess.Popen:
    log = open(os.path.join(self.logdir, f"{name}.log"), "ab")
    p = subprocess.Popen(argv, stdout=subprocess.PIPE if name == "buffer" else log, stderr=log,
                         env={**os.environ, **(env or {})}, preexec_fn=_die_with_parent)
    self.procs[name] = p
    return p

  def start_buffer(self, prompts_path: str, config, timeout_s: float = 60.0) -> str:
    """Starts the gRPC buffer server process; returns its address once it listens."""
    r = config.rollout
    host, _, port = config.buffer.address.rpartition(":")
    argv = [sys.executable, "-m", "scalerl_jax.rollout.buffer_server", "--host", host or "127.0.0.1",
            "--port", port or "0", "--token-env", config.buffer.auth_token_env,
            "--prompts", prompts_path, "--prompts-per-step", str(r.prompts_per_step),
            "--group-size", str(r.generations_per_prompt), "--max-lag", str(r.max_lag),
            "--mode", r.mode, "--max-message-bytes", str(config.buffer.max_message_bytes),
            "--shuffle-seed", str(config.seed)]
    if config.rl.no_positive_resampling:
      argv += ["--npr-threshold", str(config.rl.npr_threshold)]
    p = self.start("buffer", argv)
    deadline = time.time() + timeout_s
    line = p.stdout.readline()
    if not line or time.time() > deadline:
      raise RuntimeError(f"buffer server did not start; see {self.logdir}/buffer.log")
    return json.loads(line)["address"]

  def start_workers(self, n: int, run_config: str, address: str, backend: str) -> None:
    for i in range(n):
      self.start(f"gen-{i}", [sys.executable, "-m", "scalerl_jax.rollout.worker",
                              "--run_config", run_config, "--buffer", address,
                              "--generator_id", f"gen-{i}", "--backend", backend])

  def check(self) -> None:
    """Raises if a child died (its exit code and log path in the message)."""
    for name, p in self.procs.items():
      if p.poll() is not None:
        raise RuntimeError(f"{name} exited with code {p.returncode}; see "
                           f"{self.logdir}/{name}.log")

  def close(self, grace_s: float = 10.0) -> None:
    for p in self.procs.values():
      if p.poll() is None:
        try:
          os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
          pass
    deadline = time.time() + grace_s
    for p in self.procs.values():
      try:
        p.wait(max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        try:
          os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
        p.wait()
