"""`make test` lints: ruff (pyflakes, bugbear, syntax errors; config in pyproject.toml [tool.ruff])
over the whole repository, with 0 findings. The ignore list stays short and justified."""
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ruff(*args, cwd=ROOT):
  return subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                         "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
  r = _ruff(".")
  assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_ruff_config_is_the_projects_and_catches_what_it_should(tmp_path):
  lint = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["ruff"]["lint"]
  ignores = list(lint["ignore"]) + [c for v in lint.get("per-file-ignores", {}).values() for c in v]
  assert len(ignores) <= 15, ignores
  bad = tmp_path / "bad.py"
  bad.write_text("import os\n\n\ndef f(xs=[]):\n  for i in range(3):\n    pass\n  return undefined_name\n")
  r = _ruff("--config", os.path.join(ROOT, "pyproject.toml"), str(bad), cwd=str(tmp_path))
  codes = set(re.findall(r"^\S*bad\.py:\d+:\d+: ([A-Z]+\d+) ", r.stdout, re.M))
  assert r.returncode == 1 and {"F401", "F821", "B006", "B007"} <= codes, r.stdout
