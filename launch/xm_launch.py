"""XManager launcher: learner (TPU v5p or GPU), vLLM generator fleet and rollout buffer as one job group.

  python launch/xm_launch.py --config=configs/8b.py --dry_run            # print resolved jobs as JSON
  python launch/xm_launch.py --config=configs/8b.py --learner_platform=gpu-gb200 --dry_run
  python launch/xm_launch.py --config=configs/8b.py --workdir=gs://bkt/run   # launch via xm_local

--dry_run never imports xmanager and contacts nothing; it prints one JSON object and exits 0. A real
launch needs `pip install --no-deps xmanager` (0.8.5.post1 tested) plus GKE credentials for xm_local.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

from absl import app, flags

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from launch import spec as spec_lib  # noqa: E402
from scalerl_jax import lazy  # noqa: E402

# xmanager (installed --no-deps, needs cloud clients to launch) loads at first use: never on --dry_run.
xm = lazy.module("xmanager.xm")
xm_local = lazy.module("xmanager.xm_local")

_CONFIG = flags.DEFINE_string("config", "configs/8b.py", "config file (get_config) to launch")
_DRY = flags.DEFINE_bool("dry_run", False, "print resolved job specs as JSON and exit")
_LEARNER = flags.DEFINE_enum("learner_platform", None, sorted(spec_lib.PLATFORMS),
                             "learner accelerators (default: config.launch or tpu-v5p)")
_GEN = flags.DEFINE_enum("generator_platform", None,
                         [k for k, v in spec_lib.PLATFORMS.items() if v["kind"] == "gpu"],
                         "vLLM fleet accelerators (default gpu-gb200)")
_CHIPS = flags.DEFINE_integer("train_chips", None, "training accelerators (default 16)")
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (gs://...)")
_PREFIX = flags.DEFINE_string("image_prefix", None, "container registry prefix")
_TAG = flags.DEFINE_string("image_tag", None, "container image tag")
_NAME = flags.DEFINE_string("name", None, "experiment / job name prefix (default scalerl)")


def resolved_specs() -> dict:
  config = spec_lib.load_config(os.path.join(_REPO, _CONFIG.value)
                                if not os.path.isabs(_CONFIG.value) else _CONFIG.value)
  return spec_lib.resolve(config, dict(
      learner_platform=_LEARNER.value, generator_platform=_GEN.value, train_chips=_CHIPS.value,
      workdir=_WORKDIR.value, image_prefix=_PREFIX.value, image_tag=_TAG.value, name=_NAME.value,
      config_file=_CONFIG.value))


def build_jobs(specs: dict, token: str = "") -> dict:
  """{job name: dict(image, args, env_vars, requirements)}; requirements are xm.JobRequirements.

  Imports only `xmanager.xm` (lazily; never on --dry_run). xm_local cannot mount the Kubernetes
  Secret, so the buffer auth `token` (from the launcher's environment) is passed as an env var to all
  three jobs under config.buffer.auth_token_env.
  """

  def accel(platform, amount, **kw) -> Any:
    return xm.JobRequirements(**{spec_lib.PLATFORMS[platform]["xm_resource"]: amount}, **kw)

  learner, gens, buf = specs["learner"], specs["generators"], specs["buffer"]
  if learner["tpu_topology"]:   # one TPU slice; xm derives hosts from the topology
    learner_req = accel(learner["platform"], xm.Topology(learner["tpu_topology"]))
  else:
    learner_req = accel(learner["platform"], learner["chips_per_host"], replicas=learner["hosts"])
  requirements = {
      "learner": learner_req,
      "generators": accel(gens["platform"], gens["gpus_per_replica"], replicas=gens["replicas"]),
      "buffer": xm.JobRequirements(cpu=int(buf["cpu"]), memory=int(buf["memory"][:-2]) * xm.GiB),
  }
  if learner["field_env"].get("SCALERL_PROCESS_ID") and learner["hosts"] > 1:
    raise ValueError(f"a {learner['hosts']}-host GPU learner needs each pod's index "
                     "(SCALERL_PROCESS_ID), which xm_local's Kubernetes executor cannot set; "
                     "use the GKE manifests (python -m launch.gke.render) or a TPU slice")
  return {name: dict(job, requirements=requirements[name])
          for name, job in job_args(specs, token).items()}


def job_args(specs: dict, token: str = "") -> dict:
  """{job name: dict(image, args, env_vars)}: the three jobs without their xm requirements (no
  xmanager import; the `xmanager` launch backend's plan, launch/backends.py)."""
  jobs = {}
  for name in ("learner", "generators", "buffer"):
    s = specs[name]
    # Downward-API values ($(POD_IP)) exist only in the GKE manifests: without the flag the learner
    # advertises its host name's address (weights/source.py), which is the pod IP on Kubernetes.
    args = [a for a in s["command"][1:] if not any(f"$({v})" in a for v in s["field_env"])]
    jobs[name] = dict(image=s["image"], args=args,
                      env_vars=dict(s["env"], **({specs["secret"]["env"]: token} if token else {})))
  return jobs


def launch(specs: dict) -> None:
  """Creates the experiment and adds one JobGroup (learner, generators, buffer) on GKE.

  xm_local's Kubernetes executor needs xmanager's full dependency set (docker, kubernetes, google
  cloud clients) and cloud credentials; none of that is needed for --dry_run or the tests.
  """
  token_env = specs["secret"]["env"]
  token = os.environ.get(token_env, "")
  if not token:
    raise SystemExit(f"error: set {token_env} to the buffer auth token (e.g. openssl rand -hex 32)")
  jobs = build_jobs(specs, token)
  with xm_local.create_experiment(experiment_title=specs["name"]) as experiment:
    executables = experiment.package([
        xm.container(executor_spec=xm_local.KubernetesSpec(), image_path=j["image"])
        for j in jobs.values()])
    experiment.add(xm.JobGroup(**{
        name: xm.Job(executable=exe, executor=xm_local.Kubernetes(requirements=j["requirements"]),
               args=j["args"], env_vars=j["env_vars"])
        for (name, j), exe in zip(jobs.items(), executables)}))


def main(argv) -> None:
  del argv
  specs = resolved_specs()
  if _DRY.value:
    print(json.dumps(specs, indent=2, sort_keys=True))
    return
  launch(specs)


if __name__ == "__main__":
  app.run(main)
