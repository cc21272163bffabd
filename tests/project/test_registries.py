"""Where a branch names a choice, a registry holds it: generator backends (no "vllm" string in the
package outside generation/vllm/ and the backend registry), model families (no family name outside
models/families/ but the presets and the field default), launch backends (launch/backends.py; no
launcher compares a backend's name). Read from the sources (AST), so a planted name is found."""
import ast
import json
import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def string_sites(roots, value: str, skip=()) -> list[str]:
  """'path:line' of every string constant equal to `value` under `roots` (paths relative to
  ROOT), except under the prefixes `skip`."""
  out = []
  for root in roots:
    top = ROOT / root
    for p in [top] if top.is_file() else sorted(top.rglob("*.py")):
      rel = p.relative_to(ROOT).as_posix()
      if any(rel.startswith(s) for s in skip):
        continue
      for n in ast.walk(ast.parse(p.read_text())):
        if isinstance(n, ast.Constant) and n.value == value:
          out.append(f"{rel}:{n.lineno}")
  return out


# The config layer holds two config VALUES that are the backend's name: generator.backend's
# default (config/_sections.py) and health.parity_gate's default mode (config/_run.py; the
# backend entry's `parity_gate`). They are values, not branches.
VLLM_VALUES = {"scalerl_jax/config/_sections.py", "scalerl_jax/config/_run.py"}


def test_no_vllm_string_outside_its_package_and_the_registry_entry():
  sites = string_sites(["scalerl_jax", "configs"], "vllm",
                       skip=("scalerl_jax/generation/vllm/", "scalerl_jax/generation/backends.py"))
  assert [s for s in sites if s.split(":")[0] not in VLLM_VALUES] == []
  assert len(string_sites(["scalerl_jax/generation/backends.py"], "vllm")) >= 2   # the entry


def test_the_grep_finds_a_planted_backend_name(tmp_path, monkeypatch):
  (tmp_path / "scalerl_jax" / "training").mkdir(parents=True)
  (tmp_path / "scalerl_jax" / "training" / "t.py").write_text(
      "def f(c):\n  return c.generator.backend == 'vllm'\n")
  monkeypatch.setattr(__import__(__name__), "ROOT", tmp_path)
  assert string_sites(["scalerl_jax"], "vllm") == ["scalerl_jax/training/t.py:2"]


def test_the_parity_gate_follows_the_backend_entry():
  from scalerl_jax.generation import backends
  assert backends.parity_gate_on("vllm", "vllm") and backends.parity_gate_on("always", "jax")
  assert not backends.parity_gate_on("vllm", "jax") and not backends.parity_gate_on("off", "vllm")
  assert backends.get("vllm").selftest and not backends.get("jax").selftest


def test_no_family_is_named_outside_the_families_package():
  """A family's name appears only in its module; models/config.py's presets name theirs, and
  ModelConfig.family's default is a family (data, not a branch)."""
  from scalerl_jax.models import families
  allowed = {"scalerl_jax/models/config.py"}
  for name in families.names():
    sites = string_sites(["scalerl_jax"], name, skip=("scalerl_jax/models/families/",))
    assert {s.split(":")[0] for s in sites} <= allowed, (name, sites)
    branch = [n for n in ast.walk(ast.parse((ROOT / "scalerl_jax/models/config.py").read_text()))
              if isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in
                                                    families.get(name).hf_model_types
                                                    for c in [n.left, *n.comparators])]
    assert branch == [], name                         # no `model_type == "<family's>"` branch


@pytest.fixture(scope="module")
def specs():
  from launch import spec as spec_lib
  return spec_lib.resolve(spec_lib.load_config(str(ROOT / "configs/8b.py")),
                          dict(learner_platform="gpu-h100", config_file="configs/8b.py"))


def test_every_launch_backend_plans_the_8b_run(specs):
  from launch import backends
  assert backends.names() == ("gke", "rehearse", "xmanager")
  plans = {n: backends.plan(n, specs) for n in backends.names()}
  assert sorted(plans["gke"]) == ["buffer.yaml", "generators.yaml", "learner-jobset.yaml",
                                  "secret.yaml"]
  assert {p["component"] for p in plans["rehearse"]["pods"]} >= {"buffer", "generator"}
  assert plans["xmanager"]["buffer"]["args"][:2] == ["-m", "scalerl_jax.buffer.server"]
  json.dumps(plans, default=str)                      # plain data


def test_an_unknown_launch_backend_is_one_line(capsys):
  from launch import backends
  assert backends.main(["--backend=slurm"]) == 2
  err = capsys.readouterr().err.strip()
  assert err.count("\n") == 0 and "slurm" in err and "gke" in err


def test_no_launcher_compares_a_backend_name():
  from launch import backends
  names = set(backends.names()) | {"xm", "gke", "local"}
  found = []
  for p in sorted((ROOT / "launch").rglob("*.py")):
    for n in ast.walk(ast.parse(p.read_text())):
      if isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value in names
                                            for c in [n.left, *n.comparators]):
        found.append(f"{p.relative_to(ROOT)}:{n.lineno}")
  assert found == []
  assert os.path.exists(ROOT / "launch" / "backends.py")
