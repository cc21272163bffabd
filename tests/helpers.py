"""Shared test helpers: child processes whose output goes to files, XLA flags for test scripts,
tiny streamed weight versions (`tiny_params`, `publish_params`, `weight_serving`), the float32 tiny Llama-4 the vLLM
tests serve (`tiny_llama4_cfg`, `tiny_llama4_params`), and (re-exported from
`harness.procs`) process trees, free ports and `wait_until`.

Why files: a child whose stdout/stderr is a pipe that nobody reads blocks once it has written
64 KiB. Tests that started several processes with `stdout=PIPE, stderr=PIPE` and then waited for
them one by one (`p.communicate()` in a loop), or ran other work first, left the others' pipes
unread: in the suite a JAX process blocked on its log writes while its partner waited for it at
jax.distributed's shutdown barrier, which timed out after 300 s (`test_two_processes_equal_one`,
a fresh-clone run). Output written to files never blocks, and every process is waited for
against one deadline.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import threading
import time
from typing import Any

import numpy as np

# The process, port and polling helpers are the harness's (one copy for tests, benches, chaos).
from harness.procs import (alive, argv, children, cmdline, cpu_seconds, descendants,  # noqa: F401
                           buffer_knobs, free_port, proc_stat, proc_state, wait_until)
from scalerl_jax import xla_env


TEST_OPT_FLAG = "--xla_backend_optimization_level"


def with_test_compile_flags(flags: str | None) -> str:
  """An XLA_FLAGS value plus the compile-bound tests' `--xla_backend_optimization_level=0`
  (LLVM's optimizer off; conftest.py says why), unless it already names a level."""
  kept = (flags or "").split()
  if any(f.startswith(TEST_OPT_FLAG) for f in kept):
    return " ".join(kept)
  return " ".join(kept + [f"{TEST_OPT_FLAG}=0"])


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a compile-bound JAX script a test starts: the inherited flags (a user's
  `--xla_cpu_max_isa=...`), the tests' compile level, and the simulated device count set to
  `devices` (None: removed)."""
  return xla_env.with_device_count(with_test_compile_flags(os.environ.get("XLA_FLAGS")), devices)


@dataclasses.dataclass
class Logged:
  """A child process whose stdout and stderr go to `<log>.out` / `<log>.err`."""
  proc: subprocess.Popen
  log: str

  def output(self) -> tuple[str, str]:
    """(stdout, stderr) written so far."""
    read = lambda p: open(p, errors="replace").read() if os.path.exists(p) else ""
    return read(self.log + ".out"), read(self.log + ".err")


def start(cmd: list[str], log: str, **popen_kwargs) -> Logged:
  """Starts `cmd` with stdout/stderr to files `log`.out / `log`.err (never a pipe)."""
  os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
  with open(log + ".out", "w") as out, open(log + ".err", "w") as err:
    proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True, **popen_kwargs)
  return Logged(proc, log)


def finish(logged: list[Logged], timeout: float) -> list[tuple[int | None, str, str]]:
  """Waits for every child against one deadline; returns [(returncode, stdout, stderr)]. A child
  still running at the deadline is killed (its returncode is then None in the result)."""
  deadline = time.time() + timeout
  results = []
  try:
    for c in logged:
      try:
        rc = c.proc.wait(timeout=max(0.1, deadline - time.time()))
      except subprocess.TimeoutExpired:
        rc = None
      results.append((rc, *c.output()))
  finally:
    for c in logged:
      if c.proc.poll() is None:
        c.proc.kill()
        c.proc.wait()
  return results


def tiny_params(tag: int = 0) -> dict[str, np.ndarray]:
  """A stand-in model of two small host arrays for buffer tests. Its manifest (what a re-publish of
  the same version is compared by) depends on `tag`: another tag is another version's content."""
  rng = np.random.default_rng(tag)
  return {"w": rng.standard_normal((4, 8 + tag)).astype(np.float32),
          "b": np.full((3,), tag, np.int32)}


@contextlib.contextmanager
def weight_serving(token: str, keep: int):
  """(BufferClient, learner WeightSource) on loopback, with a buffer that announces versions;
  stopped on exit (the weight tests' setup)."""
  from scalerl_jax.buffer.server import BufferServer  # local: only the weight tests serve
  from scalerl_jax.protocol.client import BufferClient  # local: as above
  from scalerl_jax.types import PromptSpec  # local: as above
  from scalerl_jax.weights.source import WeightSource  # local: as above
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=token,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, token)
  src = WeightSource(token, keep=keep)
  try:
    yield c, src
  finally:
    src.stop()
    c.close()
    srv.stop()


def publish_params(client, version: int, params: Any = None, tag: int = 0, retries: int = 5,
                   **kw) -> Any:
  """Publishes `params` (default `tiny_params(tag)`) as streamed weight version `version`
  (weights.stream.StreamPublisher as process 0; `kw` go to it; `retries`: its publish's resumes
  after a broken stream, 0 = the first error is raised); returns the PublishAck."""
  from scalerl_jax.weights.stream import StreamPublisher    # imports JAX: only when publishing
  return StreamPublisher(client, version, tiny_params(tag) if params is None else params,
                         process_index=0, **kw).publish(retries=retries)


VLLM_CHUNK = 128     # vLLM: the attention chunk must be a multiple of its KV block size (128)


def tiny_llama4_cfg():
  """The tiny Llama-4 MoE the vLLM tests serve, in float32: 4 layers, MoE on layers 1 and 3
  (interleave 2), NoPE + attention-temperature tuning on layer 3, attention chunk `VLLM_CHUNK`."""
  from scalerl_jax import models              # imports JAX: only the vLLM tests need it
  return models.get_preset("tiny_llama4", attention_chunk_size=VLLM_CHUNK, dtype="float32",
                           param_dtype="float32")


def tiny_llama4_params(cfg, seed: int) -> dict:
  """Host (numpy) parameters of `cfg` from `seed`, with an lm_head of std 0.15: a peaked
  next-token distribution, so log-prob errors and greedy choices matter (init 0.02 is
  near-uniform)."""
  import jax
  from scalerl_jax import models
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(seed)))
  rng = np.random.default_rng(seed)
  params["lm_head"] = rng.normal(0, 0.15, params["lm_head"].shape).astype(np.float32)
  return params


def forcing_weights(named: dict, forced: int, head_value: float = 100.0) -> dict:
  """HF-named weights (`dict(models.hf_named_arrays(cfg, params))`) changed so that every
  next-token distribution puts ~all mass on `forced`.

  Zero attention/MLP output projections make the residual stream equal the token embedding; with
  every embedding the all-ones vector the final hidden state is constant, so a head column aligned
  with it makes `forced` win by a margin of ~`head_value` * d_model nats regardless of context.
  """
  named = dict(named)
  for name in named:
    if name.endswith(("o_proj.weight", "down_proj.weight")):
      named[name] = np.zeros_like(named[name])
  named["model.embed_tokens.weight"] = np.ones_like(named["model.embed_tokens.weight"])
  head = np.zeros_like(named["lm_head.weight"])
  head[forced] = head_value
  named["lm_head.weight"] = head
  return named


def drive_continuous(worker, client, server, steps: int, groups: int, group_size: int,
                     publish, on_batch, timeout_s: float) -> None:
  """Run `worker.run_continuous` on a thread while the test plays the learner: for each step,
  pull a batch (`groups` groups of `group_size`), hand it to `on_batch(step, batch)`, then
  `publish(step + 1)` the next weight version. Stops and closes worker, client and `server`,
  and asserts the worker's thread ended."""
  th = threading.Thread(target=worker.run_continuous, daemon=True)
  th.start()
  try:
    for step in range(steps):
      batch = client.pull_batch(step, timeout_s=timeout_s)
      assert len(batch.groups) == groups, len(batch.groups)
      assert all(len(g.rollouts) == group_size for g in batch.groups)
      on_batch(step, batch)
      publish(step + 1)
  finally:
    worker.stop()
    th.join(60)
    worker.close()
    client.close()
    server.stop()
  assert not th.is_alive()
