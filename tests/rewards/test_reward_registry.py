"""Reward registry: math via Math-Verify, synthetic, and sandboxed code tests."""
import json
import threading

import pytest

from scalerl_jax import rewards


def test_registry():
  assert {"math", "code", "synthetic"} <= set(rewards.names())
  with pytest.raises(ValueError, match="unknown reward 'nope'"):
    rewards.get("nope")
  with pytest.raises(ValueError, match="already registered"):
    rewards.register("math")(lambda c, a: 0.0)


def test_strip_thinking():
  assert rewards.strip_thinking("a </think> b </think> c") == " c"
  assert rewards.strip_thinking("no close") is None


@pytest.mark.parametrize("completion,answer,want", [
    ("so x=1/2 </think> The answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("</think> \\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("</think> \\boxed{\\frac{2}{4}}", "\\frac12", 1.0),
    ("</think> Final answer: $\\sqrt{2}/2$", "\\frac{\\sqrt{2}}{2}", 1.0),
    ("</think> \\boxed{3\\pi}", "3\\pi", 1.0),
    ("</think> \\boxed{(1, 2)}", "(1,2)", 1.0),
    ("</think> \\boxed{204}", "204", 1.0),
    ("</think> \\boxed{205}", "204", 0.0),
    ("</think> \\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("</think> \\boxed{x^2+2x+1}", "(x+1)^2", 1.0),
    # the thinking part is never graded: a right answer inside it does not count
    ("\\boxed{0.5} </think> I give up.", "0.5", 0.0),
    ("\\boxed{0.5} still thinking", "0.5", 0.0),       # no </think> -> 0
])
def test_math_reward(completion, answer, want):
  assert rewards.compute_reward("math", completion, answer) == want


def test_math_reward_in_thread():
  out = []
  t = threading.Thread(target=lambda: out.append(
      rewards.compute_reward("math", "</think> \\boxed{\\frac{1}{2}}", "0.5")))
  t.start(); t.join()
  assert out == [1.0]


ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
TESTS = json.dumps([{"input": "1 2\n", "output": "3\n"}, {"input": "10 -4", "output": "6"}])


def block(code, lang="python"):
  return f"thinking... </think> Here is my solution:\n```{lang}\n{code}```\n"


def test_code_reward_stdin():
  assert rewards.compute_reward("code", block(ADD), TESTS) == 1.0
  assert rewards.compute_reward("code", block(ADD, lang=""), TESTS) == 1.0
  wrong = "a, b = map(int, input().split())\nprint(a - b)\n"
  assert rewards.compute_reward("code", block(wrong), TESTS) == 0.0
  # last block after </think> is graded; code only inside the thinking does not count
  assert rewards.compute_reward("code", block(wrong) + block(ADD).split("</think>")[1], TESTS) == 1.0
  assert rewards.compute_reward("code", f"```python\n{ADD}``` no close", TESTS) == 0.0
  assert rewards.compute_reward("code", "</think> no code", TESTS) == 0.0


def test_code_reward_float_tolerance_and_errors():
  tests = json.dumps([{"input": "", "output": "0.3333333333"}])
  assert rewards.compute_reward("code", block("print(1/3)\n"), tests) == 1.0
  assert rewards.compute_reward("code", block("raise SystemExit(1)\n"), tests) == 0.0
  assert rewards.compute_reward("code", block("print(1/0)\n"), tests) == 0.0


def test_code_reward_timeout_and_memory_limits():
  tests = [{"input": "", "output": "ok"}]
  assert not rewards.run_tests("while True: pass\n", tests, timeout_s=1.0)
  assert not rewards.run_tests("x = bytearray(4 << 30)\nprint('ok')\n", tests, timeout_s=5.0)
  assert rewards.run_tests("print('ok')\n", tests, timeout_s=5.0)
  alloc = "x = bytearray(300 << 20)\nprint('ok')\n"      # 300 MiB: over a 200 MiB limit, under 1 GiB
  assert rewards.run_tests(alloc, tests, timeout_s=5.0)
  assert not rewards.run_tests(alloc, tests, timeout_s=5.0, memory_bytes=200 << 20)


def test_code_reward_from_threads():
  out = []
  threads = [threading.Thread(target=lambda: out.append(rewards.compute_reward("code", block(ADD), TESTS)))
             for _ in range(3)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert out == [1.0, 1.0, 1.0]


def test_code_reward_functional():
  answer = json.dumps({"fn_name": "add", "tests": [
      {"input": "1\n2", "output": "3", "testtype": "functional"},
      {"input": "[1, 2]\n[3]", "output": "[1, 2, 3]", "testtype": "functional"}]})
  assert rewards.compute_reward("code", block("def add(a, b):\n  return a + b\n"), answer) == 1.0
  cls = "class Solution:\n  def add(self, a, b):\n    return a + b\n"
  assert rewards.compute_reward("code", block(cls), answer) == 1.0
  assert rewards.compute_reward("code", block("def add(a, b):\n  return a\n"), answer) == 0.0


def test_code_answer_errors():
  with pytest.raises(ValueError, match="not JSON"):
    rewards.parse_tests("{bad")
  with pytest.raises(ValueError, match="'input' and 'output'"):
    rewards.parse_tests(json.dumps([{"in": 1}]))
  with pytest.raises(ValueError, match="no 'fn_name'"):
    rewards.parse_tests(json.dumps([{"input": "1", "output": "1", "testtype": "functional"}]))
