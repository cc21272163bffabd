"""Preflight of rendered GKE manifests: will this run start and fit, from arithmetic alone?

  python -m launch.preflight launch/gke/rendered/8b-gb200 [DIR ...]   # or the rendered/ folder
  python -m launch.preflight --aot DIR        # compile the memory plan instead of the cached one
  python -m launch.preflight --aot --update-cache DIR                 # and remember it

Reads what `kubectl apply` gets (the YAML of a variant directory), rebuilds the run config each pod
reads (the `run-config` ConfigMap, or a config file + its command's overrides), and checks:

  config        every pod (learner, generators, prompt export, buffer flags) reads the same run
                config: an override on one command only reaches that pod
  layout        the learner layout's topology is the JobSet's platform and hosts x chips
  batch split   the batch splits evenly over the learner processes (topologies.process_row_spans,
                the rule distributed.MultiHostLearner applies), micro-batches over batch shards
  memory plan   the layout's memory plan was made at the learner's real pad length
                (runtime.train_seq_len, the tools.plan default) and fits: launch/plan_cache.json,
                or --aot: tools.plan compiled now (~10-20 s for 8B, minutes for Scout)
  XLA memory    GPU learner pods set XLA_PYTHON_CLIENT_MEM_FRACTION to the plan's usable fraction
  vLLM KV       each engine's KV cache (the engine args the generator worker really passes:
                generation.vllm.engine.vllm_args over VLLMGenerator's defaults) holds max_num_seqs
                sequences of max_model_len tokens (launch/sizing.py)
  weight push   bytes per parameter on the wire (target 2: bf16) and seconds at the stated bandwidth
  pod memory    each pod's memory request covers what it holds (sizing.py) and fits its node share
  volumes       data, tokenizer, start checkpoint (and vllm_model_dir) are set and lie on a mounted
                volume of every pod that opens them, or (data, checkpoint) on gs:// with a
                service account; the workdir is gs:// or mounted
  probes        learner, generators and buffer have a liveness probe on something they serve

Each failure is ONE line: `FAIL <variant>: <what> <number> (knob: <knob>)`; info lines start with
two spaces. Exit status 1 on any failure. Called by launch.gke.render after writing and by
launch.rehearse before starting pods.
"""
from __future__ import annotations

import argparse
import glob
import inspect
import json
import os
import shlex
import subprocess
import sys
import tempfile
from typing import Any

import ml_collections
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
  sys.path.insert(0, REPO)

from scalerl_jax.progress import probe_command  # noqa: E402
from launch import sizing  # noqa: E402
from launch import spec as spec_lib  # noqa: E402
from launch.sizing import GIB  # noqa: E402
from scalerl_jax import recipes, runtime, topologies  # noqa: E402
from scalerl_jax.data import mixture  # noqa: E402
from scalerl_jax.generation import worker_cli  # noqa: E402
from scalerl_jax.generation.vllm import engine  # noqa: E402
from scalerl_jax.generation.vllm.generator import VLLMGenerator  # noqa: E402
from scalerl_jax.processes import buffer_flags  # noqa: E402
from scalerl_jax.tools.plan import default_seq_len  # noqa: E402

PLAN_CACHE = os.path.join(REPO, "launch", "plan_cache.json")
GB = 1e9
# Keys a pod's command legitimately sets for its role (addresses, certificates, multi-host).
# generator.tensor_parallel: the generator command's --tensor_parallel may set it (older manifests).
# The learner layout's keys (apply_layout) shape only the learner's step.
WIRING = ("buffer.address", "buffer.external", "weights.", "tls.", "distributed.",
          "generator.tensor_parallel", "layout", "topology", "mesh.", "optim.microbatches",
          "model.remat", "model.scan_layers")
XLA_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
# A pod's node-selector value -> its launch target (from the one accelerator table).
ACCELERATOR_OF_SELECTOR = {v: name for name, p in spec_lib.PLATFORMS.items()
                           for v in p["node_selector"].values()}


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


# ---- reading the manifests -----------------------------------------------------------------------
def load_docs(d: str) -> list[dict]:
  """Every YAML document of a rendered directory."""
  docs = []
  for path in sorted(glob.glob(os.path.join(d, "*.yaml"))):
    with open(path) as f:
      docs += [x for x in yaml.safe_load_all(f) if x]
  return docs


def _pod_spec(doc):
  if doc["kind"] == "JobSet":
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  return doc["spec"]["template"]["spec"]


def _component(doc) -> str:
  return doc["metadata"].get("labels", {}).get("app.kubernetes.io/component", "")


def _flag(cmd, name, default=None):
  for a in cmd:
    if a.startswith(f"{name}="):
      return a.split("=", 1)[1]
  return default


def _config_arg(c) -> str:
  """A container's `--config=path[:arg]` (every pod that loads a run config is given one)."""
  path = _flag(c["command"], "--config")
  if path is None:
    raise ValueError(f"container {c.get('name')!r} has no --config= flag")
  return path


def _overrides(cmd):
  return [a for a in cmd if a.startswith("--config.")]


def _exec_config_text(text: str, arg: str | None):
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(text)
  try:
    return spec_lib.load_config(f.name, arg)
  finally:
    os.unlink(f.name)


class Variant:
  """One rendered directory: its documents and the run config each pod reads."""

  def __init__(self, d: str):
    self.dir, self.name = d, os.path.basename(os.path.normpath(d))
    self.docs = load_docs(d)
    by_kind = {}
    for doc in self.docs:
      by_kind.setdefault(doc["kind"], []).append(doc)
    self.configmaps = {c["metadata"]["name"]: c for c in by_kind.get("ConfigMap", [])}
    self.jobset = (by_kind.get("JobSet") or [None])[0]
    deps = {_component(dp): dp for dp in by_kind.get("Deployment", [])}
    self.gen_dep, self.buf_dep = deps.get("generator"), deps.get("buffer")

  def config_text(self, pod: dict, container: dict, path: str) -> str | None:
    """The text of `path` if a ConfigMap volume of `pod` mounted in `container` holds it."""
    vols = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
      v = vols.get(m["name"], {})
      mp = m["mountPath"].rstrip("/")
      if "configMap" in v and path.startswith(mp + "/"):
        cm = self.configmaps.get(v["configMap"]["name"])
        if cm is not None:
          return cm.get("data", {}).get(path[len(mp) + 1:])
    return None

  def load(self, pod, container, path_arg: str) -> tuple[Any, str]:
    """(config, source) a container loads from `--config=path[:arg]` before its overrides."""
    path, _, arg = path_arg.partition(":")
    if path.startswith("/"):
      text = self.config_text(pod, container, path)
      if text is None:
        raise ValueError(f"{container['name']} reads {path}, which no mounted ConfigMap holds")
      return _exec_config_text(text, arg or None), f"ConfigMap:{path}"
    return spec_lib.load_config(os.path.join(REPO, path), arg or None), path


def _validate(cfg) -> None:
  """recipes.validate without what only exists inside the pod (mounted certificates, model dirs)."""
  probe = cfg.copy_and_resolve_references()
  for k in ("cert", "key", "ca", "server_name"):
    probe.tls[k] = ""
  probe.tls.mutual = False
  probe.generator.vllm_model_dir = ""
  env = probe.buffer.auth_token_env            # a Secret on the pod
  old = os.environ.get(env)
  os.environ[env] = old or "preflight"
  try:
    recipes.validate(probe)
  finally:
    if old is None:
      os.environ.pop(env, None)


def learner_config(v: Variant, pod, c) -> tuple[ml_collections.ConfigDict, str]:
  """The config scalerl_jax.main builds from this container's command (main.main's steps)."""
  cfg, src = v.load(pod, c, _config_arg(c))
  over = _overrides(c["command"])
  recipes.apply_overrides(cfg, over)
  locked = recipes.locked_keys(over)
  cfg = recipes.apply_recipe(cfg, locked)
  if "topology" in locked:
    topologies.apply_layout(cfg)
  _validate(cfg)
  return cfg, src


def generator_config(v: Variant, pod, c) -> tuple[ml_collections.ConfigDict, str]:
  """The config generation.worker.main builds (load_run_config + its --tensor_parallel)."""
  rest, over = recipes.split_overrides(c["command"][3:])
  a = worker_cli.build_parser().parse_args(rest)
  path, _, arg = a.run_config.partition(":")
  base, src = v.load(pod, c, a.run_config)
  recipes.apply_overrides(base, over)
  cfg = recipes.apply_recipe(base, recipes.locked_keys(over))
  _validate(cfg)
  if a.tensor_parallel:
    cfg.generator.tensor_parallel = a.tensor_parallel
  return cfg, src


def export_config(v: Variant, pod, c) -> tuple[Any, str]:
  """The config scalerl_jax.data.export builds (its config file + overrides, no recipe)."""
  path = _config_arg(c)
  cfg, src = v.load(pod, c, path.partition(":")[0])
  recipes.apply_overrides(cfg, _overrides(c["command"]))
  return cfg, src


def _flat(d, prefix=""):
  out = {}
  for k, val in d.items():
    key = f"{prefix}{k}"
    if isinstance(val, dict):
      out.update(_flat(val, key + "."))
    else:
      out[key] = val
  return out


def _diff(a, b, keys=None) -> tuple | None:
  fa, fb = _flat(a.to_dict()), _flat(b.to_dict())
  for k in sorted(set(fa) | set(fb)):
    if k.startswith(WIRING) or (keys and not k.startswith(keys)):
      continue
    if fa.get(k) != fb.get(k):
      return k, fa.get(k), fb.get(k)
  return None


# ---- the checks ----------------------------------------------------------------------------------
def check_variant(d: str, aot: bool = False, update_cache: bool = False) -> Report:
  """Every check of the module docstring on one rendered variant directory."""
  v = Variant(d)
  r = Report(v.name)
  if v.jobset is None or v.gen_dep is None or v.buf_dep is None:
    r.fail(f"{d} lacks the learner JobSet / generator or buffer Deployment", "launch.gke.render")
    return r
  lpod = _pod_spec(v.jobset)
  lc = lpod["containers"][0]
  job = v.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
  hosts = int(job["parallelism"])
  platform = next((ACCELERATOR_OF_SELECTOR[x] for x in lpod.get("nodeSelector", {}).values()
                   if x in ACCELERATOR_OF_SELECTOR), None)
  res = spec_lib.PLATFORMS[platform]["resource"] if platform else None
  chips = int(lc["resources"]["limits"].get(res, 0)) if res else 0
  try:
    cfg, src = learner_config(v, lpod, lc)
  except (ValueError, OSError, KeyError) as e:
    r.fail(f"the learner's run config does not load: {' '.join(str(e).split())}",
           "learner --config")
    return r
  layout = str(cfg.get("layout", "")) or "(none)"
  r.info(f"learner reads {src} layout {layout}; {hosts} hosts x {chips} {platform}")

  # config: one run config for every pod
  gpod = _pod_spec(v.gen_dep)
  gc = gpod["containers"][0]
  bpod = _pod_spec(v.buf_dep)
  others = []
  try:
    gcfg, gsrc = generator_config(v, gpod, gc)
    others.append(("generators", gcfg, gsrc, None))
  except (ValueError, OSError, KeyError, SystemExit) as e:
    r.fail(f"the generators' run config does not load: {' '.join(str(e).split())}",
           "generator --run_config")
    gcfg = None
  for ic in bpod.get("initContainers", []):
    if "scalerl_jax.data.export" in ic["command"]:
      try:
        ecfg, esrc = export_config(v, bpod, ic)
        others.append(("prompt export", ecfg, esrc, ("data.", "rollout.max_prompt_len")))
      except (ValueError, OSError, KeyError) as e:
        r.fail(f"the prompt export's config does not load: {' '.join(str(e).split())}",
               "export --config")
  # One line for the fault: the first learner setting other pods do not share, with each pod's.
  mine, theirs = "", []
  for who, ocfg, _osrc, keys in others:
    diff = _diff(cfg, ocfg, keys)
    if diff:
      mine = mine or f"{diff[0]}={diff[1]!r}"
      theirs.append(f"{who} {diff[0]}={diff[2]!r}")
  bc = bpod["containers"][0]
  want = {a.split("=", 1)[0]: a.split("=", 1)[1]
          for a in buffer_flags(cfg, prompts="x", host="x", port=1) if "=" in a}
  have = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in bc["command"] if "=" in a}
  for flag in ("--prompts-per-step", "--group-size", "--max-lag", "--max-ahead", "--mode",
               "--npr-threshold",
               "--max-completion-tokens"):
    if want.get(flag) != have.get(flag):
      mine = mine or f"{flag} {want.get(flag)}"
      theirs.append(f"buffer {flag}={have.get(flag)}")
      break
  if theirs:
    r.fail(f"the learner's {mine.replace(chr(39), '')} reaches no other pod: "
           f"{', '.join(t.replace(chr(39), '') for t in theirs)}",
           "launch.gke.render --override (the run-config ConfigMap every pod reads)")

  # layout: topology vs platform x hosts x chips
  topo, wrong_layout = None, False
  if "layouts" in cfg:
    topo = topologies.get_topology(str(cfg.topology))
    lplat = spec_lib.layout_platform(topo.name)
    if lplat != platform or topo.num_devices != hosts * chips:
      wrong_layout = True
      r.fail(f"learner layout {layout} is for {topo.num_devices} {lplat} devices, the JobSet runs "
             f"{hosts} hosts x {chips} {platform} = {hosts * chips}",
             "launch.gke.render --layout (the learner's --config=...:LAYOUT)")
  # batch split over processes
  rows = int(cfg.rollout.batch_size or cfg.rollout.prompts_per_step * cfg.rollout.generations_per_prompt)
  m = int(cfg.optim.microbatches)
  shape = tuple(cfg.mesh.shape)
  if all(int(s) > 0 for _, s in shape) and hosts > 0:
    try:
      spans = topologies.process_row_spans(shape, cfg.mesh.rules, hosts, rows)
      n = spans[0][1] - spans[0][0]
      if any(b - a != n for a, b in spans) or not topologies.even_process_split(n, rows, hosts):
        r.fail(f"uneven batch split: {rows} rows over {hosts} processes as {spans}",
               "the layout's mesh (config.layouts) / --layout")
      else:
        r.info(f"batch {rows} rows: {len(set(spans))} distinct slices of {n} over {hosts} processes")
    except ValueError as e:
      r.fail(f"batch split over {hosts} processes: {e}", "the layout's mesh (config.layouts)")
    shards = topologies.batch_split(cfg)
    if rows % m or (rows // m) % shards:
      r.fail(f"{rows} rows / {m} micro-batches do not split over {shards} batch shards",
             "optim.microbatches")

  # the memory plan, made at the learner's real pad length
  pad, longest = runtime.train_seq_len(cfg), runtime.max_sequence_len(cfg.rollout)
  assert default_seq_len(cfg) == pad        # the plan tool's default is the pad length
  if topo is not None and not wrong_layout:     # (a wrong layout's plan says nothing)
    plan = None
    if aot:
      try:
        plan = aot_plan(cfg, pad)
      except RuntimeError as e:
        r.fail(f"the memory plan of layout {layout} at {pad} tokens did not compile: "
               f"{' '.join(str(e).split())[-300:]}", "the layout (config.layouts)")
        return r
      if update_cache:
        store_plan(plan)
    else:
      plan = cached_plan(cfg, pad)
    if plan is None:
      others = sorted(p["seq_len"] for p in cached_plans(cfg))
      r.fail(f"no memory plan of layout {layout} at >= the learner's pad length {pad} (longest "
             f"sequence {longest} tokens, runtime.train_seq_len); plans at {others}",
             "rollout.max_prompt_len / think_budget_max / answer_budget / learner.pad_multiple, "
             "or python -m launch.preflight --aot --update-cache")
    else:
      total = plan["total_gb"] * GB
      at = (f"at {pad} tokens" if plan["seq_len"] == pad else
            f"at {plan['seq_len']} tokens (an upper bound for the pad length {pad})")
      if total > topo.usable_bytes:
        r.fail(f"memory plan of layout {layout} {at}: {plan['total_gb']:.2f} GB/device > "
               f"{topo.usable_bytes / GB:.2f} usable", "the layout (config.layouts) / --layout")
      else:
        r.info(f"memory plan {layout} {at}: {plan['total_gb']:.2f} of "
               f"{topo.usable_bytes / GB:.2f} GB/device ({plan.get('source', 'aot')})")
  # XLA's share of HBM on GPU learners (the memory plans' usable fraction)
  if platform and spec_lib.PLATFORMS[platform]["kind"] == "gpu":
    env = {e["name"]: e.get("value") for e in lc.get("env", [])}
    frac = topo.usable_fraction if topo is not None and not wrong_layout else 0.9
    want_f = f"{frac:g}"
    if env.get(XLA_FRACTION_ENV) != want_f:
      r.fail(f"learner env {XLA_FRACTION_ENV}={env.get(XLA_FRACTION_ENV)} (unset: JAX takes 0.75 "
             f"of HBM), the memory plan assumes {want_f}", "learner env (launch/spec.py)")

  # vLLM KV cache, with the engine arguments the generator worker really passes
  if gcfg is not None:
    check_generators(r, v, gcfg, gpod, gc)
    check_push(r, gcfg, hosts)
    if topo is not None and not wrong_layout:
      check_sync(r, gcfg, hosts, topo.num_devices, topo.peak_flops)
  # pod memory
  check_pod_memory(r, v, cfg, gcfg, lc, platform, hosts, chips, bc)
  # volumes
  check_volumes(r, cfg, lpod, lc, "learner", _flag(lc["command"], "--workdir", ""),
                report_unset=True)
  if gcfg is not None:
    check_volumes(r, gcfg, gpod, gc, "generator", None)
  for ic in bpod.get("initContainers", []):
    if "scalerl_jax.data.export" in ic["command"]:
      check_volumes(r, cfg, bpod, ic, "prompt export", None, data_only=True)
  # probes
  for who, _pod, c in (("learner", lpod, lc), ("generator", gpod, gc), ("buffer", bpod, bc)):
    check_probe(r, who, c)
  check_progress_probe(r, "learner", lc, cfg.learner)
  check_progress_probe(r, "buffer", bc, cfg.buffer)
  return r


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


def check_generators(r: Report, v: Variant, gcfg, gpod, gc) -> None:
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
           "weights.wire_dtype (runtime.wire_dtype)")
  else:
    r.info(msg)


def _request(c) -> int:
  q = c.get("resources", {}).get("requests", {}).get("memory")
  return sizing.parse_quantity(q) if q else 0


def check_pod_memory(r: Report, v: Variant, cfg, gcfg, lc, platform, hosts, chips, bc) -> None:
  """Memory requests of generator, learner and buffer pods vs what they hold (sizing.py)."""
  if gcfg is not None:
    gpod = _pod_spec(v.gen_dep)
    gc = gpod["containers"][0]
    need = sizing.generator_host_bytes(gcfg)
    have = _request(gc)
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
  # checkpoint's load is not counted: runtime.model_config reads only its config.json today)
  n = sizing.model_numbers(cfg)["params"]
  need_l = (n * 12 + 2 * n * sizing.wire_bytes_per_param(cfg)) // max(1, hosts) + 16 * GIB
  have_l = _request(lc)
  if have_l < need_l:
    r.fail(f"learner memory request {have_l / GIB:.0f} GiB < {need_l / GIB:.0f} GiB (state shard + "
           f"weight-source shards)", "learner pod memory (spec.PLATFORMS)")
  need_b = sizing.buffer_host_bytes(cfg)
  have_b = _request(bc)
  if have_b < need_b:
    r.fail(f"buffer memory request {have_b / GIB:.0f} GiB < {need_b / GIB:.0f} GiB (rollouts of "
           f"max_lag + 2 steps)", "buffer pod memory / rollout.max_lag")


def _mounted(path: str, pod, c, kinds=("persistentVolumeClaim", "configMap", "secret", "csi",
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
    elif not _mounted(path, pod, c):
      unmounted.append(f"{knob}={path}")
  if unmounted:
    r.fail(f"{who}: {', '.join(unmounted)} {'is' if len(unmounted) == 1 else 'are'} on no volume "
           f"the {who} pod mounts", f"the data volume (launch.gke.render --data_pvc, mounted at "
           f"{spec_lib.DATA_MOUNT})")
  if workdir is not None and not workdir.startswith("gs://") and not _mounted(workdir, pod, c):
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
def _plan_key(cfg, seq_len):
  rows = int(cfg.rollout.batch_size or cfg.rollout.prompts_per_step * cfg.rollout.generations_per_prompt)
  return dict(model=str(cfg.model.preset), layout=str(cfg.layout), seq_len=int(seq_len),
              microbatches=int(cfg.optim.microbatches), batch_rows=rows,
              remat=str(cfg.model.remat))


def cached_plans(cfg) -> list[dict]:
  """The cached plans of this model, layout, micro-batches and batch (any sequence length)."""
  key = _plan_key(cfg, 0)
  key.pop("seq_len")
  with open(PLAN_CACHE) as f:
    plans = json.load(f)["plans"]
  return [p for p in plans if all(p.get(k) == v for k, v in key.items())]


def cached_plan(cfg, seq_len) -> dict | None:
  """The cached plan at `seq_len`, else the one at the shortest longer length (an upper bound:
  a step's memory grows with its sequence length), else None."""
  longer = sorted((p for p in cached_plans(cfg) if p["seq_len"] >= int(seq_len)),
                  key=lambda p: p["seq_len"])
  return longer[0] if longer else None


def aot_plan(cfg, seq_len) -> dict:
  """tools.plan compiled now at `seq_len` (learner only: no generator, no FLOPs probe), on the
  preset's architecture (the start checkpoint's config.json is on the data volume)."""
  cfg = cfg.copy_and_resolve_references()
  cfg.model.hf_checkpoint = ""
  with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    f.write(spec_lib.run_config_text(cfg))
  try:
    cmd = [sys.executable, "-m", "scalerl_jax.tools.plan", f"--config={f.name}",
           f"--topology={cfg.layout}", f"--seq_len={seq_len}", "--generator=false", "--flops=false"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONPATH": REPO})
  finally:
    os.unlink(f.name)
  if out.returncode:
    raise RuntimeError(f"{shlex.join(cmd)} failed: {out.stderr.strip().splitlines()[-1:]}")
  res = json.loads(out.stdout.strip().splitlines()[-1])
  return dict(_plan_key(cfg, seq_len), total_gb=round(res["total_bytes"] / GB, 2),
              usable_gb=round(res["usable_bytes"] / GB, 2),
              source=f"tools.plan --aot (compile {res['compile_s']} s)")


def store_plan(plan: dict) -> None:
  """Adds (or replaces) a plan in PLAN_CACHE."""
  with open(PLAN_CACHE) as f:
    data = json.load(f)
  keys = ("model", "layout", "seq_len", "microbatches", "batch_rows", "remat")
  data["plans"] = [p for p in data["plans"] if any(p.get(k) != plan[k] for k in keys)] + [plan]
  with open(PLAN_CACHE, "w") as f:
    json.dump(data, f, indent=2)
    f.write("\n")


# ---- entry point ---------------------------------------------------------------------------------
def variant_dirs(paths) -> list[str]:
  """Each path is a variant directory (has *.yaml) or a folder of them."""
  out = []
  for p in paths:
    if glob.glob(os.path.join(p, "*.yaml")):
      out.append(p)
    else:
      out += sorted(d for d in glob.glob(os.path.join(p, "*")) if glob.glob(os.path.join(d, "*.yaml")))
  return out


def run(paths, aot: bool = False, update_cache: bool = False, out=sys.stdout) -> list[Report]:
  """Checks every variant under `paths`, prints its lines to `out`, returns the reports."""
  reports = []
  for d in variant_dirs(paths):
    rep = check_variant(d, aot=aot, update_cache=update_cache)
    for line in rep.infos + rep.failures:
      print(line, file=out)
    print(f"{rep.variant}: {'ok' if not rep.failures else f'{len(rep.failures)} failures'}",
          file=out)
    reports.append(rep)
  return reports


def main(argv=None) -> int:
  """CLI: exit status 1 when any variant fails."""
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("dirs", nargs="*", default=[os.path.join(REPO, "launch", "gke", "rendered")],
                  help="rendered variant directories (or a folder of them)")
  ap.add_argument("--aot", action="store_true", help="compile the memory plans (tools.plan) now")
  ap.add_argument("--update-cache", action="store_true", help=f"with --aot: store them in "
                  f"{os.path.relpath(PLAN_CACHE, REPO)}")
  a = ap.parse_args(argv)
  if not variant_dirs(a.dirs):
    ap.error(f"no rendered manifests in {a.dirs}")
  reports = run(a.dirs, a.aot, a.update_cache)
  return 1 if any(r.failures for r in reports) else 0


if __name__ == "__main__":
  sys.exit(main())
