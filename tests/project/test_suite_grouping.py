"""The suite's `xdist_group` marks take effect under `make test` (`-n 4 --dist loadgroup`).

Modules mark themselves with one group when a costly module-scoped fixture (a tiny end-to-end
run, a vLLM engine) must run once, and the vLLM tests share one group so that two engines never
compete for the 2 cores. pytest 9.2 with pytest-xdist 3.8 silently dropped every group (xdist
renames `item._nodeid`, which pytest 9.2 no longer reads): each worker ran such fixtures again.
This test runs a small suite the same way and checks that a group's tests share one worker.
"""
import os
import subprocess
import sys

_SUITE = '''
import os, pytest
pytestmark = pytest.mark.xdist_group("together")
@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    open(os.path.join(os.environ["OUT_DIR"], f"g{i}"), "w").write(os.environ["PYTEST_XDIST_WORKER"])
'''
_OTHER = '''
import os, pytest
@pytest.mark.parametrize("i", range(6))
def test_free(i):
    open(os.path.join(os.environ["OUT_DIR"], f"f{i}"), "w").write(os.environ["PYTEST_XDIST_WORKER"])
'''


def test_xdist_group_runs_a_group_on_one_worker(tmp_path):
  suite, out = tmp_path / "suite", tmp_path / "out"
  suite.mkdir()
  out.mkdir()
  (suite / "test_g.py").write_text(_SUITE)
  (suite / "test_f.py").write_text(_OTHER)
  r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2",
                      "--dist", "loadgroup", "--rootdir", str(suite), str(suite)],
                     cwd=suite, env={**os.environ, "OUT_DIR": str(out)}, capture_output=True,
                     text=True, timeout=120)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  grouped = {(out / f"g{i}").read_text() for i in range(6)}
  ran = {(out / f"{k}{i}").read_text() for k in "gf" for i in range(6)}
  assert len(grouped) == 1, f"the group's tests ran on {sorted(grouped)}: xdist_group had no effect"
  assert ran == {"gw0", "gw1"}, ran                      # and both workers did work
