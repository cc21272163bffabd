"""Renders GKE manifests from a config via launch/spec.py, so they cannot drift from the configs.

  python -m launch.gke.render --all                      # re-render every committed variant
  python -m launch.gke.render --config=configs/8b.py --learner_platform=gpu-gb200 --out=DIR \
      --workdir=gs://BUCKET/run --image_prefix=REGISTRY --namespace=NS \
      --data=/data/polaris.jsonl --tokenizer=/data/tokenizer --checkpoint=/data/ckpt/llama3-8b \
      --override rollout.max_lag=4 --override generator.decode_batch=32

Per variant directory: run-config.yaml (ConfigMap `run-config`: the ONE resolved run config every
pod mounts at spec.RUN_CONFIG_MOUNT and reads), learner-jobset.yaml (JobSet), generators.yaml
(Deployment + headless Service), buffer.yaml (WAL PersistentVolumeClaim, Deployment, Service: gRPC
port), secret.yaml (Secret templates: the buffer token and, with TLS (the default), the
certificate / key / CA every pod mounts read-only at spec.TLS_MOUNT). Every render ends with the
preflight (launch/preflight.py, arithmetic only) of what it wrote; a failure exits 1.
"""
from __future__ import annotations

import argparse
import copy
import math
import os
import sys
from typing import Any

import yaml

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from launch import preflight  # noqa: E402
from launch import spec as spec_lib  # noqa: E402
from scalerl_jax.progress import probe_command  # noqa: E402

RENDERED_DIR = os.path.join(_REPO, "launch", "gke", "rendered")
# Committed variants: directory -> (config file, learner platform, generator platform, settings).
# The learner layout is the config's layout for the platform's 16 chips (spec.pick_layout);
# 8b-h100: one H100 (80 GB) per vLLM engine holds the KV of 23 sequences of 16,464 tokens at
# gpu_memory_utilization 0.9 (launch/sizing.py), so its engines run 16 at once, not 64.
VARIANTS = {
    "8b-gb200": ("configs/8b.py", "gpu-gb200", "gpu-gb200", {}),   # the paper: 80 GB200 = 16 + 64
    "8b-tpu-v5p": ("configs/8b.py", "tpu-v5p", "gpu-gb200", {}),
    "8b-h100": ("configs/8b.py", "gpu-h100", "gpu-h100",
                {"config_overrides": ("generator.decode_batch=16",)}),
    "scout-gb200": ("configs/scout.py", "gpu-gb200", "gpu-gb200", {}),
}
# Where the committed variants expect the data volume's files (the `scalerl-data` PVC).
DEFAULT_DATA = {"data": f"{spec_lib.DATA_MOUNT}/polaris-53k.jsonl",
                "tokenizer": f"{spec_lib.DATA_MOUNT}/tokenizer/{{preset}}",
                "checkpoint": f"{spec_lib.DATA_MOUNT}/checkpoints/{{preset}}"}
SECRET_PLACEHOLDER = "REPLACE-ME-see-launch-README"


def _labels(specs, component):
  return {"app.kubernetes.io/name": specs["name"], "app.kubernetes.io/component": component}


def _meta(specs, name, component):
  return {"name": name, "namespace": specs["namespace"], "labels": _labels(specs, component)}


def _env(job):
  """Plain values, downward-API fields (pod IP, completion index) and the Secret; field vars come
  before the values and the command that reference them as $(VAR)."""
  env = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": f}}}
         for k, f in sorted(job.get("field_env", {}).items())]
  env += [{"name": k, "value": str(v)} for k, v in sorted(job["env"].items())]
  for var, (secret, key) in sorted(job["secret_env"].items()):
    env.append({"name": var, "valueFrom": {"secretKeyRef": {"name": secret, "key": key}}})
  return env


def _tolerations(job):
  resource = job["accelerator_resource"]
  tol = [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]
  if job["arch"] == "arm64":
    tol.append({"key": "kubernetes.io/arch", "operator": "Equal", "value": "arm64",
                "effect": "NoSchedule"})
  return tol


def _tls_mounts(specs):
  """(volumeMounts, volumes) of the TLS Secret, empty without TLS."""
  t = specs.get("tls")
  if not t:
    return [], []
  return ([{"name": "tls", "mountPath": t["mount"], "readOnly": True}],
          [{"name": "tls", "secret": {"secretName": t["secret"], "defaultMode": 0o440}}])


def _data_volume(specs):
  return {"name": "data", "persistentVolumeClaim": {"claimName": specs["data_pvc"], "readOnly": True}}


def _data_mount(specs):
  return {"name": "data", "mountPath": specs["data_mount"], "readOnly": True}


def _run_config_mounts(specs):
  """(volumeMounts, volumes) of the run-config ConfigMap, empty when commands read a file."""
  rc = specs["run_config"]
  if rc["mode"] != "configmap":
    return [], []
  return ([{"name": "run-config", "mountPath": rc["mount"], "readOnly": True}],
          [{"name": "run-config", "configMap": {"name": rc["name"]}}])


def run_config_map(specs) -> dict[str, Any]:
  """The ConfigMap `run-config`: the resolved config as the Python file every pod loads."""
  rc = specs["run_config"]
  return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(specs, rc["name"], "config"),
          "data": {rc["file"]: rc["text"]}}


def _tcp_probes(port, startup_s: int):
  """(startupProbe, livenessProbe) on a TCP port: up to `startup_s` to open it, then restarted
  after 2 minutes without it."""
  return ({"tcpSocket": {"port": port}, "periodSeconds": 30,
           "failureThreshold": max(1, startup_s // 30)},
          {"tcpSocket": {"port": port}, "periodSeconds": 30, "failureThreshold": 4})


# Start-up self-test budgets (scalerl_jax/selftest.py): vLLM's import and device query dominate
# the generator's; the others check storage, the checkpoint's headers and the grader.
SELFTEST_BUDGET_S = {"learner": 180, "generator": 300, "buffer": 60}


def _flag_value(command, flag: str) -> str:
  return next(a.split("=", 1)[1] for a in command if a.startswith(flag + "="))


def _selftest(role: str, container: dict, command, workdir: str, extra=(), mounts=None) -> dict:
  """The init container that runs the pod's start-up self-test (scalerl_jax/selftest.py) with the
  main container's image, env, mounts and resources: the pod stops at start with one line naming
  what is missing (sandbox, grader, vLLM, storage, checkpoint) before it takes work. `command`:
  the config-reading command whose run config (`--config=` / `--run_config=`) and `--config.*`
  overrides it takes."""
  cfg = next((a.split("=", 1)[1] for a in command if a.startswith(("--run_config=", "--config="))))
  over = [a for a in command if a.startswith("--config.")]
  c = {"name": "selftest", "image": container["image"],
       "command": ["python", "-m", "scalerl_jax.selftest", f"--role={role}", f"--run_config={cfg}",
                   *over, f"--workdir={workdir}", f"--budget_s={SELFTEST_BUDGET_S[role]}", *extra]}
  for k in ("env", "resources"):
    if k in container:
      c[k] = copy.deepcopy(container[k])
  c["volumeMounts"] = copy.deepcopy(mounts if mounts is not None else container.get("volumeMounts", []))
  return c


def learner_jobset(specs) -> dict[str, Any]:
  job = specs["learner"]
  n = str(job["chips_per_host"])
  env = _env(job)   # GPU: SCALERL_COORDINATOR/NUM_PROCESSES/PROCESS_ID; TPU: distributed.auto
  node_selector = dict(job["node_selector"])
  if job["tpu_topology"]:
    node_selector["cloud.google.com/gke-tpu-topology"] = job["tpu_topology"]
  pod = {
      "metadata": {"labels": _labels(specs, "learner")},
      "spec": {
          "restartPolicy": "Never",
          # checkpoint.termination_grace_s: a SIGTERM'd learner saves only if this allows
          "terminationGracePeriodSeconds": int(math.ceil(job["termination_grace_s"])),
          "serviceAccountName": job["service_account"],
          "nodeSelector": node_selector,
          "tolerations": _tolerations(job),
          "containers": [{
              "name": "learner", "image": job["image"], "command": job["command"],
              "ports": [{"name": "coordinator", "containerPort": job["coordinator_port"]},
                        {"name": "weights", "containerPort": job["weights_port"]},
                        {"name": "weights-bulk", "containerPort": job["weights_bulk_port"]}],
              "env": env,
              # The weight source listens once the model is loaded (checkpoint read + first
              # compile: up to an hour allowed); then liveness from progress: a learner whose
              # progress file (touched at every step's publish) is older than
              # learner.progress_max_age_s (stuck in a collective, say) is restarted.
              "startupProbe": _tcp_probes("weights", 3600)[0],
              "livenessProbe": _progress_probe(job),
              "resources": {"requests": {"cpu": job["cpu"], "memory": job["memory"],
                                         job["accelerator_resource"]: n},
                            "limits": {job["accelerator_resource"]: n}},
              "volumeMounts": [_data_mount(specs)] + _run_config_mounts(specs)[0] +
                              _tls_mounts(specs)[0],
          }],
          "volumes": [_data_volume(specs)] + _run_config_mounts(specs)[1] + _tls_mounts(specs)[1],
      },
  }
  main = pod["spec"]["containers"][0]
  pod["spec"]["initContainers"] = [_selftest("learner", main, job["command"],
                                             _flag_value(job["command"], "--workdir"))]
  return {
      "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
      "metadata": _meta(specs, job["name"], "learner"),
      "spec": {
          "failurePolicy": {"maxRestarts": 3},
          "network": {"enableDNSHostnames": True},
          "replicatedJobs": [{
              "name": "learner", "replicas": 1,
              "template": {"spec": {"parallelism": job["hosts"], "completions": job["hosts"],
                                    "completionMode": "Indexed", "backoffLimit": 0,
                                    "template": pod}},
          }],
      },
  }


ALIVE_MAX_AGE_S = 120


def _alive_probe(job, failures: int):
  """exec probe: the generator's --alive_file was touched within ALIVE_MAX_AGE_S."""
  return {"exec": {"command": probe_command(job["alive_file"], ALIVE_MAX_AGE_S)},
          "periodSeconds": 30, "failureThreshold": failures}


def _progress_probe(job):
  """exec liveness probe: the pod's progress file (scalerl_jax/progress.py) was touched within
  its `progress_max_age_s`; checked every 30 s, failing at the first stale look."""
  return {"exec": {"command": probe_command(job["progress_file"], job["progress_max_age_s"])},
          "periodSeconds": 30, "failureThreshold": 1, "timeoutSeconds": 10}


def generators(specs) -> list[dict[str, Any]]:
  job = specs["generators"]
  n = str(job["gpus_per_replica"])
  sel = {"app.kubernetes.io/name": specs["name"], "app.kubernetes.io/component": "generator"}
  deployment = {
      "apiVersion": "apps/v1", "kind": "Deployment",
      "metadata": _meta(specs, job["name"], "generator"),
      "spec": {
          "replicas": job["replicas"],
          "selector": {"matchLabels": sel},
          "template": {"metadata": {"labels": sel}, "spec": {
              "serviceAccountName": job["service_account"],
              "nodeSelector": dict(job["node_selector"]),
              "tolerations": _tolerations(job),
              "containers": [{
                  "name": "vllm", "image": job["image"], "command": job["command"],
                  "ports": [{"name": "http", "containerPort": job["port"]},
                            {"name": "relay", "containerPort": job["relay_port"]},
                            {"name": "relay-bulk", "containerPort": job["relay_bulk_port"]}],
                  "env": _env(job),
                  # The worker's heartbeat thread touches --alive_file every generator.heartbeat_s
                  # once its engine is up (weights fetched from the learner: allowed an hour).
                  "startupProbe": _alive_probe(job, 120),
                  "livenessProbe": _alive_probe(job, 4),
                  "resources": {"requests": {"cpu": job["cpu"], "memory": job["memory"],
                                             # checkpoint copy + HF export + logs (sizing.py)
                                             "ephemeral-storage": job["ephemeral_storage"],
                                             job["accelerator_resource"]: n},
                                "limits": {job["accelerator_resource"]: n}},
                  # The workdir is a pod volume: a container restart keeps its HF export
                  # (reused by checksum, generation/export_cache.py) and its logs.
                  "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}, _data_mount(specs),
                                   {"name": "workdir",
                                    "mountPath": _flag_value(job["command"], "--workdir")}] +
                                  _run_config_mounts(specs)[0] + _tls_mounts(specs)[0],
              }],
              "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, _data_volume(specs),
                          {"name": "workdir", "emptyDir": {}}] +
                         _run_config_mounts(specs)[1] + _tls_mounts(specs)[1],
          }},
      },
  }
  pod = deployment["spec"]["template"]["spec"]
  # One start-checkpoint copy per node (scalerl_jax/node_cache.py): a hostPath every generator pod
  # of the node mounts at generator.ckpt_cache_dir; one pod fetches under a lock, the others reuse.
  pod["containers"][0]["volumeMounts"].append({"name": "ckpt-cache",
                                               "mountPath": job["ckpt_cache_mount"]})
  pod["volumes"].append({"name": "ckpt-cache", "hostPath": {"path": job["ckpt_cache_host_path"],
                                                            "type": "DirectoryOrCreate"}})
  pod["initContainers"] = [_selftest("generator", pod["containers"][0], job["command"],
                                     _flag_value(job["command"], "--workdir"), ["--backend=vllm"])]
  service = {   # headless: the learner resolves every generator pod to push weights in flight
      "apiVersion": "v1", "kind": "Service", "metadata": _meta(specs, job["name"], "generator"),
      "spec": {"clusterIP": "None", "selector": sel,
               "ports": [{"name": "http", "port": job["port"], "targetPort": "http"}]},
  }
  return [deployment, service]


def buffer(specs) -> list[dict[str, Any]]:
  job = specs["buffer"]
  wal_claim = f"{job['name']}-wal"
  sel = {"app.kubernetes.io/name": specs["name"], "app.kubernetes.io/component": "buffer"}
  deployment = {
      "apiVersion": "apps/v1", "kind": "Deployment",
      "metadata": _meta(specs, job["name"], "buffer"),
      "spec": {
          "replicas": 1,                       # one buffer owns the PipelineRL-k admission state
          "strategy": {"type": "Recreate"},
          "selector": {"matchLabels": sel},
          "template": {"metadata": {"labels": sel}, "spec": {
              "serviceAccountName": job["service_account"],
              "initContainers": [{
                  "name": "export-prompts", "image": job["image"], "command": job["export_command"],
                  "volumeMounts": [_data_mount(specs), {"name": "prompts", "mountPath": "/prompts"}]
                                  + _run_config_mounts(specs)[0],
              }],
              "containers": [{
                  "name": "buffer", "image": job["image"], "command": job["command"],
                  "ports": [{"name": "grpc", "containerPort": job["port"]}],
                  "env": _env(job),
                  "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10},
                  # The gRPC port opens after the WAL replay: allowed 30 minutes; then liveness
                  # from progress (WAL commits, served leases; buffer.progress_max_age_s): a
                  # buffer whose WAL disk is full still answers on its port but stops committing.
                  "startupProbe": _tcp_probes("grpc", 1800)[0],
                  "livenessProbe": _progress_probe(job),
                  "resources": {"requests": {"cpu": job["cpu"], "memory": job["memory"]},
                                "limits": {"memory": job["memory"]}},
                  "volumeMounts": [{"name": "prompts", "mountPath": "/prompts", "readOnly": True},
                                   {"name": "wal", "mountPath": job["wal_mount"]}] +
                                  _tls_mounts(specs)[0] + _run_config_mounts(specs)[0],
              }],
              "volumes": [_data_volume(specs), {"name": "prompts", "emptyDir": {}},
                          {"name": "wal", "persistentVolumeClaim": {"claimName": wal_claim}}] +
                         _run_config_mounts(specs)[1] + _tls_mounts(specs)[1],
          }},
      },
  }
  pod = deployment["spec"]["template"]["spec"]
  export, main = pod["initContainers"][0], pod["containers"][0]
  pod["initContainers"].insert(0, _selftest(   # the WAL volume takes a write before the replay
      "buffer", main, job["export_command"], job["wal_mount"],
      mounts=export["volumeMounts"] + [{"name": "wal", "mountPath": job["wal_mount"]}]))
  # The write-ahead log must outlive the pod (a restarted buffer replays acknowledged rollouts and
  # rewinds from it) and sit on a local disk (fsync'd appends; docs/STORAGE.md): a PVC.
  pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
         "metadata": _meta(specs, wal_claim, "buffer"),
         "spec": {"accessModes": ["ReadWriteOnce"],
                  "resources": {"requests": {"storage": job["wal_storage"]}}}}
  service = {
      "apiVersion": "v1", "kind": "Service", "metadata": _meta(specs, job["name"], "buffer"),
      "spec": {"selector": sel, "ports": [{"name": "grpc", "port": job["port"], "targetPort": "grpc",
                                           "appProtocol": "grpc"}]},
  }
  return [pvc, deployment, service]


def secret(specs) -> dict[str, Any]:
  s = specs["secret"]
  return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
          "metadata": _meta(specs, s["name"], "buffer"),
          "stringData": {s["key"]: SECRET_PLACEHOLDER}}


def tls_secret(specs) -> dict[str, Any]:
  """The TLS Secret template: certificate (SAN: the buffer service name), key and CA, as PEM."""
  t = specs["tls"]
  return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
          "metadata": _meta(specs, t["secret"], "tls"),
          "stringData": {f: f"{SECRET_PLACEHOLDER} (PEM; certificate SAN {t['server_name']})"
                         for f in t["files"].values()}}


def manifests(specs) -> dict[str, list[dict]]:
  """{file name: [documents]} for one variant."""
  secrets = [secret(specs)] + ([tls_secret(specs)] if specs.get("tls") else [])
  out = {"learner-jobset.yaml": [learner_jobset(specs)], "generators.yaml": generators(specs),
         "buffer.yaml": buffer(specs), "secret.yaml": secrets}
  if specs["run_config"]["mode"] == "configmap":
    out["run-config.yaml"] = [run_config_map(specs)]
  return out


class _Dumper(yaml.SafeDumper):
  """Multi-line strings (the run config file) as YAML literal blocks."""


_Dumper.add_representer(str, lambda d, v: d.represent_scalar(
    "tag:yaml.org,2002:str", v, style="|" if "\n" in v else None))


def render_text(docs: list[dict], header: str) -> str:
  body = yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False, explicit_start=True, width=100)
  return header + body


def variant_settings(config_file: str, learner_platform: str, generator_platform: str,
                     settings: dict | None = None) -> dict:
  """Launch settings of a render: the committed defaults (data volume paths) + `settings`."""
  config = spec_lib.load_config(os.path.join(_REPO, config_file))
  preset = config.model.preset
  s = {k: v.format(preset=preset) for k, v in DEFAULT_DATA.items()}
  s.update(learner_platform=learner_platform, generator_platform=generator_platform,
           config_file=config_file, run_config="configmap")
  s.update({k: v for k, v in (settings or {}).items() if v not in (None, "", (), [], {})})
  return s


def render(config_file: str, learner_platform: str, generator_platform: str, out_dir: str,
           settings: dict | None = None) -> list[str]:
  """Writes the variant's manifests to `out_dir`; returns the written paths."""
  config = spec_lib.load_config(os.path.join(_REPO, config_file))
  s = variant_settings(config_file, learner_platform, generator_platform, settings)
  specs = spec_lib.resolve(config, s)
  over = "".join(f" --override {o.removeprefix('--config.')}" for o in specs["config_overrides"])
  header = (f"# GENERATED by `python -m launch.gke.render` from {config_file} "
            f"(learner {learner_platform} layout {specs['layout']}, generators "
            f"{generator_platform}). Do not edit.\n# Resolved with:{over}\n")
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for fname, docs in manifests(specs).items():
    path = os.path.join(out_dir, fname)
    with open(path, "w") as f:
      f.write(render_text(docs, header))
    paths.append(path)
  return paths


def _kv(items, what):
  out = {}
  for it in items or ():
    k, sep, v = it.partition("=")
    if not sep:
      raise SystemExit(f"render: error: {what} {it!r}: expected KEY=VALUE")
    out[k] = v
  return out


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("--all", action="store_true", help=f"render every variant into {RENDERED_DIR}")
  ap.add_argument("--config", default="configs/8b.py")
  ap.add_argument("--learner_platform", choices=sorted(spec_lib.PLATFORMS),
                  default=spec_lib.LAUNCH_DEFAULTS["learner_platform"])
  ap.add_argument("--generator_platform", choices=sorted(spec_lib.PLATFORMS),
                  default=spec_lib.LAUNCH_DEFAULTS["generator_platform"])
  ap.add_argument("--train_chips", type=int, default=None, help="learner accelerators (default 16)")
  ap.add_argument("--layout", default="", help="learner layout (config.layouts); default: the "
                  "config's layout for the learner's chips")
  ap.add_argument("--workdir", default="", help="run directory, gs://BUCKET/... (default "
                  f"{spec_lib.LAUNCH_DEFAULTS['workdir']})")
  ap.add_argument("--image_prefix", default="", help="registry prefix of the four images")
  ap.add_argument("--image_tag", default="", help="tag of the four images")
  ap.add_argument("--image", action="append", default=[], metavar="ROLE=REF",
                  help=f"full image reference of one role {spec_lib.ROLES} (repeatable)")
  ap.add_argument("--namespace", default="")
  ap.add_argument("--name", default="", help="job name prefix (default scalerl)")
  ap.add_argument("--data_pvc", default="", help="read-only PVC mounted at "
                  f"{spec_lib.DATA_MOUNT} on every pod that reads data or the checkpoint")
  ap.add_argument("--data", default="", help="config.data.path (on the data volume, or gs://)")
  ap.add_argument("--tokenizer", default="", help="config.data.tokenizer_path (on the data volume)")
  ap.add_argument("--checkpoint", default="", help="config.model.hf_checkpoint: start weights "
                  "(on the data volume, or gs://)")
  ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                  help="config override for EVERY pod (repeatable), e.g. rollout.max_lag=4")
  ap.add_argument("--no-preflight", dest="preflight", action="store_false",
                  help="skip the preflight of the written manifests")
  ap.add_argument("--out", help="output directory (required without --all)")
  a = ap.parse_args(argv)
  settings = dict(train_chips=a.train_chips, layout=a.layout, workdir=a.workdir,
                  image_prefix=a.image_prefix, image_tag=a.image_tag,
                  images=_kv(a.image, "--image"), namespace=a.namespace, name=a.name,
                  data_pvc=a.data_pvc, data=a.data, tokenizer=a.tokenizer,
                  checkpoint=a.checkpoint, config_overrides=tuple(a.override))
  dirs = []
  try:
    if a.all:
      for name, (cfg, lp, gp, extra) in VARIANTS.items():
        s = dict(extra)
        s.update({k: v for k, v in settings.items() if v not in (None, "", (), [], {})})
        out = os.path.join(RENDERED_DIR, name)
        for p in render(cfg, lp, gp, out, s):
          print(os.path.relpath(p, _REPO))
        dirs.append(out)
    elif a.out:
      for p in render(a.config, a.learner_platform, a.generator_platform, a.out, settings):
        print(p)
      dirs.append(a.out)
    else:
      ap.error("give --out DIR or --all")
  except ValueError as e:
    raise SystemExit(f"render: error: {e}") from None
  if a.preflight:
    if preflight.main(dirs):
      raise SystemExit(1)


if __name__ == "__main__":
  main()
