"""ARCHITECTURE.md's row "a buffer knob": one typed field in the Buffer section, and the buffer
process reads it from the run file, with no other file touched. Planted in a scratch copy of the
package (the real tree is not changed): the copy differs from the tree in exactly that one line,
the buffer process started from the copy holds the run file's value in its resolved config, and
the same run file stops the real tree's buffer with one line naming the undeclared knob."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
SECTIONS = pathlib.Path("scalerl_jax/config/_sections.py")
PLANTED = "  scratch_knob: int = 7              # planted by tests/project/test_planted_buffer_knob.py\n"
# The buffer process, with its resolved run config shown: `from_run` is where it reads its sections.
SPY = """
import sys
from scalerl_jax.buffer import server
orig = server.from_run
def spy(run, a, token, tls):
  print(json.dumps({"buffer": run.buffer.to_dict()}), flush=True)
  return orig(run, a, token, tls)
server.from_run = spy
server.main(sys.argv[1:])
""".replace("import sys\n", "import json, sys\n", 1)


def _plant(tree: pathlib.Path) -> None:
  """Adds PLANTED as the last field of `class Buffer` (before its check())."""
  path = tree / SECTIONS
  lines = path.read_text().splitlines(keepends=True)
  start = next(i for i, l in enumerate(lines) if l.startswith("class Buffer("))
  check = next(i for i in range(start, len(lines)) if lines[i].startswith("  def check("))
  while not lines[check - 1].strip():       # after the last field, before the blank line
    check -= 1
  lines.insert(check, PLANTED)
  path.write_text("".join(lines))


def _changed_files(a: pathlib.Path, b: pathlib.Path) -> list[str]:
  out = []
  for p in sorted(a.rglob("*.py")):
    rel = p.relative_to(a)
    if "__pycache__" not in rel.parts and p.read_bytes() != (b / rel).read_bytes():
      out.append(rel.as_posix())
  return out


def _buffer(tree: pathlib.Path, run_file: pathlib.Path, prompts: pathlib.Path, cwd: pathlib.Path):
  env = {**os.environ, "PYTHONPATH": str(tree), "SCALERL_BUFFER_TOKEN": "planted-knob"}
  return subprocess.Popen([sys.executable, "-c", SPY, f"--run-config={run_file}", "--port=0",
                           f"--prompts={prompts}", "--no-tune-malloc"], cwd=cwd, env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_new_buffer_knob_is_one_line_and_the_buffer_reads_it(tmp_path):
  scratch = tmp_path / "tree"
  ignore = shutil.ignore_patterns("__pycache__")
  for pkg in ("scalerl_jax", "configs"):
    shutil.copytree(ROOT / pkg, scratch / pkg, ignore=ignore)
  _plant(scratch)
  assert _changed_files(scratch / "scalerl_jax", ROOT / "scalerl_jax") == [
      "config/_sections.py"]
  assert _changed_files(scratch / "configs", ROOT / "configs") == []
  diff = subprocess.run(["diff", str(ROOT / SECTIONS), str(scratch / SECTIONS)],
                        capture_output=True, text=True).stdout
  assert [l for l in diff.splitlines() if l[:1] in "<>"] == ["> " + PLANTED.rstrip("\n")]

  # A run file (as main writes it) that sets the new knob, and a prompts file.
  sys.path.insert(0, str(ROOT))
  from scalerl_jax import config
  run = config.resolve_config(str(ROOT / "configs" / "tiny.py")).to_dict()
  run["buffer"]["scratch_knob"] = 5
  run_file = tmp_path / "config.json"
  run_file.write_text(json.dumps({**run, "_meta": {"argv": []}}))
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text(json.dumps({"prompt_id": 0, "tokens": [1, 2], "answer": "x"}) + "\n")

  p = _buffer(scratch, run_file, prompts, tmp_path)
  try:
    seen = json.loads(p.stdout.readline())          # the buffer process's resolved section
    started = json.loads(p.stdout.readline())       # then it serves
  finally:
    p.terminate()
    p.wait(timeout=30)
  assert seen["buffer"]["scratch_knob"] == 5 and started["port"] > 0, p.stderr.read()[-2000:]
  assert seen["buffer"]["lease_ttl_s"] == run["buffer"]["lease_ttl_s"]

  # The real tree's buffer refuses the same run file: one line naming the knob and the nearest.
  p = _buffer(ROOT, run_file, prompts, tmp_path)
  out, err = p.communicate(timeout=60)
  lines = [l for l in err.splitlines() if l.strip()]
  assert p.returncode == 1 and out == "", err[-2000:]
  assert lines[-1].startswith("config error: buffer.scratch_knob: undeclared config key"), lines
