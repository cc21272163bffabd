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
                (run_config.train_seq_len, the tools.plan default) and fits: launch/plan_cache.json,
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

from launch import spec as spec_lib  # noqa: E402
from scalerl_jax import config as run_config  # noqa: E402
from scalerl_jax import recipes, topologies  # noqa: E402
from scalerl_jax.generation import worker_cli  # noqa: E402
from scalerl_jax.processes import buffer_flags  # noqa: E402
from scalerl_jax.tools.plan import default_seq_len  # noqa: E402
from launch.preflight_pods import (ACCELERATOR_OF_SELECTOR, GB, Report, check_generators,  # noqa: E402
                                   check_generator_disk, check_pod_memory, check_probe, check_progress_probe,
                                   check_push, check_sync, check_volumes)
from launch.preflight_pods import pod_spec as _pod_spec  # noqa: E402

PLAN_CACHE = os.path.join(REPO, "launch", "plan_cache.json")
# Keys a pod's command legitimately sets for its role (addresses, certificates, multi-host).
# generator.tensor_parallel: the generator command's --tensor_parallel may set it (older manifests).
# The learner layout's keys (apply_layout) shape only the learner's step.
WIRING = ("buffer.address", "buffer.external", "weights.", "tls.", "distributed.",
          "generator.tensor_parallel", "layout", "topology", "mesh.", "optim.microbatches",
          "model.remat", "model.scan_layers",
          "generator.ckpt_cache_dir")     # the generator pods' node-cache mount (node_cache.py)
XLA_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"


# ---- reading the manifests -----------------------------------------------------------------------
def load_docs(d: str) -> list[dict]:
  """Every YAML document of a rendered directory."""
  docs = []
  for path in sorted(glob.glob(os.path.join(d, "*.yaml"))):
    with open(path) as f:
      docs += [x for x in yaml.safe_load_all(f) if x]
  return docs


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
  cfg = run_config.resolve_config(cfg, _overrides(c["command"]))
  _validate(cfg)
  return cfg, src


def generator_config(v: Variant, pod, c) -> tuple[ml_collections.ConfigDict, str]:
  """The config generation.worker.main builds (the resolver + its --tensor_parallel)."""
  rest, over = run_config.split_overrides(c["command"][3:])
  a = worker_cli.build_parser().parse_args(rest)
  base, src = v.load(pod, c, a.run_config)
  cfg = run_config.resolve_config(base, over)
  _validate(cfg)
  if a.tensor_parallel:
    cfg.generator.tensor_parallel = a.tensor_parallel
  return cfg, src


def buffer_config(v: Variant, pod, c) -> tuple[Any, str]:
  """The config scalerl_jax.buffer.server builds (the resolver: its --run-config + overrides)."""
  rest, over = run_config.split_overrides(c["command"][3:])
  path = next((a.split("=", 1)[1] for a in rest if a.startswith("--run-config=")), None)
  if path is None:
    raise ValueError("the buffer command has no --run-config (every knob comes from it)")
  base, src = v.load(pod, c, path)
  return run_config.resolve_config(base, over), src


def export_config(v: Variant, pod, c) -> tuple[Any, str]:
  """The config scalerl_jax.data.export builds (the resolver: its config file + overrides)."""
  path = _config_arg(c)
  cfg, src = v.load(pod, c, path.partition(":")[0])
  cfg = run_config.resolve_config(cfg, _overrides(c["command"]))
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
  gpod, bpod = _pod_spec(v.gen_dep), _pod_spec(v.buf_dep)
  gc, bc = gpod["containers"][0], bpod["containers"][0]
  gcfg = check_one_config(r, v, cfg, gpod, gc, bpod, bc)
  topo, wrong_layout = check_layout(r, cfg, layout, platform, hosts, chips)
  if not check_memory_plan(r, cfg, None if wrong_layout else topo, layout, aot, update_cache):
    return r
  check_xla_fraction(r, lc, platform, None if wrong_layout else topo)

  # vLLM KV cache, with the engine arguments the generator worker really passes
  if gcfg is not None:
    check_generators(r, v, gcfg, gpod, gc)
    check_push(r, gcfg, hosts)
    if topo is not None and not wrong_layout:
      check_sync(r, gcfg, hosts, topo.num_devices, topo.peak_flops)
  # pod memory
  check_pod_memory(r, v, cfg, gcfg, lc, platform, hosts, chips, bc)
  if gcfg is not None:
    check_generator_disk(r, gcfg, _pod_spec(v.gen_dep)["containers"][0])
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


def check_one_config(r: Report, v: Variant, cfg, gpod, gc, bpod, bc):
  """Every pod (generators, prompt export, buffer flags) reads the learner's run config: one line
  naming the first learner setting another pod does not share. Returns the generators' config
  (None when it does not load)."""
  others = []
  try:
    gcfg, gsrc = generator_config(v, gpod, gc)
    others.append(("generators", gcfg, gsrc, None))
  except (ValueError, OSError, KeyError, SystemExit) as e:
    r.fail(f"the generators' run config does not load: {' '.join(str(e).split())}",
           "generator --run_config")
    gcfg = None
  try:
    bcfg, bsrc = buffer_config(v, bpod, bc)
    others.append(("buffer", bcfg, bsrc, ("rollout.", "rl.", "buffer.", "audit.", "seed")))
  except (ValueError, OSError, KeyError) as e:
    r.fail(f"the buffer's run config does not load: {' '.join(str(e).split())}",
           "buffer --run-config")
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
  want = [a for a in buffer_flags(cfg, run_file="x", prompts="x", host="x", port=1)
          if a.startswith("--route-shape=")]
  have = [a for a in bc["command"] if a.startswith("--route-shape=")]
  if want != have:                   # the one derived flag (the buffer runs without JAX)
    mine = mine or f"route shape {want}"
    theirs.append(f"buffer {have}")
  if theirs:
    r.fail(f"the learner's {mine.replace(chr(39), '')} reaches no other pod: "
           f"{', '.join(t.replace(chr(39), '') for t in theirs)}",
           "launch.gke.render --override (the run-config ConfigMap every pod reads)")

  return gcfg


def check_layout(r: Report, cfg, layout: str, platform, hosts: int, chips: int):
  """The learner layout's topology against the JobSet (platform, hosts x chips) and the batch split
  over the learner processes and micro-batches. Returns (topology or None, the layout is wrong)."""
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

  return topo, wrong_layout


def check_memory_plan(r: Report, cfg, topo, layout: str, aot: bool, update_cache: bool) -> bool:
  """The layout's memory plan at the learner's real pad length fits (`topo`: None for no layout or
  a wrong one: nothing to check). False when the AOT plan did not compile (the variant stops)."""
  pad, longest = run_config.train_seq_len(cfg), run_config.max_sequence_len(cfg.rollout)
  assert default_seq_len(cfg) == pad        # the plan tool's default is the pad length
  if topo is not None:     # (a wrong layout's plan says nothing)
    plan = None
    if aot:
      try:
        plan = aot_plan(cfg, pad)
      except RuntimeError as e:
        r.fail(f"the memory plan of layout {layout} at {pad} tokens did not compile: "
               f"{' '.join(str(e).split())[-300:]}", "the layout (config.layouts)")
        return False
      if update_cache:
        store_plan(plan)
    else:
      plan = cached_plan(cfg, pad)
    if plan is None:
      others = sorted(p["seq_len"] for p in cached_plans(cfg))
      r.fail(f"no memory plan of layout {layout} at >= the learner's pad length {pad} (longest "
             f"sequence {longest} tokens, run_config.train_seq_len); plans at {others}",
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
  return True


def check_xla_fraction(r: Report, lc, platform, topo) -> None:
  """GPU learner pods set XLA's share of HBM to the memory plans' usable fraction (`topo`: None
  for no layout or a wrong one: 0.9)."""
  if platform and spec_lib.PLATFORMS[platform]["kind"] == "gpu":
    env = {e["name"]: e.get("value") for e in lc.get("env", [])}
    frac = topo.usable_fraction if topo is not None else 0.9
    want_f = f"{frac:g}"
    if env.get(XLA_FRACTION_ENV) != want_f:
      r.fail(f"learner env {XLA_FRACTION_ENV}={env.get(XLA_FRACTION_ENV)} (unset: JAX takes 0.75 "
             f"of HBM), the memory plan assumes {want_f}", "learner env (launch/spec.py)")


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
