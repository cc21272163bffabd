"""launch.rehearse's reading of a rendered variant: the manifests, their Secrets (placeholders
filled with test tokens / test certificates), the pods they describe and the host table that
gives each pod its own loopback address (launch/rehearse.py's docstring says how they run)."""
from __future__ import annotations

import base64
import datetime
import glob
import os
import re
import secrets
import subprocess
import sys
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from launch.gke import render
from launch.spec import COORDINATOR_PORT
from scalerl_jax import xla_env
from scalerl_jax.processes import buffer_flags

PLACEHOLDER = "REPLACE-ME"
# A TPU slice learner's jax.distributed auto-detection (launch/spec.py); --real-shape replaces it
# by the coordinator env the GPU variants carry (pod 0 of the JobSet, COORDINATOR_PORT).
TPU_AUTO_ARG = "--config.distributed.auto=True"


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


def plan_from_specs(specs: dict, generators: int = 2) -> dict[str, Any]:
  """The `rehearse` launch backend's plan (launch/backends.py): the pods the GKE manifests of
  `specs` would run here ({"pods": [{name, component, ip}], "jobset": ...}), generators capped
  at `generators`."""
  docs = [d for ds in render.manifests(specs).values() for d in ds]
  pods, info = plan_pods(docs, generators, "127.0.10")
  return {"pods": [{"name": p.name, "component": component_of(p), "ip": p.ip} for p in pods],
          "jobset": info.get("jobset")}


def hosts_table(docs, pods: list[Pod], jobset: dict) -> dict[str, str]:
  """Service DNS names -> the address of the pod behind them (first pod of its component)."""
  table = dict(jobset["hostnames"])
  for x in docs:
    if x.get("kind") != "Service":
      continue
    comp = x["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")
    behind = [p for p in pods if component_of(p) == comp]
    if behind:
      for n in _dns_names(x["metadata"]["name"], x["metadata"].get("namespace", "default")):
        table[n] = behind[0].ip
  return table


def component_of(p: Pod) -> str:
  return p.component


def role_of(argv: list[str]) -> str:
  mod = argv[argv.index("-m") + 1] if "-m" in argv else ""
  return {"scalerl_jax.main": "learner", "scalerl_jax.generation.worker": "generator",
          "scalerl_jax.data.export": "export", "scalerl_jax.buffer.server": "buffer"}.get(mod, mod)


class ContainerCommands:
  """How a pod's container runs on this machine (launch/rehearse.py's docstring): its volumes as
  local directories, its env (fieldRefs, Secrets, `$SCALERL_HOSTS`), its paths mapped, its
  command with the tiny-model (or real-shape) overrides. The base of `Rehearsal`, which sets the
  attributes below."""
  dir: str
  docs: list[dict]
  state: str
  secrets: dict[str, dict]
  workdir: str
  workdir_manifest: str
  hosts: dict[str, str]
  overrides: list[str]
  steps: int
  extra_learner: list[str]
  real_shape: bool
  jobset: dict
  tiny: Any
  pods: list[Pod]

  def _configmap(self, name: str) -> dict:
    for d in self.docs:
      if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == name:
        return dict(d.get("data") or {})
    raise RehearsalError(f"ConfigMap {name!r} is not in {self.dir} (render it: python -m "
                         "launch.gke.render)")

  def learners(self) -> list[Pod]:
    return [p for p in self.pods if p.annotations]

  def _learner_shape(self) -> tuple[int, int]:
    """(learner pods, accelerators per pod) of the JobSet: the real shape kept by --real-shape."""
    learners = self.learners()
    lim = learners[0].spec["containers"][0].get("resources", {}).get("limits", {})
    chips = [int(v) for k, v in lim.items() if k in ("nvidia.com/gpu", "google.com/tpu")]
    return len(learners), (chips[0] if chips else 1)

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
    role = role_of(argv)
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
    elif role == "buffer":        # reads the run config as the others do (+ the tiny overrides)
      argv += tiny + self._buffer_changes(argv)
    elif role == "scalerl_jax.selftest":   # the pod's start-up self-test, on this machine's engine
      argv = [("--backend=jax" if a == "--backend=vllm" else a) for a in argv] + tiny
    return argv, env

  def _tpu_coordinator_env(self, p: Pod, c: dict) -> dict:
    """What a TPU slice's jax.distributed auto-detection finds, as the GPU variants' explicit env
    (launch/spec.py): the coordinator on learner pod 0 (its JobSet host name and `coordinator`
    container port), the JobSet's pod count, this pod's Job completion index."""
    learners = self.learners()
    port = next((x["containerPort"] for x in c.get("ports", []) if x.get("name") == "coordinator"),
                COORDINATOR_PORT)
    sub = next(h for h in self.jobset["hostnames"] if h.startswith(learners[0].name + "."))
    return {"SCALERL_COORDINATOR": f"{sub}:{port}", "SCALERL_NUM_PROCESSES": str(len(learners)),
            "SCALERL_PROCESS_ID": p.annotations["batch.kubernetes.io/job-completion-index"]}

  def _buffer_changes(self, argv: list[str]) -> list[str]:
    """The buffer's one derived flag the tiny config changes: the MoE route shape (computed from
    the model by whoever starts the buffer; argparse keeps the last value, "" = no routes)."""
    want = [a for a in buffer_flags(self.tiny, run_file="x", prompts="x", host="x", port=1)
            if a.startswith("--route-shape=")]
    had = any(a.startswith("--route-shape=") for a in argv)
    return want or (["--route-shape="] if had else [])
