"""Renders GKE manifests from a config via launch/spec.py, so they cannot drift from the configs.

  python -m launch.gke.render --all                      # re-render every committed variant
  python -m launch.gke.render --config=configs/8b.py --learner_platform=gpu-gb200 --out=DIR

Per variant directory: learner-jobset.yaml (JobSet), generators.yaml (Deployment + headless Service),
buffer.yaml (WAL PersistentVolumeClaim, Deployment, Service: gRPC port), secret.yaml (Secret templates: the buffer token and,
with TLS (the default), the certificate / key / CA every pod mounts read-only at spec.TLS_MOUNT).
"""
from __future__ import annotations

import argparse
import os
import sys

import yaml

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from launch import spec as spec_lib  # noqa: E402

RENDERED_DIR = os.path.join(_REPO, "launch", "gke", "rendered")
# Committed variants: directory -> (config file, learner platform, generator platform).
VARIANTS = {
    "8b-gb200": ("configs/8b.py", "gpu-gb200", "gpu-gb200"),    # the paper: 80 GB200 = 16 + 64
    "8b-tpu-v5p": ("configs/8b.py", "tpu-v5p", "gpu-gb200"),
    "8b-h100": ("configs/8b.py", "gpu-h100", "gpu-h100"),
    "scout-gb200": ("configs/scout.py", "gpu-gb200", "gpu-gb200"),
}
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


def learner_jobset(specs):
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
          "serviceAccountName": job["service_account"],
          "nodeSelector": node_selector,
          "tolerations": _tolerations(job),
          "containers": [{
              "name": "learner", "image": job["image"], "command": job["command"],
              "ports": [{"name": "coordinator", "containerPort": job["coordinator_port"]},
                        {"name": "weights", "containerPort": job["weights_port"]}],
              "env": env,
              "resources": {"requests": {"cpu": job["cpu"], "memory": job["memory"],
                                         job["accelerator_resource"]: n},
                            "limits": {job["accelerator_resource"]: n}},
              "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}] +
                              _tls_mounts(specs)[0],
          }],
          "volumes": [_data_volume(specs)] + _tls_mounts(specs)[1],
      },
  }
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


def generators(specs):
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
              "nodeSelector": dict(job["node_selector"]),
              "tolerations": _tolerations(job),
              "containers": [{
                  "name": "vllm", "image": job["image"], "command": job["command"],
                  "ports": [{"name": "http", "containerPort": job["port"]}],
                  "env": _env(job),
                  "resources": {"requests": {"cpu": job["cpu"], "memory": job["memory"],
                                             job["accelerator_resource"]: n},
                                "limits": {job["accelerator_resource"]: n}},
                  "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}] +
                                  _tls_mounts(specs)[0],
              }],
              "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}] +
                         _tls_mounts(specs)[1],
          }},
      },
  }
  service = {   # headless: the learner resolves every generator pod to push weights in flight
      "apiVersion": "v1", "kind": "Service", "metadata": _meta(specs, job["name"], "generator"),
      "spec": {"clusterIP": "None", "selector": sel,
               "ports": [{"name": "http", "port": job["port"], "targetPort": "http"}]},
  }
  return [deployment, service]


def buffer(specs):
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
                  "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True},
                                   {"name": "prompts", "mountPath": "/prompts"}],
              }],
              "containers": [{
                  "name": "buffer", "image": job["image"], "command": job["command"],
                  "ports": [{"name": "grpc", "containerPort": job["port"]}],
                  "env": _env(job),
                  "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 10},
                  "resources": {"requests": {"cpu": job["cpu"], "memory": job["memory"]},
                                "limits": {"memory": job["memory"]}},
                  "volumeMounts": [{"name": "prompts", "mountPath": "/prompts", "readOnly": True},
                                   {"name": "wal", "mountPath": job["wal_mount"]}] +
                                  _tls_mounts(specs)[0],
              }],
              "volumes": [_data_volume(specs), {"name": "prompts", "emptyDir": {}},
                          {"name": "wal", "persistentVolumeClaim": {"claimName": wal_claim}}] +
                         _tls_mounts(specs)[1],
          }},
      },
  }
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


def secret(specs):
  s = specs["secret"]
  return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
          "metadata": _meta(specs, s["name"], "buffer"),
          "stringData": {s["key"]: SECRET_PLACEHOLDER}}


def tls_secret(specs):
  """The TLS Secret template: certificate (SAN: the buffer service name), key and CA, as PEM."""
  t = specs["tls"]
  return {"apiVersion": "v1", "kind": "Secret", "type": "kubernetes.io/tls",
          "metadata": _meta(specs, t["secret"], "tls"),
          "stringData": {f: f"{SECRET_PLACEHOLDER} (PEM; certificate SAN {t['server_name']})"
                         for f in t["files"].values()}}


def manifests(specs) -> dict[str, list[dict]]:
  """{file name: [documents]} for one variant."""
  secrets = [secret(specs)] + ([tls_secret(specs)] if specs.get("tls") else [])
  return {"learner-jobset.yaml": [learner_jobset(specs)], "generators.yaml": generators(specs),
          "buffer.yaml": buffer(specs), "secret.yaml": secrets}


def render_text(docs: list[dict], header: str) -> str:
  body = yaml.safe_dump_all(docs, sort_keys=False, explicit_start=True, width=100)
  return header + body


def render(config_file: str, learner_platform: str, generator_platform: str, out_dir: str) -> list[str]:
  """Writes the variant's manifests to `out_dir`; returns the written paths."""
  config = spec_lib.load_config(os.path.join(_REPO, config_file))
  specs = spec_lib.resolve(config, dict(learner_platform=learner_platform,
                                        generator_platform=generator_platform,
                                        config_file=config_file))
  header = (f"# GENERATED by `python -m launch.gke.render` from {config_file} "
            f"(learner {learner_platform}, generators {generator_platform}). Do not edit.\n")
  os.makedirs(out_dir, exist_ok=True)
  paths = []
  for fname, docs in manifests(specs).items():
    path = os.path.join(out_dir, fname)
    with open(path, "w") as f:
      f.write(render_text(docs, header))
    paths.append(path)
  return paths


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--all", action="store_true", help=f"render every variant into {RENDERED_DIR}")
  ap.add_argument("--config", default="configs/8b.py")
  ap.add_argument("--learner_platform", default="gpu-gb200", choices=sorted(spec_lib.PLATFORMS))
  ap.add_argument("--generator_platform", default="gpu-gb200", choices=sorted(spec_lib.PLATFORMS))
  ap.add_argument("--out", help="output directory (required without --all)")
  a = ap.parse_args(argv)
  if a.all:
    for name, (cfg, lp, gp) in VARIANTS.items():
      for p in render(cfg, lp, gp, os.path.join(RENDERED_DIR, name)):
        print(os.path.relpath(p, _REPO))
  elif a.out:
    for p in render(a.config, a.learner_platform, a.generator_platform, a.out):
      print(p)
  else:
    ap.error("give --out DIR or --all")


if __name__ == "__main__":
  main()
