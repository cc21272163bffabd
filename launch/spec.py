"""Resolved job specs for a ScaleRL run: the one place launch/xm_launch.py and launch/gke/render.py read.

Three jobs, sized from the config (PAPER_NOTES §4: 80 GB200 per run, 16 training + 64 generating):
  learner     `python -m scalerl_jax.main` on `train_chips` accelerators (TPU v5p slice or GPU hosts)
  generators  the vLLM fleet: `generator.num_workers` GPUs, `tensor_parallel` GPUs per vLLM engine
  buffer      the gRPC rollout buffer (scalerl_jax.buffer.server), CPU only, auth token Secret

Launch knobs are not in scalerl_jax/config/; an optional `config.launch` ConfigDict overrides
`LAUNCH_DEFAULTS` key by key (and the xm_launch / render flags override both).

One run config for every pod: `resolve` turns the config file + the learner layout that fits the
learner's hosts x chips + the launch's data / checkpoint / generator settings + the user's
`config_overrides` ("key=value") into ONE resolved config (the recipe applied once and marked
`recipe_applied`). The GKE renderer ships it as the ConfigMap `RUN_CONFIG_NAME` (a `get_config()`
file, `run_config_text`) that every pod mounts at RUN_CONFIG_MOUNT and reads: the learner as
`--config=RUN_CONFIG_PATH:LAYOUT` (the file refuses another layout), the generators as
`--run_config=RUN_CONFIG_PATH`, the prompt export as `--config=RUN_CONFIG_PATH`; the buffer's
flags come from it. Without a ConfigMap (xm_launch) every config-reading command carries the
same `--config.key=value` overrides instead.
"""
from __future__ import annotations

import copy
import posixpath
import pprint
from typing import Any

from launch import sizing
from scalerl_jax import config as run_config
from scalerl_jax import recipes
from scalerl_jax import topologies
from scalerl_jax.processes import buffer_flags

BUFFER_PORT = 50051
VLLM_PORT = 8000
COORDINATOR_PORT = 8476
WEIGHTS_PORT = 50052                 # each learner pod's WeightSource (config.weights.port)
RELAY_PORT = 50053                   # each generator pod's weight relay (config.weights.relay_port)
WEIGHTS_BULK_PORT = 50054            # the learner WeightSource's bulk channel (config.weights.bulk_port)
RELAY_BULK_PORT = 50055              # the relay's bulk channel (config.weights.relay_bulk_port)
WAL_MOUNT = "/wal"                   # the buffer pod's write-ahead log volume (a PVC: local disk)
PROMPTS_FILE = "/prompts/prompts.jsonl"
ALIVE_FILE = "/tmp/scalerl/alive"     # a generator's heartbeat thread touches it (liveness probe)
PROGRESS_FILE = "/tmp/scalerl/progress"   # a learner's steps / the buffer's WAL commits and leases touch it
# The node's start-checkpoint copy (scalerl_jax/node_cache.py): a hostPath shared by the node's
# generator pods, mounted at generator.ckpt_cache_dir.
CKPT_CACHE_HOST_PATH = "/var/lib/scalerl/ckpt-cache"
CKPT_CACHE_MOUNT = "/scalerl-ckpt-cache"
# Downward-API values a pod gets from Kubernetes (renderers turn them into `fieldRef` env vars).
FIELD_POD_IP = "status.podIP"
FIELD_COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"
# The resolved run config (a ConfigMap every pod mounts read-only) and the data volume.
RUN_CONFIG_NAME = "run-config"
RUN_CONFIG_MOUNT = "/etc/scalerl/run"
RUN_CONFIG_FILE = "run_config.py"
RUN_CONFIG_PATH = f"{RUN_CONFIG_MOUNT}/{RUN_CONFIG_FILE}"
DATA_MOUNT = "/data"                 # the read-only data PVC: prompts, tokenizer, start checkpoint
ROLES = ("learner-tpu", "learner-gpu", "vllm", "buffer")
SECRET_NAME = "scalerl-buffer-token"
SECRET_KEY = "token"
# TLS (docs/ROLLOUT.md "TLS"): one certificate for every gRPC server of the run (the buffer service
# and the learner pods' weight sources, dialed by pod IP), its key and the CA, from one Secret
# mounted read-only in every pod; clients check the buffer service's DNS name in the certificate
# (config.tls.server_name), so the certificate needs just that name as a SAN.
TLS_SECRET_NAME = "scalerl-tls"
TLS_MOUNT = "/etc/scalerl/tls"
TLS_FILES = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}

# Accelerator platforms, by launch target name, from the one table of them
# (topologies.ACCELERATORS: the hardware and what a cluster needs to know of one host).
PLATFORMS: dict[str, dict[str, Any]] = {
    name: dict(kind=a.kind, topology_prefix=a.prefix, hbm_bytes=a.hbm_bytes, **a.cluster)
    for name, a in topologies.ACCELERATORS.items()
}

LAUNCH_DEFAULTS: dict[str, Any] = dict(
    name="scalerl",
    namespace="default",
    learner_platform="tpu-v5p",        # tpu-v5p | gpu-h100 | gpu-gb200
    generator_platform="gpu-gb200",    # vLLM needs GPUs
    train_chips=16,
    tensor_parallel=0,                 # GPUs per vLLM engine; 0 = by model preset (see TP_BY_PRESET)
    image_prefix="us-docker.pkg.dev/PROJECT/scalerl",
    image_tag="0.1.0",
    workdir="gs://BUCKET/scalerl/run",
    data_pvc="scalerl-data",           # read-only volume (at DATA_MOUNT) with config.data.path,
                                       # data.tokenizer_path and model.hf_checkpoint
    data="",                           # config.data.path ("" = keep the config's): DATA_MOUNT/... or gs://
    tokenizer="",                      # config.data.tokenizer_path ("" = keep the config's)
    checkpoint="",                     # config.model.hf_checkpoint: start weights, DATA_MOUNT/... or gs://
    layout="",                         # learner layout (config.layouts); "" = the one for the chips
    images={},                         # {role: full image reference}, overrides prefix/tag per role
    config_overrides=(),               # "key=value" config overrides, applied for EVERY pod
    run_config="file",                 # "configmap": pods read RUN_CONFIG_PATH (GKE); "file":
                                       # config_file + the overrides on every command (xm_launch)
    wal_storage="200Gi",               # the buffer's WAL PVC (ReadWriteOnce; survives pod restarts)
    service_account="scalerl",         # Kubernetes SA of learner + buffer pods (Workload Identity:
                                       # read/write the gs:// workdir)
    config_file="configs/8b.py",
    tls=True,                          # TLS on every gRPC channel, certificates from TLS_SECRET_NAME
)
# vLLM tensor parallelism per engine: bf16 weights + KV cache must fit.
TP_BY_PRESET = {"llama3_8b": 1, "llama4_scout_17b_16e": 4}


def _launch_settings(config, overrides: dict | None) -> dict:
  s = copy.deepcopy(LAUNCH_DEFAULTS)
  if "launch" in config:
    s.update(dict(config.launch))
  s.update({k: v for k, v in (overrides or {}).items() if v is not None})
  unknown = sorted(set(s) - set(LAUNCH_DEFAULTS))
  if unknown:
    raise ValueError(f"unknown launch settings {unknown}; known: {sorted(LAUNCH_DEFAULTS)}")
  bad_roles = sorted(set(s["images"] or {}) - set(ROLES))
  if bad_roles:
    raise ValueError(f"--image {bad_roles[0]}=...: unknown image role; roles: {ROLES}")
  if s["run_config"] not in ("file", "configmap"):
    raise ValueError(f"run_config={s['run_config']!r}; expected 'file' or 'configmap'")
  if "://" in str(s["tokenizer"]):
    raise ValueError(f"--tokenizer={s['tokenizer']} must be a path on the data volume (e.g. "
                     f"{DATA_MOUNT}/tokenizer): the tokenizer is loaded from a local directory")
  for key in ("learner_platform", "generator_platform"):
    if s[key] not in PLATFORMS:
      raise ValueError(f"{key}={s[key]!r}; expected one of {sorted(PLATFORMS)}")
  if PLATFORMS[s["generator_platform"]]["kind"] != "gpu":
    raise ValueError("generator_platform must be a GPU platform (vLLM)")
  return s


def image(s: dict, role: str) -> str:
  """Container image for `role` in {learner-tpu, learner-gpu, vllm, buffer}."""
  if (s.get("images") or {}).get(role):
    return s["images"][role]
  return f"{s['image_prefix']}/scalerl-jax-{role}:{s['image_tag']}"


def layout_platform(topology: str) -> str | None:
  """The PLATFORMS key a topology name (scalerl_jax.topologies) runs on, e.g. gb200_16 -> gpu-gb200."""
  a = topologies.accelerator_of(topology)
  return a.name if a else None


def pick_layout(config, platform: str, chips: int) -> str:
  """The learner layout of `config.layouts` for `chips` accelerators of `platform`: the one named
  after its topology first (gb200_16 before a variant like h100_16_fsdp); ValueError if none."""
  if "layouts" not in config:
    raise ValueError("config has no `layouts` (configs/8b.py, configs/scout.py have them)")
  fit = [n for n, l in config.layouts.items()
         if layout_platform(str(l.topology)) == platform
         and topologies.get_topology(str(l.topology)).num_devices == chips]
  if not fit:
    raise ValueError(f"no layout in config.layouts for {chips} {platform} chips; has "
                     f"{sorted(config.layouts)} (knob: --layout / --train_chips)")
  return sorted(fit, key=lambda n: (n != str(config.layouts[n].topology), n))[0]


def resolve_run_config(config, s: dict, tensor_parallel: int) -> tuple[Any, list[str]]:
  """The ONE run config every pod reads (module docstring): layout, launch settings, overrides,
  the recipe applied once. Returns (config, the `--config.k=v` overrides it was built with)."""
  config = copy.deepcopy(config)
  layout = s["layout"]
  if layout:
    topologies.apply_layout(config, layout)
    topo = topologies.get_topology(str(config.topology))
    if (layout_platform(topo.name) != s["learner_platform"]
        or topo.num_devices != int(s["train_chips"])):
      raise ValueError(f"layout {layout} is for {topo.num_devices} {layout_platform(topo.name)} "
                       f"devices, the learner has {s['train_chips']} {s['learner_platform']} "
                       "(knob: --layout / --learner_platform / --train_chips)")
  over = []
  for key, value in (("data.path", s["data"]), ("data.tokenizer_path", s["tokenizer"]),
                     ("model.hf_checkpoint", s["checkpoint"]),
                     ("generator.tensor_parallel", tensor_parallel),
                     # liveness from progress: each pod's own file (scalerl_jax/progress.py)
                     ("learner.progress_file", PROGRESS_FILE), ("buffer.progress_file", PROGRESS_FILE)):
    if value not in ("", None):
      over.append(f"--config.{key}={value}")
  for kv in s["config_overrides"] or ():
    key, sep, value = str(kv).partition("=")
    if not sep:
      raise ValueError(f"config override {kv!r}: expected key=value (knob: --override)")
    over.append(f"--config.{key.removeprefix('--config.')}={value}")
  config = run_config.resolve_config(config, over)   # as main resolves: overrides, recipe, layout
  config.recipe_applied = config.recipe
  recipes.validate(config)
  return config, over


def run_config_text(config, header: str = "") -> str:
  """The resolved config as a `get_config(arg)` Python file (what main's --config, the generator
  worker's --run_config and data.export --config load); `arg`, when given, must be its layout."""
  body = pprint.pformat(config.to_dict(), width=100, sort_dicts=False)
  layout = str(config.get("layout", ""))
  return (f'"""{header or "Resolved ScaleRL run config."} Every pod reads this file."""\n'
          "import ml_collections\n\n"
          f"LAYOUT = {layout!r}\n"
          f"CONFIG = {body}\n\n\n"
          "def get_config(arg=None):\n"
          "  if arg and arg != LAYOUT:\n"
          "    raise ValueError(f'this run config was resolved for learner layout {LAYOUT!r}, '\n"
          "                     f'the command names {arg!r}: re-render (launch.gke.render --layout)')\n"
          "  return ml_collections.ConfigDict(CONFIG)\n")


def _tls_spec(buffer_addr: str) -> dict:
  """The TLS Secret, its mount and each role's TLS arguments (`--tls` renders)."""
  paths = {k: f"{TLS_MOUNT}/{f}" for k, f in TLS_FILES.items()}
  server_name = buffer_addr.rpartition(":")[0]
  return {"secret": TLS_SECRET_NAME, "mount": TLS_MOUNT, "files": dict(TLS_FILES),
          "server_name": server_name,
          "learner_args": [f"--config.tls.{k}={v}" for k, v in paths.items()] +
                          [f"--config.tls.server_name={server_name}"],
          "generator_args": [f"--tls_{k}={v}" for k, v in paths.items()] +
                            [f"--tls_server_name={server_name}"],
          "buffer_args": [f"--tls-{k}={v}" for k, v in paths.items()]}


def _learner_distribution(lp: dict, name: str, hosts: int, layout: str, run_cfg):
  """(learner arguments, env, downward-API env) for jax.distributed on the learner's platform: a
  TPU slice auto-detects its hosts; GPU hosts get the coordinator (pod 0), count and index."""
  learner_env, learner_fields = {}, {"POD_IP": FIELD_POD_IP}
  if lp["kind"] == "tpu":     # jax.distributed.initialize() auto-detects the slice's hosts
    dist_args = ["--config.distributed.auto=True"]
  else:                       # GPU hosts: explicit coordinator (pod 0), count, index (scalerl_jax/distributed.py)
    dist_args = []
    learner_env.update({"SCALERL_COORDINATOR": f"{name}-learner-learner-0-0.{name}-learner:"
                                                f"{COORDINATOR_PORT}",
                        "SCALERL_NUM_PROCESSES": str(hosts)})
    learner_fields["SCALERL_PROCESS_ID"] = FIELD_COMPLETION_INDEX
    # The memory plans (tools/plan.py, topologies.usable_bytes) assume this share of HBM.
    if layout:
      frac = topologies.get_topology(str(run_cfg.topology)).usable_fraction
      learner_env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{frac:g}"
  return dist_args, learner_env, learner_fields


def _learner_job(s: dict, lp: dict, run_cfg, chips: int, hosts: int, topology, args: list[str],
                 tls_args: list[str], learner_env: dict, learner_fields: dict,
                 token_env: str) -> dict:
  """The learner JobSet's spec: one `scalerl_jax.main` per host."""
  name, workdir = s["name"], s["workdir"]
  learner_role = "learner-tpu" if lp["kind"] == "tpu" else "learner-gpu"
  return {
      "name": f"{name}-learner", "platform": s["learner_platform"],
      "image": image(s, learner_role), "accelerator_resource": lp["resource"],
      "chips": chips, "hosts": hosts, "chips_per_host": lp["chips_per_host"],
      "tpu_topology": topology, "node_selector": dict(lp["node_selector"]),
      "machine_type": lp["machine_type"], "arch": lp["arch"], "cpu": lp["cpu"], "memory": lp["memory"],
      "coordinator_port": COORDINATOR_PORT, "weights_port": WEIGHTS_PORT,
      "weights_bulk_port": WEIGHTS_BULK_PORT,
      # Every learner pod serves its own weight shards to the fleet (weights/source.py):
      # it listens on all interfaces and advertises its pod IP ($(POD_IP): Kubernetes expands
      # it from the env var the downward API sets).
      "command": ["python", "-m", "scalerl_jax.main", *args,
                  "--config.buffer.external=True", "--config.weights.host=0.0.0.0",
                  f"--config.weights.port={WEIGHTS_PORT}",
                  f"--config.weights.bulk_port={WEIGHTS_BULK_PORT}",
                  "--config.weights.advertise=$(POD_IP)", *tls_args,
                  f"--workdir={workdir}"],
      "progress_file": PROGRESS_FILE,
      "progress_max_age_s": float(run_cfg.learner.progress_max_age_s),
      # SIGTERM -> SIGKILL window: the learner's final-checkpoint decision uses the same number
      "termination_grace_s": float(run_cfg.checkpoint.termination_grace_s),
      "env": learner_env, "field_env": learner_fields,
      "secret_env": {token_env: [SECRET_NAME, SECRET_KEY]},
      "service_account": s["service_account"],
  }


def _generator_job(s: dict, gp: dict, run_cfg, gen_gpus: int, tp: int, cfg_path: str,
                   cfg_over: list[str], buffer_addr: str, tls_args: list[str],
                   token_env: str) -> dict:
  """The generator Deployment's spec: one vLLM engine per pod of `tp` GPUs."""
  name = s["name"]
  gen_mem = sizing.generator_memory_request_gib(run_cfg)
  return {
      "name": f"{name}-vllm", "platform": s["generator_platform"], "image": image(s, "vllm"),
      "accelerator_resource": gp["resource"], "gpus": gen_gpus, "tensor_parallel": tp,
      "replicas": gen_gpus // tp, "gpus_per_replica": tp,
      "node_selector": dict(gp["node_selector"]), "machine_type": gp["machine_type"],
      "arch": gp["arch"],
      # Host memory: the weight versions a generator holds + its start-up export (sizing.py).
      "cpu": str(8 * tp), "memory": f"{gen_mem}Gi", "port": VLLM_PORT,
      "ephemeral_storage": f"{sizing.generator_disk_bytes(run_cfg)['request_gib']}Gi",
      "alive_file": ALIVE_FILE, "relay_port": RELAY_PORT, "relay_bulk_port": RELAY_BULK_PORT,
      "ckpt_cache_mount": CKPT_CACHE_MOUNT, "ckpt_cache_host_path": CKPT_CACHE_HOST_PATH,
      # One vLLM engine per pod; generator id = pod name; run config = the resolved one.
      "command": ["python", "-m", "scalerl_jax.generation.worker", f"--run_config={cfg_path}",
                  *cfg_over, f"--buffer={buffer_addr}", "--backend=vllm",
                  "--workdir=/tmp/scalerl", f"--alive_file={ALIVE_FILE}",
                  # The weight relay (weights/relay.py): same token and TLS, pod IP advertised.
                  f"--config.weights.relay_port={RELAY_PORT}",
                  f"--config.weights.relay_bulk_port={RELAY_BULK_PORT}",
                  "--config.weights.relay_advertise=$(POD_IP)",
                  f"--config.generator.ckpt_cache_dir={CKPT_CACHE_MOUNT}",
                  *tls_args],
      "env": {}, "field_env": {"POD_IP": FIELD_POD_IP}, "secret_env": {token_env: [SECRET_NAME, SECRET_KEY]},
      "service_account": s["service_account"],   # gs:// data / start checkpoint
  }


def _buffer_job(s: dict, run_cfg, cfg_path: str, cfg_over: list[str], buffer_addr: str,
                tls_args: list[str], token_env: str) -> dict:
  """The buffer Deployment's spec: the prompt export (init container) and the buffer server."""
  name, workdir = s["name"], s["workdir"]
  return {
      "name": f"{name}-buffer", "image": image(s, "buffer"), "port": BUFFER_PORT,
      "address": buffer_addr, "cpu": "8", "memory": "32Gi", "prompts_file": PROMPTS_FILE,
      "export_command": ["python", "-m", "scalerl_jax.data.export", f"--config={cfg_path}",
                         *cfg_over, f"--out={PROMPTS_FILE}"],
      # The same flags main passes when it starts the buffer itself (processes.buffer_flags): the
      # run config every pod reads, WAL on the pod's volume, the learner-state file in the workdir.
      "command": ["python", "-m", "scalerl_jax.buffer.server",
                  *buffer_flags(run_cfg, run_file=cfg_path, overrides=cfg_over, prompts=PROMPTS_FILE,
                                host="0.0.0.0", port=BUFFER_PORT,
                                wal_dir=WAL_MOUNT,
                                learner_state=posixpath.join(workdir, "learner_state.json"),
                                tls=tls_args)],
      "wal_mount": WAL_MOUNT, "wal_storage": s["wal_storage"],
      "progress_file": PROGRESS_FILE,
      "progress_max_age_s": float(run_cfg.buffer.progress_max_age_s),
      "env": {}, "field_env": {}, "secret_env": {token_env: [SECRET_NAME, SECRET_KEY]},
      "service_account": s["service_account"],
  }


def resolve(config, overrides: dict | None = None) -> dict:
  """The three job specs (plain JSON-able dicts) for `config` (+ launch overrides), and the one
  resolved run config they all read (`run_config`)."""
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
  if "layouts" in config and not s["layout"]:
    s["layout"] = pick_layout(config, s["learner_platform"], chips)
  run_cfg, run_over = resolve_run_config(config, s, tp)
  layout = str(run_cfg.get("layout", ""))
  name = s["name"]
  buffer_addr = f"{name}-buffer.{s['namespace']}.svc.cluster.local:{BUFFER_PORT}"
  cfg_file = s["config_file"]
  if s["run_config"] == "configmap":     # every pod mounts the resolved config
    cfg_path, cfg_over = RUN_CONFIG_PATH, []
  else:                                  # every config-reading command carries the overrides
    cfg_path, cfg_over = cfg_file, list(run_over)
  learner_cfg = f"{cfg_path}:{layout}" if layout else cfg_path
  token_env = config.buffer.auth_token_env
  common_args = [f"--config={learner_cfg}", *cfg_over, f"--config.buffer.address={buffer_addr}"]
  tls = _tls_spec(buffer_addr) if s["tls"] else None
  tls_args = lambda role: list(tls[f"{role}_args"]) if tls else []
  dist_args, learner_env, learner_fields = _learner_distribution(lp, name, hosts, layout, run_cfg)
  return {
      "name": name,
      "namespace": s["namespace"],
      "config_file": cfg_file,
      "layout": layout,
      "config_overrides": list(run_over),
      "model_preset": config.model.preset,
      "total_chips": chips + gen_gpus,
      "run_config": {"name": RUN_CONFIG_NAME, "mount": RUN_CONFIG_MOUNT, "file": RUN_CONFIG_FILE,
                     "path": RUN_CONFIG_PATH, "mode": s["run_config"],
                     "text": run_config_text(run_cfg, f"GENERATED by launch.spec.resolve from "
                                                      f"{cfg_file} (learner {s['learner_platform']} "
                                                      f"layout {layout}): the resolved run config.")},
      "learner": _learner_job(s, lp, run_cfg, chips, hosts, topology,
                              [*common_args, *dist_args], tls_args("learner"), learner_env,
                              learner_fields, token_env),
      "generators": _generator_job(s, gp, run_cfg, gen_gpus, tp, cfg_path, cfg_over, buffer_addr,
                                   tls_args("generator"), token_env),
      "buffer": _buffer_job(s, run_cfg, cfg_path, cfg_over, buffer_addr, tls_args("buffer"),
                            token_env),
      "secret": {"name": SECRET_NAME, "key": SECRET_KEY, "env": token_env},
      "tls": tls,
      "data_pvc": s["data_pvc"],
      "data_mount": DATA_MOUNT,
  }


def load_config(path: str, arg: str | None = None) -> Any:
  """A preset's ConfigDict, `get_config(arg)` of the config file at `path` (the resolver's
  loader, no absl flags needed)."""
  return run_config.load_preset(f"{path}:{arg}" if arg else path)[0]
