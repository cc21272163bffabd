"""Code rewards: DeepCoder-style unit tests run on the program after the thinking trace.

Code answers (`answer` for "code") are JSON, either a list of tests or an object:
  [{"input": "1 2\\n", "output": "3\\n"}, ...]                          stdin/stdout tests
  {"tests": [...], "fn_name": "add"}                                     + call-based tests:
  {"input": "1\\n2", "output": "3", "testtype": "functional"}         input = one JSON arg per line
The program is the last ```python (or bare ```) block after </think>. Reward 1 iff all tests pass.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from scalerl_jax.rewards.registry import register
from scalerl_jax.rewards.text import strip_thinking

_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.S)

_FUNCTIONAL_HARNESS = r'''
import json, sys
src = open(sys.argv[1]).read()
fn_name = sys.argv[2]
ns = {"__name__": "__solution__"}
exec(compile(src, "solution.py", "exec"), ns)
if fn_name in ns:
  fn = ns[fn_name]
elif "Solution" in ns:
  fn = getattr(ns["Solution"](), fn_name)
else:
  raise SystemExit("function %r not defined" % fn_name)
args = [json.loads(line) for line in sys.stdin.read().splitlines() if line.strip()]
print(json.dumps(fn(*args)))
'''


def extract_code(completion_text: str) -> str | None:
  """The last fenced code block after </think>, or None."""
  tail = strip_thinking(completion_text)
  if tail is None:
    return None
  blocks = _CODE_BLOCK.findall(tail)
  return blocks[-1] if blocks else None


def parse_tests(answer: str) -> tuple[list[dict], str | None]:
  """(tests, fn_name) from a code answer (format in the module docstring); raises ValueError."""
  try:
    spec = json.loads(answer) if isinstance(answer, str) else answer
  except json.JSONDecodeError as e:
    raise ValueError(f"code answer is not JSON: {e}") from None
  fn_name = None
  if isinstance(spec, dict):
    fn_name = spec.get("fn_name") or None
    spec = spec.get("tests")
  if not isinstance(spec, list) or not spec:
    raise ValueError("code answer must hold a non-empty list of tests")
  for i, t in enumerate(spec):
    if not isinstance(t, dict) or "input" not in t or "output" not in t:
      raise ValueError(f"test {i} must be an object with 'input' and 'output', got {t!r}")
    if t.get("testtype", "stdin") == "functional" and not fn_name:
      raise ValueError(f"test {i} is functional but the answer has no 'fn_name'")
  return spec, fn_name


# Sets resource limits, then execs the real command: no preexec_fn, so it is safe in threaded callers.
_LIMITED_EXEC = (
    "import os, resource, sys\n"
    "mem, cpu = int(sys.argv[1]), int(sys.argv[2])\n"
    "resource.setrlimit(resource.RLIMIT_AS, (mem, mem))\n"
    "resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))\n"
    "resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))\n"
    "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n")


def _run_limited(cmd: list[str], stdin: str, cwd: str, env: dict, timeout_s: float,
                 memory_bytes: int) -> tuple[int | None, str]:
  """(returncode, stdout); returncode None on timeout. The whole process group is killed."""
  full = [sys.executable, "-I", "-c", _LIMITED_EXEC, str(memory_bytes), str(int(timeout_s) + 1), *cmd]
  proc = subprocess.Popen(full, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, cwd=cwd, env=env, text=True,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(stdin, timeout=timeout_s)
    return proc.returncode, out
  except subprocess.TimeoutExpired:
    return None, ""
  finally:
    try:
      os.killpg(proc.pid, signal.SIGKILL)   # also stray children the program spawned
    except OSError:
      pass
    proc.wait()


def _outputs_match(got: str, want: str) -> bool:
  a, b = got.split(), want.split()
  if a == b:
    return True
  if len(a) != len(b):
    return False
  for x, y in zip(a, b):
    if x == y:
      continue
    try:
      if abs(float(x) - float(y)) > 1e-6 * max(1.0, abs(float(y))):
        return False
    except ValueError:
      return False
  return True


def run_tests(code: str, tests: list[dict], fn_name: str | None = None, timeout_s: float = 6.0,
              memory_bytes: int = 1 << 30) -> bool:
  """Runs `code` on every test in a fresh, resource-limited `python -I` subprocess; all must pass."""
  with tempfile.TemporaryDirectory(prefix="scalerl_code_") as tmp:
    sol = os.path.join(tmp, "solution.py")
    with open(sol, "w") as f:
      f.write(code)
    harness = os.path.join(tmp, "harness.py")
    with open(harness, "w") as f:
      f.write(_FUNCTIONAL_HARNESS)
    env = {"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1"}
    for t in tests:
      functional = t.get("testtype", "stdin") == "functional"
      cmd = [sys.executable, "-I"] + ([harness, sol, fn_name] if functional else [sol])
      code_rc, stdout = _run_limited(cmd, str(t["input"]), tmp, env, timeout_s, memory_bytes)
      if code_rc != 0:
        return False
      if functional:
        try:
          want = t["output"]
          want = json.loads(want) if isinstance(want, str) else want
          if json.loads(stdout) != want:
            return False
        except (json.JSONDecodeError, ValueError):
          return False
      elif not _outputs_match(stdout, str(t["output"])):
        return False
  return True


@register("code")
def code_reward(completion_text: str, answer: str) -> float:
  """1.0 iff the last code block after </think> passes all tests in `answer`."""
  code = extract_code(completion_text)
  if code is None:
    return 0.0
  tests, fn_name = parse_tests(answer)
  return 1.0 if run_tests(code, tests, fn_name) else 0.0
