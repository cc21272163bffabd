"""Launch backends by name: where a run's three jobs (launch/spec.py's resolved specs) go.

  gke        Kubernetes manifests (launch/gke/render.py): the learner JobSet, the generator and
             buffer Deployments, the Secrets and the run-config ConfigMap
  xmanager   one XManager job group through xm_local (launch/xm_launch.py)
  rehearse   the GKE manifests run as local processes, one loopback address per pod
             (launch/rehearse.py)

A backend's `plan` is "module:function(specs) -> dict": what it would start, as plain data, with
nothing contacted and nothing imported beyond its own module (`python -m launch.backends
--backend=NAME --config=...` prints it). The launchers themselves stay their own commands
(launch/README.md); nothing branches on a backend's name. A new backend: its module and one
`register(LaunchBackend(...))` line below.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from typing import Any

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
  sys.path.insert(0, _REPO)

from launch import spec as spec_lib  # noqa: E402
from scalerl_jax.registry import Registry  # noqa: E402


@dataclasses.dataclass(frozen=True)
class LaunchBackend:
  """One launch backend: `plan` = "package.module:function" taking the resolved specs
  (launch/spec.py::resolve) and returning what it would start as JSON-able data."""
  name: str
  plan: str
  about: str = ""


LAUNCH_BACKENDS: Registry[LaunchBackend] = Registry("launch backend")
names = LAUNCH_BACKENDS.names
get = LAUNCH_BACKENDS.get


def register(backend: LaunchBackend) -> LaunchBackend:
  """Adds `backend` under its name (a name registered twice is an error)."""
  return LAUNCH_BACKENDS.register(backend.name)(backend)


def plan(name: str, specs: dict) -> dict[str, Any]:
  """Backend `name`'s plan of the resolved `specs` (its module imported now)."""
  module, _, fn = get(name).plan.partition(":")
  return getattr(importlib.import_module(module), fn)(specs)


register(LaunchBackend("gke", "launch.gke.render:manifests",
                       about="Kubernetes manifests: learner JobSet, generator and buffer Deployments"))
register(LaunchBackend("xmanager", "launch.xm_launch:job_args",
                       about="one XManager job group through xm_local (GKE executor)"))
register(LaunchBackend("rehearse", "launch.rehearse_pods:plan_from_specs",
                       about="the GKE manifests as local processes, one loopback address per pod"))


def main(argv=None) -> int:
  """Prints backend `--backend`'s plan of `--config` (resolved by launch/spec.py) as JSON."""
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("--backend", required=True, help=f"one of {names()}")
  ap.add_argument("--config", default="configs/8b.py")
  ap.add_argument("--learner_platform", default=None)
  args = ap.parse_args(argv)
  try:
    get(args.backend)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  path = args.config if os.path.isabs(args.config) else os.path.join(_REPO, args.config)
  specs = spec_lib.resolve(spec_lib.load_config(path), dict(
      learner_platform=args.learner_platform, config_file=args.config))
  print(json.dumps(plan(args.backend, specs), sort_keys=True, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
