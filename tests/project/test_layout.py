"""The tests mirror the packages (issue #47): every test module sits in a folder named after the
package it guards (`tests/<package>/test_<module>.py`), whole runs in `tests/e2e/`, chaos and
hostile inputs in `tests/faults/`, repository-wide rules in `tests/project/`; no test module is
left at the top of tests/ (only shared helpers and subprocess bodies live there). Basenames are
unique across folders: pytest's default (prepend) import mode imports a test module by its
basename, and tests import their neighbours that way (`import rl_reference`)."""
import collections
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTS = os.path.join(ROOT, "tests")
# folder -> what it guards (a package or module under scalerl_jax/, or a top-level folder)
FOLDERS = {
    "analysis": "analysis/", "buffer": "scalerl_jax/buffer/", "config": "scalerl_jax/config/",
    "core": "scalerl_jax/ (top-level modules)", "data": "scalerl_jax/data/",
    "generation": "scalerl_jax/generation/", "vllm": "scalerl_jax/generation/vllm/",
    "learner": "scalerl_jax/learner/", "rl": "scalerl_jax/rl/", "models": "scalerl_jax/models/",
    "rewards": "scalerl_jax/rewards/", "weights": "scalerl_jax/weights/",
    "training": "scalerl_jax/training/", "tools": "scalerl_jax/tools/",
    "protocol": "scalerl_jax/protocol/", "launch": "launch/",
    "e2e": "whole runs", "faults": "chaos and hostile inputs", "project": "repository rules",
}


def layout(tests_dir):
  """(test modules at the top of tests_dir, {folder: [test modules]})."""
  top, by = [], collections.defaultdict(list)
  for dirpath, dirnames, files in os.walk(tests_dir):
    dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "vllm_mm_shim")]
    rel = os.path.relpath(dirpath, tests_dir)
    for f in files:
      if f.startswith("test_") and f.endswith(".py"):
        (top.append(f) if rel == "." else by[rel].append(f))
  return top, by


def test_every_test_module_is_in_a_package_folder():
  top, by = layout(TESTS)
  assert top == [], f"test modules at the top of tests/: {top}"
  assert set(by) <= set(FOLDERS), sorted(set(by) - set(FOLDERS))
  for folder, guards in FOLDERS.items():
    if guards.endswith("/"):
      assert os.path.isdir(os.path.join(ROOT, guards)), (folder, guards)
  names = [f for fs in by.values() for f in fs]
  dup = sorted({f for f in names if names.count(f) > 1})
  assert dup == [], f"test module basenames used twice: {dup}"
  assert len(names) >= 120


def test_a_planted_top_level_or_duplicate_test_module_is_found(tmp_path):
  (tmp_path / "rl").mkdir()
  (tmp_path / "buffer").mkdir()
  (tmp_path / "test_stray.py").write_text("")
  (tmp_path / "rl" / "test_x.py").write_text("")
  (tmp_path / "buffer" / "test_x.py").write_text("")
  top, by = layout(str(tmp_path))
  assert top == ["test_stray.py"] and sorted(by) == ["buffer", "rl"]
  assert by["rl"] == by["buffer"] == ["test_x.py"]
