"""`make test` lints: ruff (pyflakes, bugbear, syntax errors; config in pyproject.toml [tool.ruff])
over the whole repository, and basedpyright (pyright's basic mode; [tool.basedpyright]) over
scalerl_jax/, analysis/ and launch/, each with 0 findings. The ignore lists stay short and justified."""
import json
import os
import re
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ruff(*args, cwd=ROOT):
  return subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise",
                         "--no-cache", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def test_ruff_finds_nothing():
  r = _ruff(".")
  assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]


def test_ruff_config_is_the_projects_and_catches_what_it_should(tmp_path):
  ignores = _ruff_ignores()
  assert len(ignores) <= 15, ignores
  bad = tmp_path / "bad.py"
  bad.write_text("import os\n\n\ndef f(xs=[]):\n  for i in range(3):\n    pass\n  return undefined_name\n")
  r = _ruff("--config", os.path.join(ROOT, "pyproject.toml"), str(bad), cwd=str(tmp_path))
  codes = set(re.findall(r"^\S*bad\.py:\d+:\d+: ([A-Z]+\d+) ", r.stdout, re.M))
  assert r.returncode == 1 and {"F401", "F821", "B006", "B007"} <= codes, r.stdout


# basedpyright (pyright in basic mode; config in pyproject.toml [tool.basedpyright]) over
# scalerl_jax/, analysis/ and launch/, with 0 errors and 0 warnings. Every way of switching a finding
# off (a rule turned off in pyproject, a file-level `# pyright:` comment, a line's
# `# pyright: ignore[...]` / `# type: ignore`) counts toward one list: with ruff's, at most 15.
_PYRIGHT = os.path.join(os.path.dirname(sys.executable), "basedpyright")
_TYPED = ("scalerl_jax", "analysis", "launch")


def _pyright(*args, cwd=ROOT):
  # -p names the config: pyright would otherwise take a pyrightconfig.json of a parent folder.
  r = subprocess.run([_PYRIGHT, "--outputjson", "-p", os.path.join(ROOT, "pyproject.toml"), *args],
                     cwd=cwd, capture_output=True, text=True, timeout=900)
  try:
    out = json.loads(r.stdout)
  except json.JSONDecodeError:
    raise AssertionError(f"basedpyright failed (rc {r.returncode}): {r.stdout[-3000:]}"
                         f"{r.stderr[-3000:]}") from None
  findings = [f"{d['file']}:{d['range']['start']['line'] + 1}: {d['severity']}: {d['message']}"
              f" ({d.get('rule', '')})" for d in out["generalDiagnostics"]]
  return out["summary"], findings


def pyright_ignores() -> list[str]:
  """Every switched-off check: rules off in pyproject, file-level and line-level pyright comments."""
  cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["basedpyright"]
  out = [f"pyproject: {k} = {v}" for k, v in cfg.items() if k.startswith("report")]
  for pkg in _TYPED:
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for name in files:
        if not name.endswith((".py", ".ipynb")):
          continue
        path = os.path.join(dirpath, name)
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
          if re.search(r"#\s*(pyright:|type:\s*ignore)", line):
            out.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  return out


def test_pyright_finds_nothing():
  summary, findings = _pyright()
  assert summary["filesAnalyzed"] > 100, summary
  assert summary["errorCount"] == 0 and summary["warningCount"] == 0, (
      f"{summary}\n" + "\n".join(findings[:200]))


def _ruff_ignores() -> list[str]:
  lint = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["ruff"]["lint"]
  return list(lint["ignore"]) + [c for v in lint.get("per-file-ignores", {}).values() for c in v]


def test_pyright_config_is_the_projects_and_catches_what_it_should(tmp_path):
  ignores = pyright_ignores()
  assert len(ignores) + len(_ruff_ignores()) <= 15, "\n".join(ignores + _ruff_ignores())
  cfg = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["basedpyright"]
  assert cfg["typeCheckingMode"] in ("basic", "standard", "strict") and set(_TYPED) <= set(cfg["include"])
  bad = tmp_path / "bad.py"
  bad.write_text("from typing import Optional\n\n\ndef f(x: Optional[str]) -> int:\n"
                 "  n: int = 'one'\n  return x.count('a') + n\n")
  summary, findings = _pyright(str(bad), cwd=str(tmp_path))
  text = "\n".join(findings)
  assert summary["errorCount"] >= 2, text
  assert "reportAssignmentType" in text and "reportOptionalMemberAccess" in text, text
