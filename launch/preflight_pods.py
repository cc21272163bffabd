"""launch.preflight's checks of the generator, buffer and learner pods beside the config: the vLLM
KV cache, the weight push and sync rates, each pod's memory request, volumes, liveness probes
(launch/preflight.py's docstring lists them). Each failure is one `Report.fail` line."""
from __future__ import annotations

import inspect

from launch import sizing
from launch import spec as spec_lib
from launch.sizing import GIB
from scalerl_jax.data import mixture
from scalerl_jax.generation.vllm import engine
from scalerl_jax.generation.vllm.generator import VLLMGenerator
from scalerl_jax.progress import probe_command

GB = 1e9
# A pod's node-selector value -> its launch target (from the one accelerator table).
ACCELERATOR_OF_SELECTOR = {v: name for name, p in spec_lib.PLATFORMS.items()
                           for v in p["node_selector"].values()}


def pod_spec(doc):
  """The pod template of a JobSet (its first replicated job) or a Deployment."""
  if doc["kind"] == "JobSet":
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  return doc["spec"]["template"]["spec"]


class Report:
  """Failure and info lines of one variant."""

  def __init__(self, variant: str):
    self.variant, self.failures, self.infos = variant, [], []

  def fail(self, msg: str, knob: str) -> None:
    """One failure line: what, the number, the knob."""
    self.failures.append(f"FAIL {self.variant}: {msg} (knob: {knob})")

  def info(self, msg: str) -> None:
    """One info line."""
    self.infos.append(f"  {self.variant}: {msg}")



def check_progress_probe(r: Report, who: str, c, section) -> None:
  """Liveness from progress: the learner's / buffer's liveness probe checks the age of the
  progress file its process touches (`section.progress_file`, scalerl_jax/progress.py) against
  `section.progress_max_age_s`; a port probe passes a process stuck in a collective or on a full
  WAL disk."""
  if not c.get("livenessProbe"):
    return   # check_probe said so
  want = probe_command(section.progress_file, section.progress_max_age_s) if section.progress_file else None
  got = c["livenessProbe"].get("exec", {}).get("command")
  if want is None or got != want:
    r.fail(f"{who} liveness is not from progress: its probe should be {want or 'an exec probe'} on "
           f"{who}.progress_file "
           f"({section.progress_file!r}, max age {section.progress_max_age_s:g} s), got {got}",
           "launch/gke/render.py _progress_probe")


def check_generators(r: Report, v, gcfg, gpod, gc) -> None:
  """vLLM: TP vs GPUs per pod, and the KV cache vs max_num_seqs sequences of max_model_len."""
  gplat = next((ACCELERATOR_OF_SELECTOR[x] for x in gpod.get("nodeSelector", {}).values()
                if x in ACCELERATOR_OF_SELECTOR), None)
  gpus = int(gc["resources"]["limits"].get("nvidia.com/gpu", 0))
  tp = int(gcfg.generator.tensor_parallel or 1)
  if tp != gpus:
    r.fail(f"generator.tensor_parallel {tp} != {gpus} GPUs per generator pod",
           "launch.gke.render (generator.tensor_parallel)")
  if gplat is None or spec_lib.PLATFORMS[gplat]["kind"] != "gpu":
    r.fail("generator pods select no GPU node pool", "generator_platform")
    return
  defaults = {k: p.default for k, p in inspect.signature(VLLMGenerator).parameters.items()
              if p.default is not inspect.Parameter.empty}
  args = dict(defaults)
  args.update(engine.vllm_args(gcfg.generator))
  kv_bytes = args.get("kv_cache_bytes")
  seqs = int(args.get("max_num_seqs", 256))
  probe = gcfg.copy_and_resolve_references()
  probe.generator.kv_cache_bytes = int(kv_bytes or 0) // tp
  probe.generator.gpu_memory_utilization = float(args.get("gpu_memory_utilization", 0.9) or 0.9)
  probe.generator.decode_batch = seqs
  kv = sizing.kv_cache(probe, spec_lib.PLATFORMS[gplat]["hbm_bytes"], tp)
  how = (f"kv_cache_bytes={kv_bytes}" if kv["explicit"] else
         f"gpu_memory_utilization={kv['gpu_memory_utilization']:g} of {tp} x "
         f"{spec_lib.PLATFORMS[gplat]['hbm_bytes'] / GB:.0f} GB")
  if kv["fits_seqs"] < seqs:
    r.fail(f"vLLM KV cache {kv['capacity'] / sizing.GIB:.1f} GiB ({how}) holds {kv['fits_seqs']} of "
           f"max_num_seqs={seqs} sequences of {kv['max_model_len']} tokens "
           f"({kv['per_seq'] / sizing.GIB:.2f} GiB each)",
           "generator.decode_batch / gpu_memory_utilization / kv_cache_bytes")
  else:
    r.info(f"vLLM KV cache {kv['capacity'] / sizing.GIB:.1f} GiB ({how}) holds {kv['fits_seqs']} >= "
           f"{seqs} sequences of {kv['max_model_len']} tokens")


def check_sync(r: Report, cfg, learner_hosts: int, num_devices: int, peak_flops: float,
               rates: dict | None = None) -> dict:
  """Seconds per weight version (sizing.sync_seconds: the measured or given per-stream rate, the
  NIC cap, relay fan-out, delta fraction) against the learner step at sizing.STEP_MFU of its
  peak FLOPs: a version that takes longer than a step fails, naming the numbers and the knobs."""
  rates = rates or sizing.sync_rates()
  n = sizing.model_numbers(cfg)["params"]
  model = n * sizing.wire_bytes_per_param(cfg)
  w = cfg.weights
  gens = int(cfg.generator.num_workers) // max(1, int(cfg.generator.tensor_parallel or 1))
  fan = int(w.get("relay_fanout", 0))
  delta_on = bool(w.get("delta", False)) and sizing.wire_bytes_per_param(cfg) == 2
  sec = {k: sizing.sync_seconds(model, gens, learner_hosts, fan, d, rates["stream"])
         for k, d in (("delta", rates["delta"]), ("full", 1.0))}
  step = sizing.step_seconds(cfg, num_devices, peak_flops) if peak_flops else float("inf")
  every = max(1, int(w.get("delta_full_every", 1)))
  # With deltas, every `delta_full_every`-th version goes out full: the mean over that cycle.
  now = (((every - 1) * sec["delta"] + sec["full"]) / every) if delta_on else sec["full"]
  msg = (f"weight sync {now:.1f} s per version ({f'delta, full every {every}' if delta_on else 'full'}; "
         f"a delta {sec['delta']:.1f} s, a full version {sec['full']:.1f} s) for {gens} generators, relay fan-out "
         f"{fan}, {learner_hosts} learner hosts, {model / GB:.1f} GB on the wire, stream "
         f"{rates['stream'] / GB:.2f} GB/s ({rates['label']}), delta fraction {rates['delta']:.3f}, "
         f"NIC {sizing.PUSH_BANDWIDTH / GB:.1f} GB/s; learner step {step:.1f} s at "
         f"{sizing.STEP_MFU:.0%} MFU")
  if now > step:
    need = now / step * rates["stream"]
    r.fail(f"{msg}: sync slower than a step (it would pass at a stream rate of "
           f"{need / GB:.2f} GB/s)", "weights.relay_fanout / weights.delta / "
           "weights.delta_full_every / learner hosts (sources) / generator.num_workers")
  else:
    r.info(msg)
  return dict(sec, step=step, now=now)


def check_push(r: Report, cfg, learner_hosts: int) -> None:
  """The weight push: bytes per parameter (target 2) and seconds at PUSH_BANDWIDTH."""
  p = sizing.push(cfg)
  reps = int(cfg.generator.num_workers) // max(1, int(cfg.generator.tensor_parallel or 1))
  fleet_s = reps * p["bytes"] / (max(1, learner_hosts) * p["bandwidth"])
  msg = (f"weight push {p['bytes_per_param']} bytes/param = {p['bytes'] / GB:.1f} GB per "
         f"generator, {p['seconds']:.1f} s at {p['bandwidth'] / GB:.1f} GB/s; {reps} generators "
         f"from {learner_hosts} learner pods: {fleet_s:.0f} s")
  if p["bytes_per_param"] != sizing.TARGET_WIRE_BYTES:
    r.fail(f"{msg}; target {sizing.TARGET_WIRE_BYTES} bytes/param (bf16 on the wire)",
           "weights.wire_dtype (config.wire_dtype)")
  else:
    r.info(msg)


def request_bytes(c) -> int:
  q = c.get("resources", {}).get("requests", {}).get("memory")
  return sizing.parse_quantity(q) if q else 0


def check_generator_disk(r: Report, gcfg, gc) -> None:
  """The generator pod's ephemeral-storage request vs its checkpoint copy + HF export + logs
  (sizing.generator_disk_bytes). Node disk is not in scalerl_jax/topologies.py: sized only."""
  need = sizing.generator_disk_bytes(gcfg)
  q = gc.get("resources", {}).get("requests", {}).get("ephemeral-storage")
  have = sizing.parse_quantity(q) if q else 0
  msg = (f"generator ephemeral-storage request {have / GIB:.0f} GiB (checkpoint copy "
         f"{need['copy'] / GIB:.0f} GiB + HF export {need['export'] / GIB:.0f} GiB + logs "
         f"{need['logs'] / GIB:.0f} GiB = {need['total'] / GIB:.0f} GiB); node cache copy "
         f"{need['node_copy'] / GIB:.0f} GiB once per node (node disk not in topologies.py)")
  if have < need["total"]:
    r.fail(f"{msg}: below what the pod writes", "launch.gke.render (re-render)")
  else:
    r.info(msg)


def check_pod_memory(r: Report, v, cfg, gcfg, lc, platform, hosts, chips, bc) -> None:
  """Memory requests of generator, learner and buffer pods vs what they hold (sizing.py)."""
  if gcfg is not None:
    gpod = pod_spec(v.gen_dep)
    gc = gpod["containers"][0]
    need = sizing.generator_host_bytes(gcfg)
    have = request_bytes(gc)
    gplat = next((ACCELERATOR_OF_SELECTOR[x] for x in gpod.get("nodeSelector", {}).values()
                  if x in ACCELERATOR_OF_SELECTOR), None)
    what = (f"{need['versions']} weight versions + relay copy {need['steady'] / GIB:.0f} GiB / "
            f"start-up version + export {need['start'] / GIB:.0f} GiB + vLLM")
    ok = have >= need["total"]
    if not ok:
      r.fail(f"generator memory request {have / GIB:.0f} GiB < {need['total'] / GIB:.0f} GiB it "
             f"holds ({what})", "generator.eval_hold_versions / weights.wire_dtype / the pod "
             "memory (launch/sizing.py)")
    if gplat:
      p = spec_lib.PLATFORMS[gplat]
      gpus = int(gc["resources"]["limits"].get("nvidia.com/gpu", 1))
      share = sizing.parse_quantity(p["memory"]) * gpus // p["chips_per_host"]
      if have > share:
        ok = False
        r.fail(f"generator memory request {have / GIB:.0f} GiB > {share / GIB:.0f} GiB, the "
               f"{p['machine_type']} node's share for {gpus} GPUs ({what})",
               "generator.eval_hold_versions / weights.wire_dtype")
      elif ok:
        r.info(f"generator pod memory {have / GIB:.0f} GiB >= {need['total'] / GIB:.0f} GiB "
               f"({what}), <= node share {share / GIB:.0f} GiB")
  # learner: this process's state shard (fp32 params + Adam moments) staged on the host for an
  # async checkpoint, its weight-source shards (two versions), 16 GiB of runtime (the start
  # checkpoint's load is not counted: models/sections.py::model_config reads only its config.json today)
  n = sizing.model_numbers(cfg)["params"]
  need_l = (n * 12 + 2 * n * sizing.wire_bytes_per_param(cfg)) // max(1, hosts) + 16 * GIB
  have_l = request_bytes(lc)
  if have_l < need_l:
    r.fail(f"learner memory request {have_l / GIB:.0f} GiB < {need_l / GIB:.0f} GiB (state shard + "
           f"weight-source shards)", "learner pod memory (spec.PLATFORMS)")
  need_b = sizing.buffer_host_bytes(cfg)
  have_b = request_bytes(bc)
  if have_b < need_b:
    r.fail(f"buffer memory request {have_b / GIB:.0f} GiB < {need_b / GIB:.0f} GiB (rollouts of "
           f"max_lag + 2 steps)", "buffer pod memory / rollout.max_lag")


def mounted(path: str, pod, c, kinds=("persistentVolumeClaim", "configMap", "secret", "csi",
                                        "nfs", "hostPath")) -> bool:
  vols = {v["name"]: v for v in pod.get("volumes", [])}
  for m in c.get("volumeMounts", []):
    mp = m["mountPath"].rstrip("/")
    if (path == mp or path.startswith(mp + "/")) and any(k in vols.get(m["name"], {})
                                                          for k in kinds):
      return True
  return False


def check_volumes(r: Report, cfg, pod, c, who: str, workdir, data_only: bool = False,
                  report_unset: bool = False) -> None:
  """Every path `who` opens is set (reported once: `report_unset`), local, and on a mounted
  volume of its pod; the learner's workdir is gs:// or mounted."""
  builtin = ("synthetic", "tiny_code")
  tasks = [("data", cfg.data)]
  try:
    mix = mixture.parse_mixture(cfg.data)
  except ValueError:
    mix = []
  if mix:
    tasks = [(f"data.tasks.{n}", cfg.data.tasks[n]) for n, _ in mix]
  paths = []
  real = False
  for prefix, t in tasks:
    if t.kind in builtin:
      continue
    real = True
    paths += [(f"{prefix}.path", t.path), (f"{prefix}.tokenizer_path", t.tokenizer_path)]
  if not data_only:
    if real:
      paths.append(("model.hf_checkpoint", cfg.model.hf_checkpoint))
    if who == "generator" and cfg.generator.get("vllm_model_dir"):
      paths.append(("generator.vllm_model_dir", cfg.generator.vllm_model_dir))
  unmounted = []
  for knob, path in paths:
    path = str(path or "")
    if not path:
      if not report_unset:
        continue
      what = ("no start checkpoint: the run's model would be the preset's" if
              knob == "model.hf_checkpoint" else "nothing to read")
      r.fail(f"{who}: {knob} is empty ({what})", f"launch.gke.render --data / --tokenizer / "
             f"--checkpoint ({knob})")
    elif path.startswith("gs://") and knob.endswith((".path", "hf_checkpoint")):
      if not pod.get("serviceAccountName"):   # read through scalerl_jax.storage: credentials
        r.fail(f"{who}: {knob}={path} needs GCS credentials; the {who} pod has no service account",
               "launch.gke.render (serviceAccountName: Workload Identity)")
    elif "://" in path:
      r.fail(f"{who}: {knob}={path} is not a local path (loaded from a local directory)",
             f"{knob} on the data volume ({spec_lib.DATA_MOUNT})")
    elif not mounted(path, pod, c):
      unmounted.append(f"{knob}={path}")
  if unmounted:
    r.fail(f"{who}: {', '.join(unmounted)} {'is' if len(unmounted) == 1 else 'are'} on no volume "
           f"the {who} pod mounts", f"the data volume (launch.gke.render --data_pvc, mounted at "
           f"{spec_lib.DATA_MOUNT})")
  if workdir is not None and not workdir.startswith("gs://") and not mounted(workdir, pod, c):
    r.fail(f"{who}: workdir {workdir} is neither gs:// nor on a mounted volume (lost on restart)",
           "launch.gke.render --workdir")


def check_probe(r: Report, who: str, c) -> None:
  """A liveness probe, on a port the container declares when it is a TCP probe."""
  p = c.get("livenessProbe")
  if not p:
    r.fail(f"{who} container {c['name']} has no livenessProbe (a hung process is never restarted)",
           "launch/gke/render.py probes")
    return
  if "tcpSocket" in p:
    port = p["tcpSocket"]["port"]
    ports = {x.get("name") for x in c.get("ports", [])}
    ports |= {x["containerPort"] for x in c.get("ports", [])}
    if port not in ports:
      r.fail(f"{who} livenessProbe port {port} is not a port of the container",
             "launch/gke/render.py probes")


# ---- memory plans --------------------------------------------------------------------------------
