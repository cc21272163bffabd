"""Resolved job specs for a ScaleRL run: the one place launch/xm_launch.py and launch/gke/render.py read.

Three jobs, sized from the config (PAPER_NOTES §4: 80 GB200 per run, 16 training + 64 generating):
  learner     `python -m scalerl_jax.main` on `train_chips` accelerators (TPU v5p slice or GPU hosts)
  generators  the vLLM fleet: `generator.num_workers` GPUs, `tensor_parallel` GPUs per vLLM engine
  buffer      the gRPC rollout buffer (scalerl_jax.buffer.server), CPU only, auth token Secret

Launch knobs are not in configs/common.py; an optional `config.launch` ConfigDict overrides
`LAUNCH_DEFAULTS` key by key (and the xm_launch / render flags override both).
"""
from __future__ import annotations

import copy
import posixpath
from typing import Any

from scalerl_jax.processes import buffer_flags

BUFFER_PORT = 50051
VLLM_PORT = 8000
COORDINATOR_PORT = 8476
WEIGHTS_PORT = 50052                 # each learner pod's WeightSource (config.weights.port)
WAL_MOUNT = "/wal"                   # the buffer pod's write-ahead log volume (a PVC: local disk)
PROMPTS_FILE = "/prompts/prompts.jsonl"
# Downward-API values a pod gets from Kubernetes (renderers turn them into `fieldRef` env vars).
FIELD_POD_IP = "status.podIP"
FIELD_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
SECRET_NAME = "scalerl-buffer-token"
SECRET_KEY = "token"
# TLS (docs/ROLLOUT.md "TLS"): one certificate for every gRPC server of the run (the buffer service
# and the learner pods' weight sources, dialed by pod IP), its key and the CA, from one Secret
# mounted read-only in every pod; clients check the buffer service's DNS name in the certificate
# (config.tls.server_name), so the certificate needs just that name as a SAN.
TLS_SECRET_NAME = "scalerl-tls"
TLS_MOUNT = "/etc/scalerl/tls"
TLS_FILES = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}

# Accelerator platforms: what one host (pod) of each offers and how GKE names it.
PLATFORMS: dict[str, dict[str, Any]] = {
    "tpu-v5p": dict(kind="tpu", chips_per_host=4, resource="google.com/tpu", xm_resource="tpu_v5p",
                    node_selector={"cloud.google.com/gke-tpu-accelerator": "tpu-v5p-slice"},
                    topology={4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4"},
                    machine_type="ct5p-hightpu-4t", cpu="200", memory="400Gi", arch="amd64"),
    "gpu-h100": dict(kind="gpu", chips_per_host=8, resource="nvidia.com/gpu", xm_resource="h100",
                     node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                     machine_type="a3-highgpu-8g", cpu="200", memory="1600Gi", arch="amd64"),
    "gpu-gb200": dict(kind="gpu", chips_per_host=4, resource="nvidia.com/gpu", xm_resource="gb200",
                      node_selector={"cloud.google.com/gke-accelerator": "nvidia-gb200"},
                      machine_type="a4x-highgpu-4g", cpu="128", memory="800Gi", arch="arm64"),
}

LAUNCH_DEFAULTS = dict(
    name="scalerl",
    namespace="default",
    learner_platform="tpu-v5p",        # tpu-v5p | gpu-h100 | gpu-gb200
    generator_platform="gpu-gb200",    # vLLM needs GPUs
    train_chips=16,
    tensor_parallel=0,                 # GPUs per vLLM engine; 0 = by model preset (see TP_BY_PRESET)
    image_prefix="us-docker.pkg.dev/PROJECT/scalerl",
    image_tag="0.1.0",
    workdir="gs://BUCKET/scalerl/run",
    data_pvc="scalerl-data",           # read-only volume with config.data.path and tokenizer_path
    wal_storage="200Gi",               # the buffer's WAL PVC (ReadWriteOnce; survives pod restarts)
    service_account="scalerl",         # Kubernetes SA of learner + buffer pods (Workload Identity:
                                       # read/write the gs:// workdir)
    config_file="configs/8b.py",
    tls=True,                          # TLS on every gRPC channel, certificates from TLS_SECRET_NAME
)
# vLLM tensor parallelism per engine: bf16 weights + KV cache must fit.
TP_BY_PRESET = {"llama3_8b": 1, "llama4_scout_17b_16e": 4}


def _launch_settings(config, overrides: dict | None) -> dict:
  s = dict(LAUNCH_DEFAULTS)
  if "launch" in config:
    s.update(dict(config.launch))
  s.update({k: v for k, v in (overrides or {}).items() if v is not None})
  for key in ("learner_platform", "generator_platform"):
    if s[key] not in PLATFORMS:
      raise ValueError(f"{key}={s[key]!r}; expected one of {sorted(PLATFORMS)}")
  if PLATFORMS[s["generator_platform"]]["kind"] != "gpu":
    raise ValueError("generator_platform must be a GPU platform (vLLM)")
  return s


def image(s: dict, role: str) -> str:
  """Container image for `role` in {learner-tpu, learner-gpu, vllm, buffer}."""
  return f"{s['image_prefix']}/scalerl-jax-{role}:{s['image_tag']}"


def resolve(config, overrides: dict | None = None) -> dict:
  """The three job specs (plain JSON-able dicts) for `config` (+ launch overrides)."""
  s = _launch_settings(config, overrides)
  lp, gp = PLATFORMS[s["learner_platform"]], PLATFORMS[s["generator_platform"]]
  chips = int(s["train_chips"])
  if chips <= 0 or chips % lp["chips_per_host"]:
    raise ValueError(f"train_chips={chips} must be a positive multiple of "
                     f"{lp['chips_per_host']} ({s['learner_platform']} chips per host)")
  hosts = chips // lp["chips_per_host"]
  topology = None
  if lp["kind"] == "tpu":
    if chips not in lp["topology"]:
      raise ValueError(f"no TPU v5p topology for {chips} chips; known: {sorted(lp['topology'])}")
    topology = lp["topology"][chips]
  gen_gpus = int(config.generator.num_workers)
  tp = int(s["tensor_parallel"]) or TP_BY_PRESET.get(config.model.preset, 1)
  if gen_gpus % tp:
    raise ValueError(f"generator.num_workers={gen_gpus} GPUs is not a multiple of tensor_parallel={tp}")
  name = s["name"]
  buffer_addr = f"{name}-buffer.{s['namespace']}.svc.cluster.local:{BUFFER_PORT}"
  cfg_file = s["config_file"]
  token_env = config.buffer.auth_token_env
  common_args = [f"--config={cfg_file}", f"--config.buffer.address={buffer_addr}"]
  tls = None
  if s["tls"]:
    paths = {k: f"{TLS_MOUNT}/{f}" for k, f in TLS_FILES.items()}
    server_name = buffer_addr.rpartition(":")[0]
    tls = {"secret": TLS_SECRET_NAME, "mount": TLS_MOUNT, "files": dict(TLS_FILES),
           "server_name": server_name,
           "learner_args": [f"--config.tls.{k}={v}" for k, v in paths.items()] +
                           [f"--config.tls.server_name={server_name}"],
           "generator_args": [f"--tls_{k}={v}" for k, v in paths.items()] +
                             [f"--tls_server_name={server_name}"],
           "buffer_args": [f"--tls-{k}={v}" for k, v in paths.items()]}
  tls_args = lambda role: list(tls[f"{role}_args"]) if tls else []
  workdir = s["workdir"]
  learner_env, learner_fields = {}, {"POD_IP": FIELD_POD_IP}
  if lp["kind"] == "tpu":     # jax.distributed.initialize() auto-detects the slice's hosts
    dist_args = ["--config.distributed.auto=True"]
  else:                       # GPU hosts: explicit coordinator (pod 0), count, index (scalerl_jax/distributed.py)
    dist_args = []
    learner_env.update({"SCALERL_COORDINATOR": f"{name}-learner-learner-0-0.{name}-learner:"
                                                f"{COORDINATOR_PORT}",
                        "SCALERL_NUM_PROCESSES": str(hosts)})
    learner_fields["SCALERL_PROCESS_ID"] = FIELD_COMPLETION_INDEX
  learner_role = "learner-tpu" if lp["kind"] == "tpu" else "learner-gpu"
  return {
      "name": name,
      "namespace": s["namespace"],
      "config_file": cfg_file,
      "model_preset": config.model.preset,
      "total_chips": chips + gen_gpus,
      "learner": {
          "name": f"{name}-learner", "platform": s["learner_platform"],
          "image": image(s, learner_role), "accelerator_resource": lp["resource"],
          "chips": chips, "hosts": hosts, "chips_per_host": lp["chips_per_host"],
          "tpu_topology": topology, "node_selector": dict(lp["node_selector"]),
          "machine_type": lp["machine_type"], "arch": lp["arch"], "cpu": lp["cpu"], "memory": lp["memory"],
          "coordinator_port": COORDINATOR_PORT, "weights_port": WEIGHTS_PORT,
          # Every learner pod serves its own weight shards to the fleet (weights/source.py):
          # it listens on all interfaces and advertises its pod IP ($(POD_IP): Kubernetes expands
          # it from the env var the downward API sets).
          "command": ["python", "-m", "scalerl_jax.main", *common_args, *dist_args,
                      "--config.buffer.external=True", "--config.weights.host=0.0.0.0",
                      f"--config.weights.port={WEIGHTS_PORT}",
                      "--config.weights.advertise=$(POD_IP)", *tls_args("learner"),
                      f"--workdir={workdir}"],
          "env": learner_env, "field_env": learner_fields,
          "secret_env": {token_env: [SECRET_NAME, SECRET_KEY]},
          "service_account": s["service_account"],
      },
      "generators": {
          "name": f"{name}-vllm", "platform": s["generator_platform"], "image": image(s, "vllm"),
          "accelerator_resource": gp["resource"], "gpus": gen_gpus, "tensor_parallel": tp,
          "replicas": gen_gpus // tp, "gpus_per_replica": tp,
          "node_selector": dict(gp["node_selector"]), "machine_type": gp["machine_type"],
          "arch": gp["arch"],
          "cpu": str(8 * tp), "memory": f"{64 * tp}Gi", "port": VLLM_PORT,
          # One vLLM engine per pod; generator id = pod name; run config = the same config file.
          "command": ["python", "-m", "scalerl_jax.generation.worker", f"--run_config={cfg_file}",
                      f"--buffer={buffer_addr}", "--backend=vllm", "--workdir=/tmp/scalerl",
                      f"--tensor_parallel={tp}", *tls_args("generator")],
          "env": {}, "field_env": {}, "secret_env": {token_env: [SECRET_NAME, SECRET_KEY]},
      },
      "buffer": {
          "name": f"{name}-buffer", "image": image(s, "buffer"), "port": BUFFER_PORT,
          "address": buffer_addr, "cpu": "8", "memory": "32Gi", "prompts_file": PROMPTS_FILE,
          "export_command": ["python", "-m", "scalerl_jax.data.export", f"--config={cfg_file}",
                             f"--out={PROMPTS_FILE}"],
          # The same flags main passes when it starts the buffer itself (processes.buffer_flags):
          # NPR threshold, WAL on the pod's volume, the learner-state file in the workdir.
          "command": ["python", "-m", "scalerl_jax.buffer.server",
                      *buffer_flags(config, prompts=PROMPTS_FILE, host="0.0.0.0", port=BUFFER_PORT,
                                    wal_dir=WAL_MOUNT,
                                    learner_state=posixpath.join(workdir, "learner_state.json"),
                                    tls=tls_args("buffer"))],
          "wal_mount": WAL_MOUNT, "wal_storage": s["wal_storage"],
          "env": {}, "field_env": {}, "secret_env": {token_env: [SECRET_NAME, SECRET_KEY]},
          "service_account": s["service_account"],
      },
      "secret": {"name": SECRET_NAME, "key": SECRET_KEY, "env": token_env},
      "tls": tls,
      "data_pvc": s["data_pvc"],
  }


def load_config(path: str, arg: str | None = None):
  """Imports a `get_config(arg)` config file by path (no absl flags needed)."""
  import importlib.util
  import os
  if not os.path.isfile(path):
    raise FileNotFoundError(f"config file {path!r} does not exist")
  spec = importlib.util.spec_from_file_location("_scalerl_launch_config", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return copy.deepcopy(mod.get_config(arg))
