r"""Rehearses a rendered GKE variant on one machine: the manifests' own commands as local processes.

  python -m launch.rehearse launch/gke/rendered/8b-h100 --steps 6 \
      [--workdir DIR | --workdir gs://BUCKET/run] [--kill buffer|learner] [--kill-at-step N] \
      [--kill-before-checkpoint] [--generators 2] [--state-dir DIR]

Reads the YAML files `kubectl apply` would get (every *.yaml of the directory) and runs what they
describe the way Kubernetes would, with a tiny model:

* Pods: the learner JobSet's pods (`parallelism` of them, one process each, one `jax.distributed`
  job over gloo on CPU: the JobSet's own SCALERL_* env; a TPU slice's `distributed.auto=True`,
  with --real-shape only, becomes that env: coordinator = pod 0, count, completion index), the
  buffer Deployment's pod (its init container first) and `--generators` pods of the generator
  Deployment (its `replicas` capped).
* Each container's command runs as written with the container's env: `value`, downward-API
  `fieldRef`s (pod IP, name, the Job completion index), `secretKeyRef`s filled from the Secret
  manifests in the directory (a `REPLACE-ME` placeholder gets a generated test token / a test TLS
  certificate for the Services' DNS names; a Secret missing from the directory is an error), and
  `$HOSTNAME` = the pod name, as the kubelet sets it. `$(VAR)` in commands is expanded from that env.
* Volumes: a path under a container's `mountPath` is that volume's local directory (a PVC: one
  directory for the whole rehearsal, so the buffer's WAL survives its pod's restarts; `emptyDir`:
  per pod; a Secret volume: its files); any other absolute path is private to the pod
  (STATE_DIR/pods/POD/root/...). `/dev/shm` stays /dev/shm.
* Addresses, the one override mechanism: each pod gets its own loopback address (127.X.Y.N) and
  `$SCALERL_HOSTS` (scalerl_jax/hosts.py), read where the code binds and dials: every Service's
  DNS names (NAME, NAME.NS, NAME.NS.svc.cluster.local) and the JobSet pods' host names map to pod
  addresses, and `0.0.0.0` to the pod's own address (two learner pods both listen on 50052).
* The tiny model, the one swap mechanism: `TINY_OVERRIDES` appended as `--config.a.b=value` to every
  command that reads the run config (learner `scalerl_jax.main`, generator worker, prompt export:
  all three take config overrides), plus `--config.total_steps=STEPS` (learner) and `--backend=jax`
  (generators: no GPUs here). The buffer takes no config: the buffer flags
  `processes.buffer_flags(tiny config)` changes are appended (argparse: the last value wins).
* Restart policy: a Deployment pod's container (restartPolicy Always) is restarted whenever it
  exits (its init containers are not rerun, its emptyDirs and PVCs persist); a JobSet pod
  (restartPolicy Never, backoffLimit 0) that fails fails its Job, and the JobSet's failurePolicy
  recreates every learner pod, up to `maxRestarts` times. The rehearsal ends when the JobSet
  completes (every learner pod exited 0).

`--kill buffer` sends SIGKILL to the buffer pod's process once the learner logged step
`--kill-at-step` (default STEPS // 2), after copying its WAL (the acknowledged rollouts at that
instant); `--kill learner` kills learner pod 0 the same way, once step `--kill-at-step` is logged
AND a checkpoint has finished (its manifest.json exists: saves are asynchronous, so the newest
checkpoint may still be in flight at that step); the JobSet restarts all learner pods and the run
resumes from that checkpoint. With `--kill-before-checkpoint` the learner's first checkpoint is
moved to the last step (`checkpoint.every_steps` = max(STEPS, kill step + 1)), so the kill always
lands before any save: the restarted learners find none, start over, and the running buffer
rewinds to step 0. The last stdout line is a JSON summary
(also STATE_DIR/summary.json): pods, restarts, steps, weights served/fetched per pod, the buffer's
NPR records, the WAL, the kill check (buffer kill: acknowledged rollouts at the kill lost / trained
twice; learner kill: `tools/audit.py`'s ledger of every acknowledged rollout over the WAL archive
and the final timeline's trained ids: trained once, dropped with a reason, left in the buffer, or
lost), the fit.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from launch import preflight
from launch.rehearse_checks import (buffer_state, kill_check, learner_processes, logged_knobs,
                                    read_logs, weights_served)
from launch.rehearse_pods import (USAGE_ERROR, ContainerCommands, Pod, RehearsalError,
                                  component_of, fill_secrets, hosts_table, load_manifests,
                                  plan_pods)
from launch.rehearse_pods import TPU_AUTO_ARG as TPU_AUTO_ARG   # re-exported (the tests read it here)
from launch.spec import load_config
from scalerl_jax import config as run_config
from scalerl_jax import storage, topologies, xla_env
from scalerl_jax.buffer import wal as walmod
from scalerl_jax.processes import child_env, launcher_argv
from scalerl_jax.tools.audit import rollout_ledger
from scalerl_jax.training.checkpoint import finished_steps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The tiny-model swap: appended as --config.KEY=VALUE to the learner, generator and export commands.
TINY_OVERRIDES = (
    "model.preset=tiny_synthetic", "model.dtype=float32", "model.remat=none",
    "model.scan_layers=False", "model.hf_checkpoint=",
    "mesh.shape=(('data', 1), ('fsdp', -1), ('tensor', 1), ('expert', 1))",
    "optim.microbatches=1", "optim.lr=0.0001", "optim.warmup_steps=1",
    "rollout.prompts_per_step=4", "rollout.generations_per_prompt=4",
    "rollout.think_budget_min=24", "rollout.think_budget_max=32", "rollout.answer_budget=8",
    "rollout.max_prompt_len=32",
    "data.kind=synthetic", "data.heldout=32", "data.synthetic_n_train=2048",
    "sft.clean_steps=60", "sft.steps=0", "sft.lr=0.002", "sft.batch_size=32",
    "sft.num_examples=2048",
    "eval.every_steps=1", "eval.samples_per_prompt=8",
    "generator.backend=jax", "generator.tensor_parallel=1", "generator.decode_batch=16",
    "checkpoint.every_steps=2", "pin_cpus=False",
    # the audit trail the learner-kill check reads (scalerl_jax/tools/audit.py): the final
    # timeline's trained rollout ids, and every compacted WAL segment kept
    "audit.trained_ids=True", "audit.wal_archive=True",
)
# --real-shape: the rows and lengths a rehearsal step has (the learner's mesh, layout, processes,
# devices per process, model numerics and recipe stay the variant's; the model is the start
# checkpoint's, a miniature one: launch/miniature.py).
REAL_SHAPE_PROMPTS, REAL_SHAPE_GROUP = 4, 4


def real_shape_overrides(config, steps: int, shape: tuple[int, int], inputs: dict) -> list[str]:
  """The overrides of `--real-shape` for the variant's run config `config` on `shape` = (learner
  processes, devices each): only widths shrink. The batch is REAL_SHAPE_PROMPTS x
  REAL_SHAPE_GROUP rows and the micro-batches are reduced so that each keeps the variant's rows
  per micro-batch (8b-gb200: 768 rows / 192 = 4, so 16 rows / 4); sequence lengths shrink
  (prompt <= 64, think 24-32, answer 8 tokens); generators run the JAX backend on one CPU device
  (no vLLM here). Refuses (RehearsalError) a shape whose arithmetic does not fit
  (topologies.run_shape_failures: the job-start preflight)."""
  r = config.rollout
  rows_real = int(r.batch_size or r.prompts_per_step * r.generations_per_prompt)
  per_mb = max(1, rows_real // int(config.optim.microbatches))
  rows = REAL_SHAPE_PROMPTS * REAL_SHAPE_GROUP
  if rows % per_mb:
    raise RehearsalError(f"--real-shape: {rows} rows do not hold whole micro-batches of the "
                         f"variant's {per_mb} rows (optim.microbatches)")
  out = [f"rollout.prompts_per_step={REAL_SHAPE_PROMPTS}",
         f"rollout.generations_per_prompt={REAL_SHAPE_GROUP}", "rollout.batch_size=0",
         f"optim.microbatches={rows // per_mb}",
         "rollout.think_budget_min=24", "rollout.think_budget_max=32", "rollout.answer_budget=8",
         "rollout.max_prompt_len=64", "data.heldout=8",
         f"eval.every_steps={steps}", "eval.samples_per_prompt=2",
         "generator.backend=jax", "generator.tensor_parallel=1", "generator.decode_batch=16",
         "checkpoint.every_steps=2", "pin_cpus=False",
         "audit.trained_ids=True", "audit.wal_archive=True"]
  if "step0_reward_check" in config.health:   # random miniature weights earn no reward at step 0
    out.append("health.step0_reward_check=False")
  out += [f"{k}={v}" for k, v in inputs.items()]
  probe = config.copy_and_resolve_references()
  probe = run_config.resolve_config(probe, [f"--config.{o}" for o in out])
  hosts, chips = shape
  fails = topologies.run_shape_failures(probe, hosts, hosts * chips)
  if fails:
    raise RehearsalError(f"--real-shape: {fails[0]}")
  if not probe.model.get("hf_checkpoint"):
    raise RehearsalError("--real-shape needs a start checkpoint whose widths fit the layout "
                         "(model.hf_checkpoint is empty: --checkpoint=DIR, python -m "
                         "launch.miniature)")
  return out
# ---- the rehearsal -------------------------------------------------------------------------------
class Rehearsal(ContainerCommands):
  """One rehearsal of a rendered variant (the module docstring); how a container's command runs
  here is `ContainerCommands` (launch/rehearse_pods.py)."""

  def __init__(self, manifest_dir: str, *, steps: int, workdir: str, state_dir: str,
               generators: int = 2, kill: str = "", kill_at_step: int = 0, timeout_s: float = 1500,
               kill_before_checkpoint: bool = False, real_shape: bool = False,
               inputs: dict | None = None):
    self.dir, self.steps, self.state = manifest_dir, int(steps), os.path.abspath(state_dir)
    self.real_shape = bool(real_shape)
    # --checkpoint / --data / --tokenizer: {config key: value}, appended to every config reader
    self.inputs = {k: v for k, v in (inputs or {}).items() if v}
    self.kill, self.kill_at = kill, int(kill_at_step or max(1, steps // 2))
    self.kill_needs_checkpoint = kill == "learner" and not kill_before_checkpoint
    # Killed before any checkpoint, deterministically: the first one is due after the kill step
    # (at the last step), so no save can have finished when the kill lands.
    self.extra_learner = ([f"--config.checkpoint.every_steps={max(self.steps, self.kill_at + 1)}"]
                          if kill == "learner" and kill_before_checkpoint else [])
    self.timeout_s = float(timeout_s)
    self.docs = load_manifests(manifest_dir)
    self.secrets = fill_secrets(self.docs)
    subnet = f"127.{random.randint(100, 250)}.{random.randint(1, 250)}"
    self.pods, self.jobset = plan_pods(self.docs, generators, subnet, real_shape=self.real_shape)
    self.hosts = hosts_table(self.docs, self.pods, self.jobset)
    self._check_secret_refs()
    self.workdir_manifest = self._manifest_workdir()
    self.workdir = workdir or os.path.join(self.state, "workdir")
    self.events: list[dict] = []
    self.kill_report: dict = {}
    self.jobset_restarts = 0
    self.overrides: list[str] = []
    self.tiny = self._tiny_config()

  def set_state_dir(self, state_dir: str, workdir: str = "") -> None:
    self.state = os.path.abspath(state_dir)
    self.workdir = workdir or os.path.join(self.state, "workdir")
    os.makedirs(self.state, exist_ok=True)

  # -- checks at start-up (nothing started, nothing written) --
  def _check_secret_refs(self) -> None:
    for p in self.pods:
      for c in p.spec.get("initContainers", []) + p.spec.get("containers", []):
        for e in c.get("env", []):
          ref = (e.get("valueFrom") or {}).get("secretKeyRef")
          if ref is None:
            continue
          s = self.secrets.get(ref["name"])
          if s is None or ref["key"] not in s["data"]:
            raise RehearsalError(
                f"{p.owner}/{c['name']}: env {e['name']} needs Secret {ref['name']!r} key "
                f"{ref['key']!r}, which is not in {self.dir} (render it: python -m "
                f"launch.gke.render; on a cluster: kubectl create secret generic {ref['name']})")
      for v in p.spec.get("volumes", []):
        if "secret" in v and v["secret"]["secretName"] not in self.secrets:
          raise RehearsalError(f"{p.owner}: volume {v['name']} needs Secret "
                               f"{v['secret']['secretName']!r}, which is not in {self.dir}")

  def _learner_container(self) -> dict:
    p = next(p for p in self.pods if p.annotations)
    return p.spec["containers"][0]

  def _manifest_workdir(self) -> str:
    for a in self._learner_container()["command"]:
      if a.startswith("--workdir="):
        return a.split("=", 1)[1]
    raise RehearsalError("the learner command has no --workdir")

  def _tiny_config(self):
    sys.path.insert(0, REPO)
    p = next(p for p in self.pods if p.annotations)
    c = self._learner_container()
    file = next(a.split("=", 1)[1] for a in c["command"] if a.startswith("--config="))
    path, _, arg = file.partition(":")
    if path.startswith("/"):    # the run-config ConfigMap mounted in the learner pod
      vols = {v["name"]: v for v in p.spec.get("volumes", [])}
      mount = next((m for m in c.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")
                    and "configMap" in vols.get(m["name"], {})), None)
      if mount is None:
        raise RehearsalError(f"the learner reads {path}, which no mounted ConfigMap holds")
      data = self._configmap(vols[mount["name"]]["configMap"]["name"])
      key = path[len(mount["mountPath"].rstrip("/")) + 1:]
      if key not in data:
        raise RehearsalError(f"ConfigMap of {mount['mountPath']} has no {key!r}")
      with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "run_config.py"), "w") as f:
          f.write(data[key])
        config = load_config(os.path.join(tmp, "run_config.py"), arg or None)
    else:
      config = load_config(os.path.join(REPO, path), arg or None)
    if self.real_shape:
      self.overrides = real_shape_overrides(config, self.steps, self._learner_shape(),
                                            self.inputs)
    else:
      self.overrides = list(TINY_OVERRIDES) + [f"{k}={v}" for k, v in self.inputs.items()]
    overrides = [f"--config.{o}" for o in self.overrides]
    return run_config.resolve_config(config, overrides)

  # -- processes --
  def _log(self, p: Pod, c: dict):
    d = os.path.join(self.state, "pods", p.name)
    os.makedirs(d, exist_ok=True)
    f = open(os.path.join(d, f"{c['name']}.log"), "ab")
    f.write(f"\n==== rehearse: start {c['name']} (restart {p.restarts}) {time.ctime()}\n".encode())
    f.flush()
    return f

  def _base_env(self) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SCALERL_")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
               PYTHONUNBUFFERED="1")
    # inherited flags stay (e.g. --xla_cpu_max_isa); a caller's device count does not: each pod
    # gets its own (learner pods below)
    flags = xla_env.with_device_count(env.pop("XLA_FLAGS", None), None)
    if flags:
      env["XLA_FLAGS"] = flags
    return env

  def _spawn(self, p: Pod, c: dict) -> subprocess.Popen:
    argv, env = self.command(p, c)
    log = self._log(p, c)
    log.write(("argv: " + shlex.join(argv) + "\n").encode())
    log.flush()
    proc = subprocess.Popen(launcher_argv(argv), cwd=REPO, stdout=log, stderr=log,
                            env=child_env({**self._base_env(), **env}), start_new_session=True)
    log.close()
    return proc

  def _run_init(self, p: Pod) -> None:
    for c in p.spec.get("initContainers", []):
      proc = self._spawn(p, c)
      rc = proc.wait(timeout=600)
      if rc != 0:
        raise RuntimeError(f"{p.name}: init container {c['name']} exited {rc} "
                           f"(log: {self.state}/pods/{p.name}/{c['name']}.log)")

  def _start(self, p: Pod) -> None:
    if not p.started:
      self._run_init(p)
      p.started = True
    p.proc = self._spawn(p, p.spec["containers"][0])
    self.events.append({"t": round(time.time(), 2), "pod": p.name, "event": "start",
                        "restarts": p.restarts})

  def _wait_ready(self, p: Pod, timeout_s: float = 180) -> None:
    """The container's readinessProbe (tcpSocket on a named / numbered port)."""
    c = p.spec["containers"][0]
    probe = (c.get("readinessProbe") or {}).get("tcpSocket")
    if not probe:
      return
    port = probe["port"]
    if isinstance(port, str):
      port = next(x["containerPort"] for x in c.get("ports", []) if x.get("name") == port)
    end = time.time() + timeout_s
    while time.time() < end:
      if p.running.poll() is not None:
        raise RuntimeError(f"{p.name} exited {p.running.returncode} before it was ready "
                           f"(log: {self.state}/pods/{p.name}/)")
      try:
        socket.create_connection((p.ip, int(port)), timeout=1).close()
        return
      except OSError:
        time.sleep(0.5)
    raise RuntimeError(f"{p.name}: not ready after {timeout_s:.0f} s")

  def _stop(self, p: Pod, sig=signal.SIGTERM, grace_s: float = 15.0) -> None:
    if p.proc is None or p.proc.poll() is not None:
      return
    try:
      os.killpg(p.proc.pid, sig)
    except ProcessLookupError:
      return
    try:
      p.proc.wait(grace_s)
    except subprocess.TimeoutExpired:
      os.killpg(p.proc.pid, signal.SIGKILL)
      p.proc.wait(10)

  def _evals(self) -> list:
    """[step, val_pass_rate] of each evaluation in WORKDIR/metrics.jsonl ([] if unreadable)."""
    try:
      lines = [json.loads(l) for l in storage.read_text(storage.join(self.workdir, "metrics.jsonl"))
               .splitlines() if l.strip()]
    except (OSError, ValueError):
      return []
    return [[l["step"], l["val_pass_rate"]] for l in lines
            if l.get("kind") == "eval" and "val_pass_rate" in l]

  def _step(self) -> int:
    """The newest train step in WORKDIR/metrics.jsonl (through the storage layer), -1 if none."""
    path = storage.join(self.workdir, "metrics.jsonl")
    try:
      if not storage.exists(path):
        return -1
      lines = [json.loads(l) for l in storage.read_text(path).splitlines() if l.strip()]
      steps = [l.get("step", -1) for l in lines if l.get("kind") == "train"]
    except (OSError, ValueError):
      return -1
    return max(steps, default=-1)

  def _checkpoints(self) -> list[int]:
    """Steps of the workdir's finished checkpoints (with a manifest; saves are asynchronous)."""
    try:
      return finished_steps(self.workdir)
    except OSError:       # a step dir moved aside (resume fallback) while it was listed
      return []

  def _kill_due(self) -> bool:
    if self._step() < self.kill_at:
      return False
    return not self.kill_needs_checkpoint or bool(self._checkpoints())

  def _do_kill(self) -> None:
    if self.kill == "buffer":
      (p,) = [p for p in self.pods if component_of(p) == "buffer"]
      wal_dir = os.path.join(self.state, "pvc", next(
          v["persistentVolumeClaim"]["claimName"] for v in p.spec["volumes"]
          if "persistentVolumeClaim" in v and any(
              m["name"] == v["name"] and m["mountPath"] == "/wal"
              for m in p.spec["containers"][0].get("volumeMounts", []))))
      os.killpg(p.running.pid, signal.SIGKILL)
      p.running.wait(30)
      # The WAL as the killed buffer left it: every rollout in it was acknowledged.
      copy = os.path.join(self.state, "evidence", "wal-at-kill")
      shutil.copytree(wal_dir, copy)
      records, _ = walmod.read_all(copy, truncate=False)
      self.kill_report = {"pod": p.name, "at_step": self._step(), "wal_at_kill": copy,
                          "wal_dir": wal_dir, "records_at_kill": len(records)}
    else:
      p = self.learners()[0]
      os.killpg(p.running.pid, signal.SIGKILL)
      done = self._checkpoints()
      self.kill_report = {"pod": p.name, "at_step": self._step(),
                          "checkpoint_at_kill": done[-1] if done else None}
    self.events.append({"t": round(time.time(), 2), "pod": p.name, "event": "kill -9"})

  def run(self) -> dict:
    t0 = time.time()
    buffers = [p for p in self.pods if component_of(p) == "buffer"]
    gens = [p for p in self.pods if component_of(p) == "generator"]
    learners = self.learners()
    try:
      for p in buffers:                       # the Service the others dial must answer first
        self._start(p)
        self._wait_ready(p)
      for p in learners + gens:
        self._start(p)
      killed = not self.kill
      while True:
        if time.time() - t0 > self.timeout_s:
          raise RuntimeError(f"timed out after {self.timeout_s:.0f} s at step {self._step()}; "
                             f"where each pod stands:\n{self.where()}")
        time.sleep(1.0 if killed else 0.25)   # a pending kill: land it close to its step
        if not killed and self._kill_due():
          self._do_kill()
          killed = True
        for p in buffers + gens:              # Deployment: restartPolicy Always
          if p.running.poll() is not None:
            p.exit_codes.append(p.running.returncode)
            self.events.append({"t": round(time.time(), 2), "pod": p.name, "event": "exited",
                                "code": p.running.returncode})
            p.restarts += 1
            time.sleep(1.0)                   # kubelet back-off (10 s there)
            self._start(p)
            if p in buffers:
              self._wait_ready(p)
        codes = [p.running.poll() for p in learners]
        if all(c == 0 for c in codes):        # the JobSet completed
          for p in learners:
            p.exit_codes.append(0)
          break
        if any(c not in (None, 0) for c in codes):   # a failed pod fails the Job
          for p in learners:
            self._stop(p, signal.SIGKILL, 5)
            p.exit_codes.append(p.running.returncode)
          self.events.append({"t": round(time.time(), 2), "pod": self.jobset["name"],
                              "event": "job failed", "codes": codes})
          if self.jobset_restarts >= self.jobset["max_restarts"]:
            raise RuntimeError(f"JobSet {self.jobset['name']} failed (pod exit codes {codes}) "
                               f"after {self.jobset_restarts} restarts")
          self.jobset_restarts += 1
          for p in learners:
            p.restarts += 1
            self._start(p)
    finally:
      for p in learners + gens + buffers:
        self._stop(p)
    return self.summary(time.time() - t0)

  # -- what happened --
  def where(self, lines: int = 4) -> str:
    """Each pod: running or its exit code, restarts, and the last lines of its logs (what a
    timed-out rehearsal prints, as `kubectl get pods` + `kubectl logs --tail` would show)."""
    out = []
    for p in self.pods:
      rc = None if p.proc is None else p.proc.poll()
      state = ("not started" if p.proc is None else "running" if rc is None else f"exited {rc}")
      out.append(f"  {p.name}: {state}, restarts {p.restarts}, exit codes {p.exit_codes}")
      for f in sorted(glob.glob(os.path.join(self.state, "pods", p.name, "*.log"))):
        with open(f, "rb") as fh:
          fh.seek(max(0, os.path.getsize(f) - 8192))
          tail = [l for l in fh.read().decode(errors="replace").splitlines() if l.strip()]
        out += [f"    {os.path.basename(f)}: {l[:300]}" for l in tail[-lines:]]
    return "\n".join(out)

  def summary(self, wall_s: float) -> dict:
    s = {"manifests": self.dir, "workdir": self.workdir, "state_dir": self.state,
         "wall_s": round(wall_s, 1), "steps": self._step(), "jobset_restarts": self.jobset_restarts,
         "pods": {p.name: {"component": component_of(p), "ip": p.ip, "restarts": p.restarts,
                           "exit_codes": p.exit_codes} for p in self.pods},
         "events": self.events}
    s["learner_processes"] = learner_processes(self)
    s["knobs"] = logged_knobs(self)
    s["overrides"] = list(self.overrides)
    s["weights"] = weights_served(self)
    buf = [p for p in self.pods if component_of(p) == "buffer"][0]
    s["buffer"] = buffer_state(self, buf)
    s["fit"] = storage.join(self.workdir, "fit", "fit.json")
    s["fit_exists"] = storage.exists(s["fit"])
    s["evals"] = self._evals()   # (step, val_pass_rate): the fit needs one above R0 (step 0)
    if self.kill == "buffer" and self.kill_report:
      s["kill"] = dict(self.kill_report, **kill_check(self.kill_report))
    elif self.kill_report:
      s["kill"] = dict(self.kill_report, audit=self._audit(buf))
    return s

  def _audit(self, buf: Pod) -> dict:
    """tools/audit.py's ledger of every acknowledged rollout (the buffer's WAL with its archive)
    against the final timeline's trained ids (WORKDIR/trained_ids.jsonl, copied here from a
    gs:// workdir), plus the learners' resume / start-over lines."""
    wal_dir = buffer_state(self, buf)["wal_dir"]
    ids = os.path.join(self.state, "evidence", "trained_ids.jsonl")
    os.makedirs(os.path.dirname(ids), exist_ok=True)
    src = storage.join(self.workdir, "trained_ids.jsonl")
    with open(ids, "w") as f:
      f.write(storage.read_text(src) if storage.exists(src) else "")
    out = rollout_ledger(wal_dir, ids)
    text = read_logs(self, self.learners()[0])
    resumed = re.findall(r"resuming from checkpoint (\d+)\b(?! instead)", text)   # job.py's line
    out["resumed_from"] = [int(x) for x in resumed]
    out["started_over"] = len(re.findall(r"no valid checkpoint: starting over from step 0", text))
    out["buffer_rewinds"] = re.findall(r"(learner started over from step 0|learner resumed from "
                                       r"checkpoint step \d+)[^:]*: buffer rewound",
                                       read_logs(self, buf))
    return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m launch.rehearse", description=(__doc__ or "").split("\n")[0])
  ap.add_argument("manifests", help="a rendered variant, e.g. launch/gke/rendered/8b-h100")
  ap.add_argument("--steps", type=int, default=6)
  ap.add_argument("--workdir", default="", help="DIR or gs://BUCKET/PATH (default STATE_DIR/workdir)")
  ap.add_argument("--state-dir", default="", help="pods' logs, volumes, secrets (default: a temp dir)")
  ap.add_argument("--generators", type=int, default=2, help="generator pods (replicas capped)")
  ap.add_argument("--kill", choices=("", "buffer", "learner"), default="")
  ap.add_argument("--kill-at-step", type=int, default=0)
  ap.add_argument("--kill-before-checkpoint", action="store_true",
                  help="--kill learner: kill at --kill-at-step without waiting for a finished "
                       "checkpoint (before the first one: the learners start over)")
  ap.add_argument("--real-shape", action="store_true",
                  help="keep the variant's learner processes x devices and layout (simulated "
                       "CPU devices); only widths, batch and lengths shrink (needs a start "
                       "checkpoint that fits the layout: --checkpoint, launch.miniature)")
  ap.add_argument("--checkpoint", default="", help="model.hf_checkpoint for every pod (DIR or gs://)")
  ap.add_argument("--data", default="", help="data.path for every pod (jsonl / parquet, or gs://)")
  ap.add_argument("--tokenizer", default="", help="data.tokenizer_path for every pod (DIR)")
  ap.add_argument("--timeout", type=float, default=1500.0)
  ap.add_argument("--strict-preflight", action="store_true",
                  help="stop (exit 2) when the preflight of the real-size manifests fails; "
                       "default: report its failures and rehearse the tiny model anyway")
  a = ap.parse_args(argv)
  try:
    if a.steps < 1:
      raise RehearsalError(f"--steps={a.steps} must be >= 1")
    if a.workdir.startswith("gs://"):
      sys.path.insert(0, REPO)
      try:
        storage.check_remote_writable(a.workdir, ".rehearse-probe")
      except storage.RemoteStorageError as e:
        raise RehearsalError(f"workdir {a.workdir}: {e}") from None
    elif "://" in a.workdir:
      raise RehearsalError(f"workdir {a.workdir}: only local paths and gs://BUCKET/PATH")
    r = Rehearsal(a.manifests, steps=a.steps, workdir=a.workdir,
                  state_dir=a.state_dir or tempfile.gettempdir(), generators=a.generators,
                  kill=a.kill, kill_at_step=a.kill_at_step, timeout_s=a.timeout,
                  kill_before_checkpoint=a.kill_before_checkpoint, real_shape=a.real_shape,
                  inputs={"model.hf_checkpoint": a.checkpoint, "data.path": a.data,
                          "data.tokenizer_path": a.tokenizer})
  except RehearsalError as e:       # checked before anything is started or written
    print(f"rehearse: error: {e}", file=sys.stderr)
    return USAGE_ERROR
  # The real-size arithmetic of these manifests (launch/preflight.py); the rehearsal itself runs
  # the tiny model, so a failure here stops it only with --strict-preflight.
  (rep,) = preflight.run([a.manifests], out=sys.stderr)
  if rep.failures and (a.strict_preflight or a.real_shape):
    print(f"rehearse: error: preflight failed ({len(rep.failures)} failures, above)",
          file=sys.stderr)
    return USAGE_ERROR
  r.set_state_dir(a.state_dir or tempfile.mkdtemp(prefix="scalerl-rehearse-"), a.workdir)
  try:
    s = r.run()
  except RuntimeError as e:
    print(f"rehearse: failed: {e} (pod logs: {r.state}/pods/)", file=sys.stderr)
    return 1
  s["preflight"] = rep.failures
  with open(os.path.join(r.state, "summary.json"), "w") as f:
    json.dump(s, f, indent=1)
  print(json.dumps(s))
  return 0


if __name__ == "__main__":
  sys.exit(main())
