"""Launch: xm_launch --dry_run, and the GKE manifests (parse, schema-validate, match the configs)."""
import glob
import json
import os
import subprocess
import sys
import tempfile

import kubernetes_validate
import ml_collections
import pytest
import yaml

from launch import spec as spec_lib
from launch.gke import render
from scalerl_jax import config as run_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S_VERSION = "1.37.0"


def run_dry(*args, block_xmanager=True):
  code = ("import sys, runpy; " + ("sys.modules['xmanager'] = None; " if block_xmanager else "") +
          f"sys.argv = ['xm_launch.py', *{list(args)!r}]; "
          f"runpy.run_path({os.path.join(REPO, 'launch', 'xm_launch.py')!r}, run_name='__main__')")
  return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/",
                        timeout=120)


def test_dry_run_prints_jobs_without_xmanager():
  proc = run_dry("--config=configs/8b.py", "--dry_run")
  assert proc.returncode == 0, proc.stderr
  specs = json.loads(proc.stdout)
  assert set(specs) >= {"learner", "generators", "buffer", "secret"}
  assert specs["learner"]["chips"] == 16 and specs["learner"]["platform"] == "tpu-v5p"
  assert specs["learner"]["tpu_topology"] == "2x2x4" and specs["learner"]["hosts"] == 4
  assert specs["generators"]["gpus"] == 64 and specs["generators"]["replicas"] == 64
  assert specs["total_chips"] == 80
  assert specs["buffer"]["port"] == 50051
  # the buffer reads the run config every pod reads (48 x 16, k = 8), not knob flags of its own
  assert any(a.startswith("--run-config=configs/8b.py") for a in specs["buffer"]["command"])
  assert not any(a.startswith(("--prompts-per-step", "--group-size", "--max-lag"))
                 for a in specs["buffer"]["command"])


def test_dry_run_flags_and_errors():
  proc = run_dry("--config=configs/scout.py", "--learner_platform=gpu-gb200", "--train_chips=32",
                 "--image_tag=v9", "--dry_run")
  assert proc.returncode == 0, proc.stderr
  s = json.loads(proc.stdout)
  assert (s["learner"]["hosts"], s["learner"]["chips_per_host"]) == (8, 4)
  assert s["generators"]["tensor_parallel"] == 4 and s["generators"]["replicas"] == 16
  assert s["learner"]["image"].endswith("scalerl-jax-learner-gpu:v9")
  bad = run_dry("--config=configs/8b.py", "--learner_platform=gpu-h100", "--train_chips=12",
                "--dry_run")
  assert bad.returncode != 0 and "multiple of 8" in bad.stderr


def test_xm_job_requirements():
  pytest.importorskip("xmanager")
  proc = run_dry("--config=configs/8b.py", "--dry_run", block_xmanager=False)
  specs = json.loads(proc.stdout)
  import importlib.util
  mod_spec = importlib.util.spec_from_file_location("xm_launch_t", f"{REPO}/launch/xm_launch.py")
  mod = importlib.util.module_from_spec(mod_spec)
  mod_spec.loader.exec_module(mod)
  jobs = mod.build_jobs(specs, token="t0ken")
  assert set(jobs) == {"learner", "generators", "buffer"}
  assert "tpu_v5p=xm.Topology('2x2x4')" in repr(jobs["learner"]["requirements"])
  assert jobs["generators"]["requirements"].replicas == 64
  assert jobs["buffer"]["args"][:2] == ["-m", "scalerl_jax.buffer.server"]
  assert all(j["env_vars"]["SCALERL_BUFFER_TOKEN"] == "t0ken" for j in jobs.values())


def load_variant(name):
  docs = {}
  for path in sorted(glob.glob(os.path.join(render.RENDERED_DIR, name, "*.yaml"))):
    with open(path) as f:
      for d in yaml.safe_load_all(f):
        docs[(d["kind"], d["metadata"]["name"])] = d
  return docs


def test_rendered_manifests_are_up_to_date(tmp_path):
  for name, (cfg, lp, gp, extra) in render.VARIANTS.items():
    out = tmp_path / name
    render.render(cfg, lp, gp, str(out), extra)
    for fresh in sorted(out.iterdir()):
      committed = os.path.join(render.RENDERED_DIR, name, fresh.name)
      assert os.path.exists(committed), f"{committed} missing: run python -m launch.gke.render --all"
      assert fresh.read_text() == open(committed).read(), \
          f"{committed} is stale: run python -m launch.gke.render --all"


def as_job(jobset):
  """A JobSet replicatedJob template validated as a core batch/v1 Job (JobSet itself is a CRD)."""
  rj = jobset["spec"]["replicatedJobs"][0]
  return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": rj["name"]},
          "spec": rj["template"]["spec"]}


@pytest.mark.parametrize("variant", sorted(render.VARIANTS))
def test_manifests_validate_against_kubernetes_schemas(variant):
  docs = load_variant(variant)
  kinds = sorted(k for k, _ in docs)
  assert kinds == ["ConfigMap", "Deployment", "Deployment", "JobSet", "PersistentVolumeClaim",
                   "Secret", "Secret", "Service", "Service"]
  for (kind, _), d in docs.items():
    if kind == "JobSet":
      assert d["apiVersion"] == "jobset.x-k8s.io/v1alpha2"
      rjs = d["spec"]["replicatedJobs"]
      assert len(rjs) == 1 and rjs[0]["name"] == "learner" and rjs[0]["replicas"] == 1
      kubernetes_validate.validate(as_job(d), K8S_VERSION, strict=True)
    else:
      kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def test_validator_is_strict():
  d = load_variant("8b-gb200")[("Deployment", "scalerl-buffer")]
  d["spec"]["template"]["spec"]["containers"][0]["imagePullPolice"] = "Always"   # typo
  with pytest.raises(kubernetes_validate.ValidationError):
    kubernetes_validate.validate(d, K8S_VERSION, strict=True)


def pod_spec(doc):
  if doc["kind"] == "JobSet":
    return doc["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  return doc["spec"]["template"]["spec"]


def variant_specs(variant):
  """(config file's config, specs) of a committed variant, resolved as the renderer does."""
  cfg_file, lp, gp, extra = render.VARIANTS[variant]
  config = spec_lib.load_config(os.path.join(REPO, cfg_file))
  return config, spec_lib.resolve(config, render.variant_settings(cfg_file, lp, gp, extra))


def run_config_of(variant):
  """The resolved run config every pod of `variant` reads (its ConfigMap's file)."""
  cm = load_variant(variant)[("ConfigMap", spec_lib.RUN_CONFIG_NAME)]
  text = cm["data"][spec_lib.RUN_CONFIG_FILE]

  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, spec_lib.RUN_CONFIG_FILE)
    with open(path, "w") as f:
      f.write(text)
    return spec_lib.load_config(path), text


LAYOUTS = {"8b-gb200": "gb200_16", "8b-tpu-v5p": "tpu_v5p_16", "8b-h100": "h100_16",
           "scout-gb200": "gb200_16"}


@pytest.mark.parametrize("variant", sorted(render.VARIANTS))
def test_manifests_match_configs(variant):
  cfg_file, lp, gp, _ = render.VARIANTS[variant]
  config, specs = variant_specs(variant)
  docs = load_variant(variant)
  name = specs["name"]
  # learner: 16 training chips over hosts
  js = docs[("JobSet", f"{name}-learner")]
  job = js["spec"]["replicatedJobs"][0]["template"]["spec"]
  c = pod_spec(js)["containers"][0]
  res = spec_lib.PLATFORMS[lp]["resource"]
  per_host = int(c["resources"]["limits"][res])
  assert job["parallelism"] * per_host == 16 == specs["learner"]["chips"]
  assert c["image"] == specs["learner"]["image"] and c["command"][:3] == ["python", "-m", "scalerl_jax.main"]
  # every pod reads the one resolved run config; the learner's command names its layout
  assert specs["layout"] == LAYOUTS[variant]
  assert f"--config={spec_lib.RUN_CONFIG_PATH}:{LAYOUTS[variant]}" in c["command"]
  run_cfg, _ = run_config_of(variant)
  assert run_cfg.layout == LAYOUTS[variant] and run_cfg.recipe_applied == run_cfg.recipe
  assert run_cfg.data.path.startswith(spec_lib.DATA_MOUNT + "/")
  assert run_cfg.model.hf_checkpoint.startswith(spec_lib.DATA_MOUNT + "/")
  # generators: config.generator.num_workers GPUs
  dep = docs[("Deployment", f"{name}-vllm")]
  g = pod_spec(dep)["containers"][0]
  gpus = dep["spec"]["replicas"] * int(g["resources"]["limits"]["nvidia.com/gpu"])
  assert gpus == config.generator.num_workers == 64
  if variant == "8b-gb200":
    assert gpus + 16 == 80     # PAPER_NOTES §4: 80 GB200, 64 generating + 16 training
  assert g["image"] == specs["generators"]["image"]
  svc = docs[("Service", f"{name}-vllm")]
  assert svc["spec"]["selector"] == dep["spec"]["template"]["metadata"]["labels"]
  # buffer: gRPC port consistent everywhere, settings from config.rollout
  bdep, bsvc = docs[("Deployment", f"{name}-buffer")], docs[("Service", f"{name}-buffer")]
  b = pod_spec(bdep)["containers"][0]
  assert b["ports"][0]["containerPort"] == bsvc["spec"]["ports"][0]["port"] == spec_lib.BUFFER_PORT
  assert f"--port={spec_lib.BUFFER_PORT}" in b["command"]
  assert bsvc["spec"]["selector"] == bdep["spec"]["template"]["metadata"]["labels"]
  assert f"--run-config={spec_lib.RUN_CONFIG_PATH}" in b["command"]   # the one run config
  host = f"{name}-buffer.default.svc.cluster.local:{spec_lib.BUFFER_PORT}"
  assert f"--config.buffer.address={host}" in c["command"] and "--config.buffer.external=True" in c["command"]
  # the fleet runs the generator worker (vLLM backend) against the same buffer service
  assert g["command"][:3] == ["python", "-m", "scalerl_jax.generation.worker"]
  assert f"--buffer={host}" in g["command"] and "--backend=vllm" in g["command"]
  # every job reads the token from the one Secret, under config.buffer.auth_token_env
  secret = docs[("Secret", spec_lib.SECRET_NAME)]
  assert list(secret["stringData"]) == [spec_lib.SECRET_KEY]
  for container in (c, g, b):
    refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"] if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]}
    assert refs == {config.buffer.auth_token_env: {"name": spec_lib.SECRET_NAME,
                                                   "key": spec_lib.SECRET_KEY}}
  # TLS: every pod mounts the one TLS Secret read-only and its command points at the mounted files
  tls = docs[("Secret", spec_lib.TLS_SECRET_NAME)]
  assert tls["type"] == "kubernetes.io/tls" and sorted(tls["stringData"]) == sorted(
      spec_lib.TLS_FILES.values())
  for doc, container in ((js, c), (dep, g), (bdep, b)):
    vols = {v["name"]: v for v in pod_spec(doc)["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == spec_lib.TLS_SECRET_NAME
    assert {"name": "tls", "mountPath": spec_lib.TLS_MOUNT, "readOnly": True} in \
        container["volumeMounts"]
  files = {k: f"{spec_lib.TLS_MOUNT}/{f}" for k, f in spec_lib.TLS_FILES.items()}
  server_name = host.rpartition(":")[0]
  assert all(f"--config.tls.{k}={v}" in c["command"] for k, v in files.items())
  assert f"--config.tls.server_name={server_name}" in c["command"]
  assert all(f"--tls_{k}={v}" in g["command"] for k, v in files.items())
  assert f"--tls_server_name={server_name}" in g["command"]
  assert all(f"--tls-{k}={v}" in b["command"] for k, v in files.items())


# ---- every pod gets exactly what its process reads ------------------------------------------------
POD_IP, POD_INDEX = "10.1.2.3", 1
FIELD_VALUES = {spec_lib.FIELD_POD_IP: POD_IP, spec_lib.FIELD_COMPLETION_INDEX: str(POD_INDEX)}


def env_names_read_by_code() -> set[str]:
  """Names the code reads from the environment: string constants (or module constants) passed to
  os.environ.get / os.environ[...] / os.getenv / env.get / env[...] anywhere in scalerl_jax/, and
  module constants named ENV_* (distributed.py reads those through a helper)."""
  import ast
  names = set()
  for path in glob.glob(os.path.join(REPO, "scalerl_jax", "**", "*.py"), recursive=True):
    tree = ast.parse(open(path).read())
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
              and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
              for t in n.targets if isinstance(t, ast.Name)}
    names |= {v for k, v in consts.items() if k.startswith("ENV_")}

    def value(node):
      if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
      return consts.get(node.id) if isinstance(node, ast.Name) else None

    def is_env(node):
      return (isinstance(node, ast.Attribute) and node.attr == "environ") or \
          (isinstance(node, ast.Name) and node.id == "env")
    for node in ast.walk(tree):
      key = None
      if isinstance(node, ast.Call) and node.args:
        f = node.func
        if isinstance(f, ast.Attribute) and ((f.attr in ("get", "setdefault") and is_env(f.value))
                                             or f.attr == "getenv"):
          key = value(node.args[0])
      elif isinstance(node, ast.Subscript) and is_env(node.value):
        key = value(node.slice)
      if key:
        names.add(key)
  return names


def containers(docs):
  """(component, container, pod spec) of every container of a variant, init containers included."""
  for (kind, _), d in docs.items():
    if kind in ("JobSet", "Deployment"):
      spec = pod_spec(d)
      for c in spec.get("initContainers", []) + spec["containers"]:
        yield d["metadata"]["labels"]["app.kubernetes.io/component"], c, spec


def resolved_env(c) -> dict:
  env = {}
  for e in c.get("env", []):
    if "value" in e:
      env[e["name"]] = e["value"]
    elif "fieldRef" in e["valueFrom"]:
      env[e["name"]] = FIELD_VALUES[e["valueFrom"]["fieldRef"]["fieldPath"]]
    else:
      env[e["name"]] = "t0ken"
  return env


def expand(arg: str, env: dict) -> str:
  """Kubernetes' $(VAR) expansion in a container command (only for variables the container sets)."""
  import re
  return re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg)


def mounted(path: str, c) -> bool:
  return any(path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
             for m in c.get("volumeMounts", []))


def test_pods_read_exactly_what_their_manifests_give():
  """Each container's env vars are read by the code (none unread), each command parses with its
  entry point's own flags (none unknown), and what a pod needs is there: multi-host settings
  (GPU: SCALERL_* env; TPU: distributed.auto), each learner pod's weight address, the buffer's
  NPR threshold / WAL (on a mounted volume) / learner-state file from the config, the Secret."""
  from scalerl_jax import distributed
  from scalerl_jax.buffer import server
  from scalerl_jax.data import export
  from scalerl_jax.generation import worker
  from scalerl_jax.processes import buffer_flags
  from scalerl_jax import selftest
  parsers = {"scalerl_jax.selftest": selftest.build_parser(),
             "scalerl_jax.buffer.server": server.build_parser(),
             "scalerl_jax.data.export": export.build_parser(),
             "scalerl_jax.generation.worker": worker.build_parser()}
  read = env_names_read_by_code() | READ_BY_LIBRARIES
  learner_argvs, learners = [], []

  tmp = tempfile.mkdtemp()
  for variant in sorted(render.VARIANTS):
    _, specs = variant_specs(variant)
    config, text = run_config_of(variant)     # the resolved config every pod reads
    local_cfg = os.path.join(tmp, f"{variant}.py")
    with open(local_cfg, "w") as f:
      f.write(text)
    token_env = config.buffer.auth_token_env
    seen = set()
    for _component, c, pod in containers(load_variant(variant)):
      env = resolved_env(c)
      referenced = {v for a in c["command"] for v in env if f"$({v})" in a}
      unread = set(env) - read - {token_env} - referenced
      assert not unread, f"{variant}/{c['name']}: env vars nothing reads: {sorted(unread)}"
      argv = [expand(a, env) for a in c["command"]]
      assert argv[:2] == ["python", "-m"]
      module, args = argv[2], argv[3:]
      seen.add(module)
      if module in ("scalerl_jax.main", "scalerl_jax.generation.worker", "scalerl_jax.data.export"):
        assert mounted(spec_lib.RUN_CONFIG_PATH, c), (variant, c["name"])   # the ConfigMap
        assert mounted(config.data.path, c), (variant, c["name"])           # the data volume
      if module == "scalerl_jax.selftest":   # every pod's start-up self-test (issue 46)
        assert c["name"] == "selftest" and mounted(spec_lib.RUN_CONFIG_PATH, c), (variant, c["name"])
        st = parsers[module].parse_args(run_config.split_overrides(args)[0])
        assert st.role in ("learner", "generator", "buffer") and st.budget_s > 0
        continue
      if module == "scalerl_jax.main":
        learner_argvs.append([a.replace(spec_lib.RUN_CONFIG_PATH, local_cfg) for a in args])
        learners.append((variant, specs, env, c, pod))
        continue
      args, over = run_config.split_overrides(args)   # as their main() takes --config.a.b=v
      a = parsers[module].parse_args(args)      # SystemExit (a test error) on an unknown flag
      if module == "scalerl_jax.buffer.server":
        assert args + over == buffer_flags(
            config, run_file=spec_lib.RUN_CONFIG_PATH, prompts=spec_lib.PROMPTS_FILE,
            host="0.0.0.0", port=spec_lib.BUFFER_PORT, wal_dir=spec_lib.WAL_MOUNT,
            learner_state=specs["learner"]["command"][-1][len("--workdir="):] + "/learner_state.json",
            tls=specs["tls"]["buffer_args"] if specs.get("tls") else ())
        bcfg = run_config.resolve(local_cfg, over)   # what the buffer resolves: the learner's
        assert bcfg.rl.no_positive_resampling and bcfg.rl.npr_threshold == 0.9   # ScaleRL: NPR on
        assert bcfg.rollout == run_config.RunConfig.from_config(config).rollout
        assert a.wal_dir == "/wal" and mounted(a.wal_dir, c) and mounted(a.prompts, c)
        claim = {v["name"]: v for v in pod["volumes"]}["wal"]["persistentVolumeClaim"]["claimName"]
        assert ("PersistentVolumeClaim", claim) in load_variant(variant)
        assert a.learner_state == "gs://BUCKET/scalerl/run/learner_state.json"
        assert bcfg.buffer.auth_token_env == token_env in env
      elif module == "scalerl_jax.generation.worker":
        assert a.run_config == spec_lib.RUN_CONFIG_PATH and a.backend == "vllm" and token_env in env
        assert mounted(config.model.hf_checkpoint, c)
        w = run_config.apply_overrides(config.copy_and_resolve_references(), over).weights
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert w.relay_port == ports["relay"] == spec_lib.RELAY_PORT      # the relay's port
        assert w.relay_bulk_port == ports["relay-bulk"] == spec_lib.RELAY_BULK_PORT   # its bulk channel
        assert w.relay_advertise == POD_IP and w.relay_fanout >= 1
      elif module == "scalerl_jax.data.export":
        assert a.config == spec_lib.RUN_CONFIG_PATH
    assert seen == {"scalerl_jax.main", "scalerl_jax.buffer.server", "scalerl_jax.data.export",
                    "scalerl_jax.generation.worker", "scalerl_jax.selftest"}
  # The learner commands through main's own absl flags + recipes.validate, in one subprocess.
  proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "launch_procs.py")],
                        input=json.dumps(learner_argvs), capture_output=True, text=True, cwd=REPO,
                        env={**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  parsed = json.loads(proc.stdout.strip().splitlines()[-1])
  assert len(parsed) == len(learners) == 4
  for (variant, specs, env, c, pod), cfg in zip(learners, parsed):
    job = specs["learner"]
    dist = distributed.DistributedSpec.from_config(
        ml_collections.ConfigDict({"distributed": cfg["distributed"]}), env=env)
    if job["tpu_topology"]:
      assert dist.auto and "SCALERL_PROCESS_ID" not in env, variant
    else:   # every pod joins pod 0's coordinator as process <its completion index>
      assert (dist.num_processes, dist.process_id) == (job["hosts"], POD_INDEX), variant
      assert dist.coordinator_address == (f"{job['name']}-learner-0-0.{job['name']}:"
                                          f"{spec_lib.COORDINATOR_PORT}")
      assert job["hosts"] == {"8b-gb200": 4, "8b-h100": 2, "scout-gb200": 4}[variant]
    w = cfg["weights"]
    assert (w["serve_from"], w["host"], w["advertise"]) == ("learner", "0.0.0.0", POD_IP)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["weights"] == w["port"] == spec_lib.WEIGHTS_PORT
    assert ports["weights-bulk"] == w["bulk_port"] == spec_lib.WEIGHTS_BULK_PORT   # the bulk channel
    assert cfg["buffer"]["external"] and cfg["buffer"]["address"] == specs["buffer"]["address"]
    assert cfg["workdir"] == "gs://BUCKET/scalerl/run"
    assert pod["serviceAccountName"] == "scalerl"


# Set on pods for libraries, not read by scalerl_jax/: XLA's client reads its share of GPU memory.
READ_BY_LIBRARIES = {"XLA_PYTHON_CLIENT_MEM_FRACTION"}


def test_unread_env_var_is_caught():
  """The scan finds what the code reads, and would flag the variables the old manifests set."""
  read = env_names_read_by_code()
  assert {"SCALERL_COORDINATOR", "SCALERL_NUM_PROCESSES", "SCALERL_PROCESS_ID"} <= read
  assert not {"JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID",
              "SCALERL_ROLE"} & read
