"""A pod's start-up self-test: before it takes work, check what its role needs, and stop with ONE
line naming what is missing.

    python -m scalerl_jax.selftest --role=generator|learner|buffer --run_config=PATH \
        [--workdir=DIR] [--backend=vllm] [--budget_s=120] [--config.KEY=VALUE ...]

Checks (each only where the role and the run config need it):

| check | what | roles |
|---|---|---|
| sandbox | the code sandbox starts (`rewards.check_sandbox`: bwrap, the interpreter with its stdlib and libpython, seccomp), runs a hello program, and refuses a program that writes outside its /tmp | generator, learner: a task with a sandboxed reward |
| grader | a grading worker answers a math grade within `rewards.grade_timeout_s` (rewards/isolation.py) | generator, learner: a task with an isolated reward (math) |
| vllm | the vLLM venv imports vllm and sees its devices (`.venv-vllm/bin/python`) | generator with `--backend=vllm` (or generator.backend) |
| storage | the workdir (local or gs://) takes a write, a read back and a delete | all |
| checkpoint | `model.hf_checkpoint` (when set) has a readable config.json and safetensors headers | generator, learner |

The whole test has a time budget (`--budget_s`, default 120 s; the grader's and the sandbox's
start-up dominate: ~2-5 s on a 2-core machine); past it the test fails naming the check it was in.
Exit 0 with one `selftest ok ...` line, else exit 3 with one `selftest FAILED ...` line (stderr).
The rendered manifests run it before every pod's command (launch/gke/render.py).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid

from scalerl_jax import config as run_config
from scalerl_jax import rewards, storage
from scalerl_jax.data import REWARD_FOR_KIND
from scalerl_jax.data.mixture import parse_mixture
from scalerl_jax.generation import backends
from scalerl_jax.generation.vllm.generator import vllm_python
from scalerl_jax.rewards import isolation, registry

EXIT_FAILED = 3
_REFUSED = "open('/escaped', 'w').write('x')\nprint('wrote outside /tmp')"


class Missing(RuntimeError):
  """One check failed: the message is what is missing."""


def _reward_names(config) -> list[str]:
  """The rewards the run's tasks grade with."""
  d = config.data
  tasks = [d.tasks[n] for n, _ in parse_mixture(d)] if parse_mixture(d) else [d]
  return [t.reward or REWARD_FOR_KIND.get(t.kind, "") for t in tasks]


def check_sandbox(config) -> str:
  """The sandbox starts, runs hello, refuses an escape."""
  try:
    rewards.prepare_code_rewards(config)
  except rewards.SandboxUnavailable as e:
    raise Missing(str(e).split("; code rewards run")[0]) from None
  r = rewards.sandbox.run_program("print('hello')")
  if r.status != "ok" or r.stdout.strip() != b"hello":
    raise Missing(f"the sandbox did not run a hello program ({r.status}: {r.detail[:120]})")
  r = rewards.sandbox.run_program(_REFUSED)
  if r.status == "ok":
    raise Missing("the sandbox let a program write outside its /tmp")
  return "hello ran, escape refused"


def check_grader(config) -> str:
  """A grading worker grades a math answer within the deadline."""
  isolation.configure(config.rewards)
  t = time.monotonic()
  try:
    isolation.pool().wait_ready()
    g = isolation.grade("math", "</think>\\boxed{\\frac{1}{2}}", "0.5")
  except RuntimeError as e:
    raise Missing(f"grading worker: {e}") from None
  finally:
    isolation.shutdown()
  if g.reason != "pass":
    raise Missing(f"the grader gave {g.reason} to a right answer ({g.detail[:120]})")
  return f"graded in {time.monotonic() - t:.1f} s (deadline {config.rewards.grade_timeout_s:g} s)"


def check_vllm(config, python: str) -> str:
  """The vLLM venv imports vllm and sees devices."""
  if not os.path.isfile(python):
    raise Missing(f"vLLM interpreter {python} not found (the vllm image builds .venv-vllm)")
  code = "import vllm, torch; print(vllm.__version__, torch.cuda.device_count())"
  try:
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=300)
  except subprocess.TimeoutExpired:
    raise Missing("vLLM did not import within 300 s") from None
  if r.returncode != 0:
    raise Missing(f"vLLM does not import: {(r.stderr.strip().splitlines() or ['?'])[-1][:160]}")
  version, devices = r.stdout.split()[-2:]
  if int(devices) < max(1, int(config.generator.tensor_parallel)):
    raise Missing(f"vLLM {version} sees {devices} GPU(s), needs {config.generator.tensor_parallel}")
  return f"vllm {version}, {devices} GPU(s)"


def check_storage(workdir: str) -> str:
  """The workdir takes a write, a read back and a delete."""
  p = storage.join(workdir, f".selftest-{uuid.uuid4().hex[:8]}")
  try:
    storage.makedirs(workdir)
    storage.write_text(p, "ok")
    if storage.read_text(p) != "ok":
      raise OSError("read back differs")
    storage.remove(p)
  except (OSError, ValueError) as e:
    raise Missing(f"workdir {workdir} is not writable: {type(e).__name__}: {e}") from None
  return f"{workdir} writable"


def check_checkpoint(path: str) -> str:
  """config.json and every safetensors header of `path` are readable."""
  try:
    cfg = json.loads(storage.read_text(storage.join(path, "config.json")))
    names = [n for n in storage.listdir(path) if n.endswith(".safetensors")]
    if not names:
      raise OSError("no *.safetensors")
    for n in names:
      with storage.open(storage.join(path, n), "rb") as f:
        head = int.from_bytes(f.read(8), "little")
        json.loads(f.read(head))
  except (OSError, ValueError) as e:
    raise Missing(f"checkpoint {path} is not readable: {type(e).__name__}: {e}") from None
  return f"{path}: {cfg.get('model_type', '?')}, {len(names)} shard(s)"


def plan(role: str, config, workdir: str, backend: str) -> list[tuple[str, object]]:
  """The (name, thunk) checks of `role` under `config`."""
  names = _reward_names(config)
  out: list[tuple[str, object]] = [("storage", lambda: check_storage(workdir))]
  if role in ("generator", "learner"):
    if any(registry.is_sandboxed(n) for n in names):
      out.append(("sandbox", lambda: check_sandbox(config)))
    if any(registry.isolation_of(n)[0] for n in names):
      out.append(("grader", lambda: check_grader(config)))
    if config.model.hf_checkpoint:
      out.append(("checkpoint", lambda: check_checkpoint(config.model.hf_checkpoint)))
  if role == "generator":   # the backend's own engine check (its registry entry names it)
    entry = backends.get(backend or config.generator.backend)
    if entry.selftest:
      module, _, fn = entry.selftest.partition(":")
      check = getattr(importlib.import_module(module), fn)
      out.append((entry.name, lambda: check(config)))
  return out


def check_vllm_backend(config) -> str:
  """The vLLM backend's self-test (its registry entry names it): check_vllm with the vLLM venv."""
  return check_vllm(config, str(vllm_python()))


def run(role: str, config, workdir: str, backend: str = "", budget_s: float = 120.0) -> str:
  """Runs the checks; returns the ok line, raises Missing with the failure line."""
  current = ["start"]
  done = threading.Event()

  def watchdog():
    if not done.wait(budget_s):
      print(f"selftest FAILED ({role}): {current[0]}: over the self-test's budget of "
            f"{budget_s:g} s", file=sys.stderr, flush=True)
      os._exit(EXIT_FAILED)
  threading.Thread(target=watchdog, daemon=True).start()
  t0, parts = time.monotonic(), []
  try:
    for name, fn in plan(role, config, workdir, backend):
      current[0] = name
      t = time.monotonic()
      try:
        what = fn()   # type: ignore[operator]
      except Missing as e:
        raise Missing(f"selftest FAILED ({role}): {name}: {e}") from None
      parts.append(f"{name} ({what}; {time.monotonic() - t:.1f} s)")
  finally:
    done.set()
  return f"selftest ok ({role}, {time.monotonic() - t0:.1f} s of {budget_s:g}): " + ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
  """The self-test's flags (besides `--config.KEY=VALUE` overrides)."""
  ap = argparse.ArgumentParser(description="a pod's start-up self-test (scalerl_jax/selftest.py)")
  ap.add_argument("--role", required=True, choices=("generator", "learner", "buffer"))
  ap.add_argument("--run_config", required=True, help="the run's config (a .py config or config.json)")
  ap.add_argument("--workdir", default="", help="default: the run config's directory")
  ap.add_argument("--backend", default="", help="generator backend (default generator.backend)")
  ap.add_argument("--budget_s", type=float, default=120.0)
  return ap


def main(argv=None) -> None:
  ap = build_parser()
  rest, overrides = run_config.split_overrides(sys.argv[1:] if argv is None else argv)
  a = ap.parse_args(rest)
  try:
    config = run_config.resolve_config(a.run_config, overrides)
    line = run(a.role, config, a.workdir or os.path.dirname(os.path.abspath(a.run_config)),
               a.backend, a.budget_s)
  except Missing as e:
    print(str(e).replace("\n", " "), file=sys.stderr, flush=True)
    sys.exit(EXIT_FAILED)
  except Exception as e:   # noqa: BLE001  (a broken config or install: still one line)
    print(f"selftest FAILED ({a.role}): {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
          file=sys.stderr, flush=True)
    sys.exit(EXIT_FAILED)
  print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
  main()
