"""Correct programs still pass inside the sandbox, in DeepCoder's formats (lcbv5 stdin and
functional tests with metadata.func_name, codeforces stdin, PrimeIntellect stdin_stdout, the
APPS/TACO inputs/outputs layout, stdin and call-based with fn_name), loaded through
scalerl_jax.data.loaders like a real run."""
import dataclasses
import json
import os
import shutil
import tempfile
import time

import pytest

from scalerl_jax import rewards
from scalerl_jax.data import loaders
from scalerl_jax.rewards import sandbox
from scalerl_jax.rewards.sandbox_setup import Limits


def _stdin(*pairs):
  return [{"input": i, "output": o, "testtype": "stdin"} for i, o in pairs]


def _fn(*pairs):
  return [{"input": "\n".join(json.dumps(a) for a in args), "output": json.dumps(out),
           "testtype": "functional"} for args, out in pairs]


# (id, dataset row as DeepCoder ships it, program)
CORRECT = [
    ("lcb_stdin_sum", {"tests": json.dumps(_stdin(("1 2\n", "3\n"), ("-5 5\n", "0\n")))},
     "a, b = map(int, input().split())\nprint(a + b)\n"),
    ("lcb_stdin_multicase", {"tests": json.dumps(_stdin(("3\n1\n2\n3\n", "1\n4\n9\n")))},
     "import sys\nt, *xs = map(int, sys.stdin.read().split())\nprint('\\n'.join(str(x * x) for x in xs))\n"),
    ("codeforces_fast_io", {"tests": _stdin(("5\n5 4 3 2 1\n", "1 2 3 4 5\n"))},
     "import sys\ninput = sys.stdin.buffer.readline\nn = int(input())\n"
     "a = sorted(map(int, input().split()))\nsys.stdout.write(' '.join(map(str, a)) + '\\n')\n"),
    ("codeforces_float_tolerance", {"tests": _stdin(("1 3\n", "0.333333333\n"))},
     "a, b = map(int, input().split())\nprint('%.12f' % (a / b))\n"),
    ("primeintellect_stdin_stdout", {"tests": json.dumps(
        [{"type": "stdin_stdout", "input": "abc\n", "output": "cba\n"}])},
     "print(input()[::-1])\n"),
    ("apps_inputs_outputs", {"tests": {"inputs": ["4\n", "7\n"], "outputs": ["YES\n", "NO\n"]}},
     "print('YES' if int(input()) % 2 == 0 else 'NO')\n"),
    ("main_guard", {"tests": _stdin(("10\n", "55\n"))},
     "def main():\n  n = int(input())\n  print(n * (n + 1) // 2)\n\nif __name__ == '__main__':\n  main()\n"),
    ("deep_recursion_in_thread", {"tests": _stdin(("50000\n", "1250025000\n"))},
     "import sys, threading\nsys.setrecursionlimit(1 << 20)\nthreading.stack_size(256 << 20)\n"
     "def f(n):\n  return 0 if n == 0 else n + f(n - 1)\n"
     "def main():\n  print(f(int(input())))\nt = threading.Thread(target=main)\nt.start()\nt.join()\n"),
    ("stdlib_heavy", {"tests": _stdin(("6\n3 1 4 1 5 9\n", "1 1 3 4 5 9\n2\n[(1, 2)]\n"))},
     "import heapq, collections, itertools, bisect, math, fractions, functools, re\n"
     "n = int(input()); a = list(map(int, input().split()))\nh = a[:]; heapq.heapify(h)\n"
     "print(*[heapq.heappop(h) for _ in range(n)])\nc = collections.Counter(a)\n"
     "print(max(c.values()))\nprint(collections.Counter(a).most_common(1))\n"),
    ("big_input_1mb", {"tests": _stdin((" ".join(["7"] * 200000) + "\n", "1400000\n"))},
     "import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))\n"),
    ("big_output_1mb", {"tests": _stdin(("200000\n", "\n".join(str(i) for i in range(200000)) + "\n"))},
     "import sys\nn = int(input())\nsys.stdout.write('\\n'.join(map(str, range(n))) + '\\n')\n"),
    ("uses_tmp_file", {"tests": _stdin(("hi\n", "hi\n"))},
     "s = input()\nopen('/tmp/scratch', 'w').write(s)\nprint(open('/tmp/scratch').read())\n"),
    ("numeric_300mb", {"tests": _stdin(("\n", "ok\n"))},
     "x = bytearray(300 << 20)\nx[-1] = 1\nprint('ok')\n"),
    ("unicode_output", {"tests": _stdin(("\n", "héllo → ✓\n"))}, "print('héllo → ✓')\n"),
    ("lcb_functional_top_level", {"metadata": {"func_name": "add"},
                                  "tests": _fn(([1, 2], 3), ([10, -4], 6))},
     "def add(a, b):\n  return a + b\n"),
    ("lcb_functional_solution_class", {"metadata": json.dumps({"func_name": "twoSum"}),
                                       "tests": _fn(([[2, 7, 11, 15], 9], [0, 1]), ([[3, 2, 4], 6], [1, 2]))},
     "from typing import List\nclass Solution:\n  def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
     "    seen = {}\n    for i, x in enumerate(nums):\n      if target - x in seen:\n"
     "        return [seen[target - x], i]\n      seen[x] = i\n"),
    ("functional_strings", {"fn_name": "longestPalindrome",
                            "tests": _fn((["babad"], "bab"), (["cbbd"], "bb"))},
     "class Solution:\n  def longestPalindrome(self, s: str) -> str:\n    best = ''\n"
     "    for i in range(len(s)):\n      for j in (i, i + 1):\n        l, r = i, j\n"
     "        while l >= 0 and r < len(s) and s[l] == s[r]:\n          l, r = l - 1, r + 1\n"
     "        if r - l - 1 > len(best):\n          best = s[l + 1:r]\n    return best\n"),
    ("functional_nested_lists", {"fn_name": "transpose", "tests": _fn(([[[1, 2], [3, 4]]], [[1, 3], [2, 4]]))},
     "def transpose(m):\n  return [list(r) for r in zip(*m)]\n"),
    ("functional_bool_and_none", {"fn_name": "f", "tests": _fn(([3], True), ([4], False))},
     "def f(n):\n  return n % 2 == 1\n"),
    ("functional_with_main_guard_and_prints_to_stderr", {"fn_name": "g", "tests": _fn(([2, 3], 8))},
     "import sys\ndef g(a, b):\n  print('debug', file=sys.stderr)\n  return a ** b\n"
     "if __name__ == '__main__':\n  print('not run')\n"),
    ("mixed_stdin_and_functional", {"fn_name": "sq", "tests": _fn(([4], 16)) + _stdin(("4\n", "16\n"))},
     "def sq(x):\n  return x * x\nif __name__ == '__main__':\n  print(sq(int(input())))\n"),
    # TACO call-based (DeepCoder's taco subset): fn_name inside the tests JSON, each input the
    # call's argument list, each output the return value wrapped in a one-element list
    ("taco_call_based", {"tests": json.dumps({"inputs": [[1, 2], [10, -4]], "outputs": [[3], [6]],
                                              "fn_name": "add"})},
     "def add(a, b):\n  return a + b\n"),
    ("taco_call_based_list_result_solution_class", {"tests": json.dumps(
        {"inputs": [[[[1, 2], [3, 4]]], [[[5]]]], "outputs": [[[[1, 3], [2, 4]]], [[[5]]]],
         "fn_name": "transpose"})},
     "class Solution:\n  def transpose(self, m):\n    return [list(r) for r in zip(*m)]\n"),
    ("taco_call_based_unwrapped_output", {"tests": json.dumps(
        {"inputs": [["ab"]], "outputs": [["a", "b"]], "fn_name": "chars"})},
     "def chars(s):\n  return list(s)\n"),
    ("uses_subprocess_free_multiprocessing_pool_of_threads", {"tests": _stdin(("4\n", "30\n"))},
     "from concurrent.futures import ThreadPoolExecutor\nn = int(input())\n"
     "with ThreadPoolExecutor(2) as ex:\n  print(sum(ex.map(lambda x: x * x, range(n + 1))))\n"),
]


@pytest.fixture(scope="module")
def answers(tmp_path_factory):
  path = tmp_path_factory.mktemp("deepcoder") / "rows.jsonl"
  with open(path, "w") as f:
    for name, row, _ in CORRECT:
      f.write(json.dumps({"problem": name, **row}) + "\n")
  records, skipped = loaders.load_code(str(path))
  assert skipped == 0 and len(records) == len(CORRECT)
  return {r.problem: r.answer for r in records}


@pytest.mark.parametrize("name,row,program", CORRECT, ids=[c[0] for c in CORRECT])
def test_correct_program_passes(name, row, program, answers):
  completion = f"let me think </think>\n```python\n{program}```\n"
  g = rewards.grade("code", completion, answers[name])
  assert (g.reward, g.reason, g.sandboxed) == (1.0, "pass", True), g
  assert g.tests_passed == g.tests_total == len(json.loads(answers[name])["tests"])
  assert rewards.compute_reward("code", completion, answers[name]) == 1.0


def test_taco_call_based_row_right_scores_1_wrong_scores_0(answers):
  """Issue 24: the TACO layout's `fn_name` sat inside the tests JSON and was dropped, so its
  call-based tests ran as stdin tests on the argument list's repr: a correct solution scored 0."""
  a = answers["taco_call_based"]
  spec = json.loads(a)
  assert spec["fn_name"] == "add"
  assert spec["tests"][0] == {"input": "1\n2", "output": "[3]", "testtype": "functional",
                              "apps_wrapped": True}
  right = "</think>\n```python\ndef add(a, b):\n  return a + b\n```"
  assert rewards.compute_reward("code", right, a) == 1.0
  for wrong in ("def add(a, b):\n  return a - b\n", "def add(a, b):\n  return [a + b, 0]\n",
                "print(3)\n"):
    g = rewards.grade("code", f"</think>\n```python\n{wrong}```", a)
    assert g.reward == 0.0 and g.reason in ("wrong_answer", "runtime_error"), (wrong, g)
  # the wrapper is accepted only where the loader marked the APPS/TACO convention (not lcbv5)
  lcb = json.dumps({"fn_name": "f", "tests": [{"input": "1", "output": "[3]",
                                                "testtype": "functional"}]})
  assert rewards.compute_reward("code", "</think>```python\ndef f(x):\n  return 3\n```", lcb) == 0.0


def test_suite_is_big_enough():
  assert len(CORRECT) >= 20 and len({c[0] for c in CORRECT}) == len(CORRECT)


def test_wrong_programs_fail_with_reasons(answers):
  a = answers["lcb_stdin_sum"]
  cases = {"wrong_answer": "print(0)\n", "runtime_error": "raise ValueError\n",
           "timeout": "while True: pass\n", "memory": "x = bytearray(8 << 30)\n"}
  for reason, prog in cases.items():
    g = rewards.grade_code(f"</think>```python\n{prog}```", a, Limits(wall_s=1.5))
    assert (g.reward, g.reason, g.sandboxed, g.tests_passed) == (0.0, reason, True, 0), (reason, g)
  g = rewards.grade("code", "no thinking end ```python\nprint(3)\n```", a)
  assert (g.reward, g.reason, g.sandboxed) == (0.0, "no_code", False)
  rec = rewards.grade("code", "</think>```python\nprint(0)\n```", a).as_record()
  assert json.loads(json.dumps(rec))["reason"] == "wrong_answer" and rec["sandboxed"] is True


def test_a_wall_limit_reached_before_bwrap_started_the_program_is_a_timeout():
  """The wall time counts from the spawn; under heavy load bwrap's start-up alone (~60 ms here)
  outlasted it once and the kill was reported as "sandbox_error: bwrap exited -15 before
  starting the program" (2026-12-02, commit b835118, 2-core machine, an e2e run). It is the limit's status.

  The slow start is forced, not hoped for: a 1 ms limit alone was not always reached before
  bwrap started the program (2026-12-05, commit cd5dca2, 2-core AMD EPYC: killed at 16 ms, after the start, under load). Here
  bwrap is a script that sleeps 30 s before it runs the real one, and the limit is 0.3 s."""
  real = sandbox.bwrap_path()
  d = tempfile.mkdtemp(prefix="slow_bwrap_", dir="/tmp")
  try:
    os.chmod(d, 0o755)          # bwrap runs as nobody when the tests run as root
    slow = os.path.join(d, "bwrap")
    with open(slow, "w") as f:
      f.write(f"#!/bin/sh\n{shutil.which('sleep')} 30\nexec {real} \"$@\"\n")
    os.chmod(slow, 0o755)
    s = dataclasses.replace(sandbox.settings(), bwrap=slow)
    t0 = time.monotonic()
    r = sandbox.run_program("print(1)", limits=Limits(wall_s=0.3), s=s)
    assert time.monotonic() - t0 < 10, r       # killed at the limit, not after the sleep
  finally:
    shutil.rmtree(d)
  assert r.status == "timeout", r
  assert "before bwrap started the program" in r.detail, r


def test_a_sandbox_killed_during_bwraps_set_up_leaves_no_process():
  """A kill that lands while bwrap's child still waits in its set-up handshake (before it sets
  its death signal and its own session) must take that child too. Before the fix (the outer bwrap
  only was killed) such a child slept on its eventfd forever under init: 8, 10 and 6 of 120 runs
  here (short wall limits swept 2-41 ms, three busy loops beside), and two were found after
  fresh-clone suite runs."""
  import os
  import subprocess
  import sys
  import time
  import uuid
  tag = "fn_" + uuid.uuid4().hex        # the functional-mode name is on the sandbox's command line

  def left():
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{p}/cmdline", "rb") as f:
          if tag.encode() in f.read():
            pids.append(int(p))
      except OSError:
        pass
    return pids

  busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(3)]
  statuses = {}
  try:
    for i in range(120):
      r = sandbox.run_program(f"def {tag}():\n  return 1\n", fn_name=tag,
                              limits=Limits(wall_s=0.002 + 0.001 * (i % 40)))
      statuses[r.status] = statuses.get(r.status, 0) + 1
  finally:
    for b in busy:
      b.kill()
      b.wait()
  time.sleep(0.5)
  survivors = left()
  details = {p: open(f"/proc/{p}/cmdline", "rb").read()[:120] for p in survivors}
  for p in survivors:
    os.kill(p, 9)
  assert statuses.get("timeout", 0) >= 20, statuses          # the sweep did kill sandboxes early
  assert set(statuses) <= {"timeout", "ok"}, statuses
  assert not survivors, details
