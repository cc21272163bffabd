"""Launch: xm_launch --dry_run, and the GKE manifests (parse, schema-validate, match the configs)."""
import glob
import json
import os
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from launch import spec as spec_lib
from launch.gke import render

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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
  assert "--prompts-per-step=48" in specs["buffer"]["command"]
  assert "--group-size=16" in specs["buffer"]["command"]
  assert "--max-lag=8" in specs["buffer"]["command"]


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
  for name, (cfg, lp, gp) in render.VARIANTS.items():
    out = tmp_path / name
    render.render(cfg, lp, gp, str(out))
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
  assert kinds == ["Deployment", "Deployment", "JobSet", "Secret", "Secret", "Service", "Service"]
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


@pytest.mark.parametrize("variant", sorted(render.VARIANTS))
def test_manifests_match_configs(variant):
  cfg_file, lp, gp = render.VARIANTS[variant]
  config = spec_lib.load_config(os.path.join(REPO, cfg_file))
  specs = spec_lib.resolve(config, dict(learner_platform=lp, generator_platform=gp,
                                        config_file=cfg_file))
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
  assert f"--config={cfg_file}" in c["command"]
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
  r = config.rollout
  for flag in (f"--prompts-per-step={r.prompts_per_step}", f"--group-size={r.generations_per_prompt}",
               f"--max-lag={r.max_lag}", f"--mode={r.mode}"):
    assert flag in b["command"]
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
