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
import base64
import datetime
import glob
import json
import os
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from launch import preflight
from launch.spec import COORDINATOR_PORT, load_config
from scalerl_jax import recipes, storage, topologies, xla_env
from scalerl_jax.buffer import wal as walmod
from scalerl_jax.processes import buffer_flags, child_env, launcher_argv
from scalerl_jax.protocol import rollout_pb2 as pb
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
PLACEHOLDER = "REPLACE-ME"
# A TPU slice learner's jax.distributed auto-detection (launch/spec.py); --real-shape replaces it
# by the coordinator env the GPU variants carry (pod 0 of the JobSet, COORDINATOR_PORT).
TPU_AUTO_ARG = "--config.distributed.auto=True"
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
  recipes.apply_overrides(probe, [f"--config.{o}" for o in out])
  hosts, chips = shape
  fails = topologies.run_shape_failures(probe, hosts, hosts * chips)
  if fails:
    raise RehearsalError(f"--real-shape: {fails[0]}")
  if not probe.model.get("hf_checkpoint"):
    raise RehearsalError("--real-shape needs a start checkpoint whose widths fit the layout "
                         "(model.hf_checkpoint is empty: --checkpoint=DIR, python -m "
                         "launch.miniature)")
  return out
USAGE_ERROR = 2


class RehearsalError(Exception):
  """A bad manifest directory or argument: one line, exit status 2, nothing started."""


# ---- manifests -----------------------------------------------------------------------------------
def load_manifests(d: str) -> list[dict]:
  if not os.path.isdir(d):
    raise RehearsalError(f"{d}: not a directory of rendered manifests")
  docs = []
  for path in sorted(glob.glob(os.path.join(d, "*.yaml"))):
    with open(path) as f:
      try:
        docs += [x for x in yaml.safe_load_all(f) if x]
      except yaml.YAMLError as e:
        raise RehearsalError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
  if not docs:
    raise RehearsalError(f"{d}: no *.yaml manifests")
  return docs


def _secrets(docs) -> dict[str, dict]:
  """{secret name: {"type", "data": {key: str}}} from the Secret manifests."""
  out = {}
  for x in docs:
    if x.get("kind") != "Secret":
      continue
    data = {k: str(v) for k, v in (x.get("stringData") or {}).items()}
    data.update({k: base64.b64decode(v).decode() for k, v in (x.get("data") or {}).items()})
    out[x["metadata"]["name"]] = {"type": x.get("type", "Opaque"), "data": data}
  return out


def _service_names(docs) -> list[tuple[str, str]]:
  """(name, namespace) of every Service."""
  return [(x["metadata"]["name"], x["metadata"].get("namespace", "default"))
          for x in docs if x.get("kind") == "Service"]


def _dns_names(name: str, ns: str) -> list[str]:
  return [name, f"{name}.{ns}", f"{name}.{ns}.svc", f"{name}.{ns}.svc.cluster.local"]


def _test_certs(names: list[str]) -> dict[str, str]:
  """A CA and one certificate (server + client) for `names`, PEM: for TLS Secret placeholders."""
  now = datetime.datetime.now(datetime.timezone.utc)
  nm = lambda cn: x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
  ca_key = ec.generate_private_key(ec.SECP256R1())
  ca = (x509.CertificateBuilder().subject_name(nm("rehearsal-ca")).issuer_name(nm("rehearsal-ca"))
        .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256()))
  key = ec.generate_private_key(ec.SECP256R1())
  cert = (x509.CertificateBuilder().subject_name(nm(names[0])).issuer_name(ca.subject)
          .public_key(key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=2))
          .add_extension(x509.SubjectAlternativeName([x509.DNSName(n) for n in names]),
                         critical=False)
          .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
          .sign(ca_key, hashes.SHA256()))
  pem = lambda c: c.public_bytes(serialization.Encoding.PEM).decode()
  return {"tls.crt": pem(cert), "ca.crt": pem(ca),
          "tls.key": key.private_bytes(serialization.Encoding.PEM,
                                       serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()).decode()}


def fill_secrets(docs) -> dict[str, dict]:
  """The Secrets with placeholders replaced: a random token, or test certificates (TLS type)."""
  sec = _secrets(docs)
  dns = [n for name, ns in _service_names(docs) for n in reversed(_dns_names(name, ns))]
  for s in sec.values():
    if not any(str(v).startswith(PLACEHOLDER) for v in s["data"].values()):
      continue
    if s["type"] == "kubernetes.io/tls":
      s["data"].update(_test_certs(dns))
    else:
      s["data"] = {k: (secrets.token_hex(32) if str(v).startswith(PLACEHOLDER) else v)
                   for k, v in s["data"].items()}
  return sec


# ---- pods ----------------------------------------------------------------------------------------
class Pod:
  """One pod to run: its spec (init containers, containers, volumes), name, address, owner."""

  def __init__(self, name: str, spec: dict, owner: str, ip: str, annotations: dict | None = None,
               namespace: str = "default", component: str = ""):
    self.name, self.spec, self.owner, self.ip = name, spec, owner, ip
    self.component = component
    self.annotations = dict(annotations or {})
    self.namespace = namespace
    self.proc: subprocess.Popen | None = None
    self.restarts = 0
    self.exit_codes: list[int] = []
    self.started = False

  @property
  def running(self) -> subprocess.Popen:
    """The container's process, once started (`Rehearsal._start`)."""
    assert self.proc is not None, f"pod {self.name} was not started"
    return self.proc


def plan_pods(docs, generators: int, subnet: str,
              real_shape: bool = False) -> tuple[list[Pod], dict]:
  """The pods the manifests describe (generator Deployment capped at `generators` replicas) and
  {"jobset": {name, max_restarts, hostnames, tpu_auto}}; refuses what cannot run here. A TPU
  slice JobSet (`--config.distributed.auto=True`) runs only with `real_shape`: its
  auto-detection is replaced by the explicit coordinator env (Rehearsal.command)."""
  pods, jobset, ips = [], None, iter(range(1, 250))
  deployments = [x for x in docs if x.get("kind") == "Deployment"]
  jobsets = [x for x in docs if x.get("kind") == "JobSet"]
  if not jobsets or not deployments:
    raise RehearsalError("the directory needs a learner JobSet and the buffer / generator "
                         "Deployments (launch/gke/render.py output)")
  for d in deployments:
    md, spec = d["metadata"], d["spec"]
    n = int(spec.get("replicas", 1))
    comp = md.get("labels", {}).get("app.kubernetes.io/component", "")
    if comp == "generator":
      n = min(n, generators)
    for i in range(n):
      pods.append(Pod(f"{md['name']}-rehearse-{i}", spec["template"]["spec"], md["name"],
                      f"{subnet}.{next(ips)}", namespace=md.get("namespace", "default"),
                      component=spec["template"].get("metadata", {}).get("labels", {}).get(
                          "app.kubernetes.io/component", "")))
  (js,) = jobsets
  jmd = js["metadata"]
  hostnames, tpu_auto = {}, False
  for rj in js["spec"]["replicatedJobs"]:
    tmpl = rj["template"]["spec"]
    for r in range(int(rj.get("replicas", 1))):
      for k in range(int(tmpl.get("parallelism", 1))):
        pspec = tmpl["template"]["spec"]
        for c in pspec.get("containers", []):
          if any(a == TPU_AUTO_ARG for a in c.get("command", [])):
            if not real_shape:
              raise RehearsalError(f"{jmd['name']}: a TPU slice JobSet (jax.distributed auto-"
                                   "detection) cannot be rehearsed on CPU with the tiny model; "
                                   "use --real-shape or a GPU variant")
            tpu_auto = True
        name = f"{jmd['name']}-{rj['name']}-{r}-{k}"
        p = Pod(name, pspec, jmd["name"], f"{subnet}.{next(ips)}",
                {"batch.kubernetes.io/job-completion-index": str(k)},
                namespace=jmd.get("namespace", "default"), component="learner")
        pods.append(p)
        # JobSet DNS (network.enableDNSHostnames): POD.SUBDOMAIN, subdomain = the JobSet name.
        sub = js["spec"].get("network", {}).get("subdomain") or jmd["name"]
        hostnames[name] = p.ip
        hostnames[f"{name}.{sub}"] = p.ip
  jobset = {"name": jmd["name"],
            "max_restarts": int(js["spec"].get("failurePolicy", {}).get("maxRestarts", 0)),
            "hostnames": hostnames, "tpu_auto": tpu_auto}
  return pods, jobset


def hosts_table(docs, pods: list[Pod], jobset: dict) -> dict[str, str]:
  """Service DNS names -> the address of the pod behind them (first pod of its component)."""
  table = dict(jobset["hostnames"])
  for x in docs:
    if x.get("kind") != "Service":
      continue
    comp = x["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")
    behind = [p for p in pods if _component(p) == comp]
    if behind:
      for n in _dns_names(x["metadata"]["name"], x["metadata"].get("namespace", "default")):
        table[n] = behind[0].ip
  return table


def _component(p: Pod) -> str:
  return p.component


def _role(argv: list[str]) -> str:
  mod = argv[argv.index("-m") + 1] if "-m" in argv else ""
  return {"scalerl_jax.main": "learner", "scalerl_jax.generation.worker": "generator",
          "scalerl_jax.data.export": "export", "scalerl_jax.buffer.server": "buffer"}.get(mod, mod)


# ---- the rehearsal -------------------------------------------------------------------------------
class Rehearsal:

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

  def _configmap(self, name: str) -> dict:
    for d in self.docs:
      if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == name:
        return dict(d.get("data") or {})
    raise RehearsalError(f"ConfigMap {name!r} is not in {self.dir} (render it: python -m "
                         "launch.gke.render)")

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
    recipes.apply_overrides(config, overrides)
    return recipes.apply_recipe(config, recipes.locked_keys(overrides))

  def _learner_shape(self) -> tuple[int, int]:
    """(learner pods, accelerators per pod) of the JobSet: the real shape kept by --real-shape."""
    learners = self._learners()
    lim = learners[0].spec["containers"][0].get("resources", {}).get("limits", {})
    chips = [int(v) for k, v in lim.items() if k in ("nvidia.com/gpu", "google.com/tpu")]
    return len(learners), (chips[0] if chips else 1)

  # -- commands --
  def _volume_dir(self, p: Pod, vol: dict) -> str:
    if "persistentVolumeClaim" in vol:
      d = os.path.join(self.state, "pvc", vol["persistentVolumeClaim"]["claimName"])
    elif "configMap" in vol:
      d = os.path.join(self.state, "pods", p.name, "configmap", vol["name"])
      if not os.path.isdir(d):
        os.makedirs(d)
        for k, v in self._configmap(vol["configMap"]["name"]).items():
          with open(os.path.join(d, k), "w") as f:
            f.write(v)
    elif "secret" in vol:
      d = os.path.join(self.state, "pods", p.name, "secret", vol["name"])
      if not os.path.isdir(d):
        os.makedirs(d)
        for k, v in self.secrets[vol["secret"]["secretName"]]["data"].items():
          path = os.path.join(d, k)
          with open(path, "w") as f:
            f.write(v)
          os.chmod(path, vol["secret"].get("defaultMode", 0o644) | 0o400)
    else:                                     # emptyDir (medium Memory too)
      d = os.path.join(self.state, "pods", p.name, "emptydir", vol["name"])
    os.makedirs(d, exist_ok=True)
    return d

  def _mounts(self, p: Pod, c: dict) -> list[tuple[str, str]]:
    vols = {v["name"]: v for v in p.spec.get("volumes", [])}
    out = []
    for m in c.get("volumeMounts", []):
      if m["mountPath"] == "/dev/shm":
        continue
      out.append((m["mountPath"].rstrip("/"), self._volume_dir(p, vols[m["name"]])))
    return sorted(out, key=lambda x: -len(x[0]))

  def _map_path(self, p: Pod, mounts, value: str, private: bool) -> str:
    if value == self.workdir_manifest or value.startswith(self.workdir_manifest + "/"):
      return self.workdir + value[len(self.workdir_manifest):]
    if not value.startswith("/"):
      return value
    for mount, local in mounts:
      if value == mount or value.startswith(mount + "/"):
        return local + value[len(mount):]
    if private:                               # the container's own filesystem
      return os.path.join(self.state, "pods", p.name, "root") + value
    return value

  def _env(self, p: Pod, c: dict) -> dict:
    env = {"HOSTNAME": p.name}
    fields = {"status.podIP": p.ip, "metadata.name": p.name, "metadata.namespace": p.namespace}
    for k, v in p.annotations.items():
      fields[f"metadata.annotations['{k}']"] = v
    for e in c.get("env", []):
      if "value" in e:
        env[e["name"]] = str(e["value"])
        continue
      vf = e.get("valueFrom") or {}
      if "fieldRef" in vf:
        path = vf["fieldRef"]["fieldPath"]
        if path not in fields:
          raise RehearsalError(f"{p.owner}/{c['name']}: env {e['name']}: fieldPath {path!r} "
                               "is not emulated")
        env[e["name"]] = fields[path]
      elif "secretKeyRef" in vf:
        ref = vf["secretKeyRef"]
        env[e["name"]] = self.secrets[ref["name"]]["data"][ref["key"]]
    # /tmp is the container's own: a gs:// run's LOCAL_DIR ($TMPDIR/scalerl-local/...) per pod.
    env["TMPDIR"] = os.path.join(self.state, "pods", p.name, "root", "tmp")
    os.makedirs(env["TMPDIR"], exist_ok=True)
    table = dict(self.hosts)
    table["0.0.0.0"] = p.ip
    env["SCALERL_HOSTS"] = ",".join(f"{k}={v}" for k, v in table.items())
    return env

  def command(self, p: Pod, c: dict) -> tuple[list[str], dict]:
    """(argv, env) of container `c` of pod `p`, as run here (see the module docstring)."""
    env = self._env(p, c)
    mounts = self._mounts(p, c)
    expand = lambda s: re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                              lambda m: env.get(m.group(1), m.group(0)), s)
    argv = []
    for a in c["command"] + c.get("args", []):
      a = expand(a)
      if a.startswith("--") and "=" in a:
        k, v = a.split("=", 1)
        a = f"{k}={self._map_path(p, mounts, v, private=True)}"
      else:
        a = self._map_path(p, mounts, a, private=False)
      argv.append(a)
    env = {k: self._map_path(p, mounts, v, private=False) for k, v in env.items()}
    if argv and argv[0] == "python":
      argv[0] = sys.executable
    role = _role(argv)
    tiny = [f"--config.{o}" for o in self.overrides]
    if role == "learner":
      argv += tiny + [f"--config.total_steps={self.steps}"] + self.extra_learner
      if self.real_shape:   # the pod's accelerators as simulated CPU devices
        env["XLA_FLAGS"] = xla_env.with_device_count(env.get("XLA_FLAGS"),
                                                     self._learner_shape()[1])
      if self.jobset["tpu_auto"] and TPU_AUTO_ARG in argv:
        argv.remove(TPU_AUTO_ARG)
        env.update(self._tpu_coordinator_env(p, c))
    elif role == "generator":
      argv += tiny + ["--backend=jax"]
    elif role == "export":
      argv += tiny
    elif role == "buffer":
      argv += self._buffer_changes(argv)
    elif role == "scalerl_jax.selftest":   # the pod's start-up self-test, on this machine's engine
      argv = [("--backend=jax" if a == "--backend=vllm" else a) for a in argv] + tiny
    return argv, env

  def _tpu_coordinator_env(self, p: Pod, c: dict) -> dict:
    """What a TPU slice's jax.distributed auto-detection finds, as the GPU variants' explicit env
    (launch/spec.py): the coordinator on learner pod 0 (its JobSet host name and `coordinator`
    container port), the JobSet's pod count, this pod's Job completion index."""
    learners = self._learners()
    port = next((x["containerPort"] for x in c.get("ports", []) if x.get("name") == "coordinator"),
                COORDINATOR_PORT)
    sub = next(h for h in self.jobset["hostnames"] if h.startswith(learners[0].name + "."))
    return {"SCALERL_COORDINATOR": f"{sub}:{port}", "SCALERL_NUM_PROCESSES": str(len(learners)),
            "SCALERL_PROCESS_ID": p.annotations["batch.kubernetes.io/job-completion-index"]}

  def _buffer_changes(self, argv: list[str]) -> list[str]:
    """The buffer flags the tiny config changes (argparse keeps the last value of a flag)."""
    have = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    want = buffer_flags(self.tiny, prompts="x", host="x", port=1, wal_dir=have.get("--wal-dir"))
    keep = ("--host", "--port", "--prompts", "--token-env")
    return [a for a in want if a.split("=", 1)[0] not in keep and (
        have.get(a.split("=", 1)[0]) != a.split("=", 1)[1] if "=" in a else a not in argv)]

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

  def _learners(self) -> list[Pod]:
    return [p for p in self.pods if p.annotations]

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
      (p,) = [p for p in self.pods if _component(p) == "buffer"]
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
      p = self._learners()[0]
      os.killpg(p.running.pid, signal.SIGKILL)
      done = self._checkpoints()
      self.kill_report = {"pod": p.name, "at_step": self._step(),
                          "checkpoint_at_kill": done[-1] if done else None}
    self.events.append({"t": round(time.time(), 2), "pod": p.name, "event": "kill -9"})

  def run(self) -> dict:
    t0 = time.time()
    buffers = [p for p in self.pods if _component(p) == "buffer"]
    gens = [p for p in self.pods if _component(p) == "generator"]
    learners = self._learners()
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
         "pods": {p.name: {"component": _component(p), "ip": p.ip, "restarts": p.restarts,
                           "exit_codes": p.exit_codes} for p in self.pods},
         "events": self.events}
    s["learner_processes"] = _learner_processes(self)
    s["knobs"] = _knobs(self)
    s["overrides"] = list(self.overrides)
    s["weights"] = _weights(self)
    buf = [p for p in self.pods if _component(p) == "buffer"][0]
    s["buffer"] = _buffer_state(self, buf)
    s["fit"] = storage.join(self.workdir, "fit", "fit.json")
    s["fit_exists"] = storage.exists(s["fit"])
    s["evals"] = self._evals()   # (step, val_pass_rate): the fit needs one above R0 (step 0)
    if self.kill == "buffer" and self.kill_report:
      s["kill"] = dict(self.kill_report, **_kill_check(self.kill_report))
    elif self.kill_report:
      s["kill"] = dict(self.kill_report, audit=self._audit(buf))
    return s

  def _audit(self, buf: Pod) -> dict:
    """tools/audit.py's ledger of every acknowledged rollout (the buffer's WAL with its archive)
    against the final timeline's trained ids (WORKDIR/trained_ids.jsonl, copied here from a
    gs:// workdir), plus the learners' resume / start-over lines."""
    wal_dir = _buffer_state(self, buf)["wal_dir"]
    ids = os.path.join(self.state, "evidence", "trained_ids.jsonl")
    os.makedirs(os.path.dirname(ids), exist_ok=True)
    src = storage.join(self.workdir, "trained_ids.jsonl")
    with open(ids, "w") as f:
      f.write(storage.read_text(src) if storage.exists(src) else "")
    out = rollout_ledger(wal_dir, ids)
    text = _read_logs(self, self._learners()[0])
    resumed = re.findall(r"resuming from checkpoint (\d+)\b(?! instead)", text)   # job.py's line
    out["resumed_from"] = [int(x) for x in resumed]
    out["started_over"] = len(re.findall(r"no valid checkpoint: starting over from step 0", text))
    out["buffer_rewinds"] = re.findall(r"(learner started over from step 0|learner resumed from "
                                       r"checkpoint step \d+)[^:]*: buffer rewound",
                                       _read_logs(self, buf))
    return out


def _read_logs(r: Rehearsal, p: Pod) -> str:
  out = []
  for f in sorted(glob.glob(os.path.join(r.state, "pods", p.name, "*.log"))):
    with open(f, errors="replace") as fh:
      out.append(fh.read())
  return "\n".join(out)


def _learner_processes(r: Rehearsal) -> dict:
  """Per learner pod: the jax.distributed process index and count it reported."""
  out = {}
  for p in r._learners():   # pylint: disable=protected-access
    text = _read_logs(r, p)
    m = re.findall(r"jax\.distributed: process (\d+) of (\d+)", text)
    out[p.name] = {"process": int(m[-1][0]), "of": int(m[-1][1])} if m else None
  return out


def _knobs(r: Rehearsal) -> dict:
  """Per pod and role: the run-config knobs its process logged at its last start
  (`run config (ROLE): k=v ...`, runtime.knob_line), and the learner's devices."""
  out = {}
  for p in r.pods:
    text = _read_logs(r, p)
    got = {}
    for role, rest in re.findall(r"run config \((\w+)\): (.*)", text):
      got[role] = dict(re.findall(r"(\S+?)=((?:\([^=]*\)\)|\S+))(?= \S+=|$)", rest.strip()))
    m = re.findall(r"learner devices: (\d+) local of (\d+) in (\d+) processes", text)
    if m:
      got["devices"] = {"local": int(m[-1][0]), "global": int(m[-1][1]), "processes": int(m[-1][2])}
    out[p.name] = got
  return out


def _weights(r: Rehearsal) -> dict:
  """Chunks served per learner pod (its log) and learner sources each generator fetched from."""
  ip_of = {p.ip: p.name for p in r.pods}
  served, fetched = {}, {}
  for p in r.pods:
    text = _read_logs(r, p)
    if _component(p) == "learner":
      served[p.name] = sum(int(n) for n in re.findall(r"served weights version \d+: (\d+) chunks",
                                                      text))
    elif _component(p) == "generator":
      srcs = {}
      for blob in re.findall(r"fetched weights version \d+ from learner sources (\{[^}]*\})", text):
        for addr, n in re.findall(r"'([^']+)': (\d+)", blob):
          name = ip_of.get(addr.rsplit(":", 1)[0].strip("[]"), addr)
          srcs[name] = srcs.get(name, 0) + int(n)
      fetched[p.name] = srcs
  return {"served_chunks": served, "fetched_chunks_by_source": fetched}


def _buffer_state(r: Rehearsal, p: Pod) -> dict:
  """From the buffer's own state: its WAL (segments, NPR records) and its command's NPR flag."""
  c = p.spec["containers"][0]
  argv, _ = r.command(p, c)
  flags = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
  wal_dir = flags.get("--wal-dir", "")
  out = {"npr_threshold_flag": flags.get("--npr-threshold"), "wal_dir": wal_dir}
  if wal_dir and os.path.isdir(wal_dir):
    records, _ = walmod.read_all(wal_dir, truncate=False)
    kinds = {}
    for t, _ in records:
      kinds[walmod.NAMES.get(t, str(t))] = kinds.get(walmod.NAMES.get(t, str(t)), 0) + 1
    out["wal_files"] = sorted(os.listdir(wal_dir))
    out["wal_bytes"] = sum(os.path.getsize(os.path.join(wal_dir, f)) for f in os.listdir(wal_dir))
    out["wal_records"] = kinds
    npr = [json.loads(b) for t, b in records if t == walmod.NPR_STATE]
    out["npr_state"] = npr[-1] if npr else None
  return out


def _kill_check(k: dict) -> dict:
  """Acknowledged rollouts (the WAL at the kill) against what the final WAL says was delivered or
  is still stored; every group delivered at most once across both."""

  def scan(d) -> tuple[dict, set, list, set]:
    rolls, seen, deliver, last = {}, set(), [], set()
    records, _ = walmod.read_all(d, truncate=False)
    for t, body in records:
      if t == walmod.ROLLOUT:
        x = pb.Rollout.FromString(body)
        rolls[x.rollout_id] = x.group_id
      elif t == walmod.SEEN:
        seen.update(json.loads(body)["ids"])
      elif t == walmod.DELIVER:
        b = json.loads(body)
        deliver.append((b["step"], tuple(b["gids"])))
      elif t == walmod.LAST_BATCH:
        last.update(json.loads(body)["gids"])
    return rolls, seen, deliver, last
  a_rolls, a_seen, a_deliver, _ = scan(k["wal_at_kill"])
  f_rolls, f_seen, f_deliver, f_last = scan(k["wal_dir"])
  delivered_groups = {g for _, gs in a_deliver + f_deliver for g in gs} | f_last
  delivered = set(f_seen) | set(a_seen) | {r for r, g in {**a_rolls, **f_rolls}.items()
                                           if g in delivered_groups}
  acked = set(a_rolls) | set(a_seen)
  lost = sorted(acked - delivered - set(f_rolls))
  by_step: dict[int, set] = {}
  for step, gs in a_deliver + f_deliver:
    by_step.setdefault(step, set()).add(gs)
  twice = {}
  owner: dict[int, int] = {}
  for step, batches in by_step.items():
    if len(batches) > 1:
      twice[f"step {step}"] = "different batches"
    for g in next(iter(batches)):
      if g in owner and owner[g] != step:
        twice[f"group {g}"] = [owner[g], step]
      owner[g] = step
  return {"acked_at_kill": len(acked), "delivered_by_end": len(delivered),
          "stored_at_end": len(f_rolls), "lost": lost[:20], "lost_count": len(lost),
          "trained_twice": twice, "delivered_steps": sorted(by_step)}


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
