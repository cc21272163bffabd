"""Bad command lines of `python -m scalerl_jax.main` end with one clear line on stderr and exit
status 2 (1 for a config that parses but fails validation), never a traceback, and before any JAX
work (no workdir is created, each case takes ~1 s)."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [
    # (argv after `-m scalerl_jax.main`, exit status, text the line must contain)
    (["--config=configs/tiny.py"], 2, "--workdir is required"),
    (["--workdir={wd}"], 2, "--config is required"),
    (["--workdir=", "--config=configs/tiny.py"], 2, "--workdir must not be empty"),
    (["--workdir={wd}", "--config=configs/nope.py"], 2, "no such file 'configs/nope.py'"),
    (["--workdir={wd}", "--config=configs/tiny.py", "--config.rollout.max_lag=abc"], 2,
     "--config.rollout.max_lag=abc: rollout.max_lag expects int, got 'abc'"),
    (["--workdir={wd}", "--config=configs/tiny.py", "--config.x=1"], 2,
     "unknown config field 'x' (--config.x=1)"),
    (["--workdir={wd}", "--config=configs/tiny.py", "--config.rollout.nope=3"], 2,
     "unknown config field 'rollout.nope' (--config.rollout.nope=3)"),
    (["--workdir={wd}", "--config=configs/tiny.py", "--bogus=1"], 2, "Unknown command line flag 'bogus'"),
    (["--workdir={wd}", "--config=configs/8b.py:no_such_topology"], 2,
     "config has no layout for topology 'no_such_topology'"),
    (["--workdir={wd}", "--config=configs/tiny.py", "stray"], 2, "unexpected positional arguments"),
    (["--workdir={wd}", "--config=configs/tiny.py", "--config.rollout.max_lag=-1"], 1,
     "config error: rollout.max_lag (k) must be >= 0, got -1"),
    (["--workdir={wd}", "--config=configs/tiny.py", "--config.generator.top_p=0.9"], 1,
     "generator.top_p=0.9"),
]


@pytest.mark.parametrize("argv,status,text", CASES, ids=[" ".join(c[0][1:] or c[0]) for c in CASES])
def test_bad_command_line_is_one_clear_line(tmp_path, argv, status, text):
  wd = tmp_path / "wd"
  argv = [a.format(wd=wd) for a in argv]
  r = subprocess.run([sys.executable, "-m", "scalerl_jax.main", *argv], cwd=ROOT,
                     env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True,
                     timeout=120)
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == status, r.stderr
  assert "Traceback" not in r.stderr and len(lines) == 1, r.stderr
  assert text in lines[0], lines[0]
  assert not wd.exists()                 # failed before any work (the workdir probe comes last)
