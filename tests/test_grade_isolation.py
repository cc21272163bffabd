"""Issue 46: no model answer can stall the process that grades it (rewards/isolation.py).

Math is graded in worker processes with a hard deadline and a memory ceiling. Each hostile answer
below is graded 0 within the deadline while a heartbeat thread of this process keeps ticking
(the bound is stated against a control run of the same thread with nothing graded); the guards
give 0 without a worker; 272 shipped (answer, gold) pairs grade exactly as the in-process grader
did before the change (tests/data/math_pairs.jsonl, computed at 64759ef); and a generator serving
a `scripted` model that boxes such answers under generator.continuous keeps decoding,
heartbeating and pushing every group.
"""
import dataclasses
import json
import os
import threading
import time

import pytest

from configs import common
from scalerl_jax import rewards
from scalerl_jax.generation import fake
from scalerl_jax.rewards import isolation
from scalerl_jax.rewards import math as math_reward

pytestmark = pytest.mark.xdist_group("grade_isolation")

PAIRS = os.path.join(os.path.dirname(__file__), "data", "math_pairs.jsonl")
DEADLINE_S = 1.5
SLACK_S = 1.0          # kill + reap of the overrunning worker, on a loaded 2-core machine
HEARTBEAT_BOUND_S = 0.5
# The answers, and more: a deeper tower, a huge binomial, deep nesting, a page of powers.
HOSTILE = [f"\\boxed{{{a}}}" for a in fake.HOSTILE_ANSWERS] + [
    "\\boxed{10^{10^{10^{10}}}}", "\\boxed{\\binom{10^{12}}{10^{6}}}",
    "\\boxed{" + "(" * 3000 + "1" + ")" * 3000 + "}",
    "".join(f"Step {n}: \\boxed{{{n}^{{10^7}}}}\n" for n in range(2, 40)),
    "\\boxed{\\sqrt{2}^{\\sqrt{2}^{\\sqrt{2}^{99999999}}}}"]


def _section(**kw):
  return dataclasses.replace(common.Rewards(), **kw)


class Heartbeat:
  """A thread that ticks every 10 ms and records the longest gap between ticks."""

  def __init__(self):
    self.max_gap, self._stop = 0.0, threading.Event()
    self._t = threading.Thread(target=self._run, daemon=True)

  def _run(self):
    last = time.monotonic()
    while not self._stop.wait(0.01):
      now = time.monotonic()
      self.max_gap, last = max(self.max_gap, now - last), now

  def __enter__(self):
    self._t.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._t.join()


@pytest.fixture(scope="module")
def pool():
  p = isolation.GradePool(_section(grade_timeout_s=DEADLINE_S, grade_memory_mb=256,
                                   grade_guard=False))
  yield p
  p.shutdown()


def test_hostile_answers_graded_zero_within_the_deadline_heartbeat_never_stalls(pool):
  p0 = pool.grade("math", "</think>\\boxed{3}", "3", True)   # workers warm (start-up not timed)
  assert (p0.reward, p0.reason) == (1.0, "pass"), p0
  with Heartbeat() as control:           # the same thread while this one only sleeps
    time.sleep(2.0)
  results = {}

  def grade(i, text):
    t = time.monotonic()
    results[i] = (pool.grade("math", "<think>hm</think> The answer is " + text, "7", True),
                  time.monotonic() - t)
  with Heartbeat() as hb:
    for k in range(0, len(HOSTILE), 2):    # two at a time: both workers busy
      ts = [threading.Thread(target=grade, args=(i, HOSTILE[i]))
            for i in range(k, min(k + 2, len(HOSTILE)))]
      for t in ts:
        t.start()
      for t in ts:
        t.join()
      pool.wait_ready()                    # replacements' start-up: outside the timed grades
  for i, text in enumerate(HOSTILE):
    g, took = results[i]
    assert g.reward == 0.0, (text[:60], g)
    assert took < DEADLINE_S + SLACK_S, (text[:60], took, g)
  timed = [results[i][1] for i in range(len(HOSTILE)) if results[i][0].reason == "grade_timeout"]
  assert len(timed) >= 5, [(HOSTILE[i][:40], results[i][0].reason) for i in results]
  # the heartbeat thread never waited on a grade (a thread-pool grader stalled it for > 60 s)
  assert hb.max_gap < HEARTBEAT_BOUND_S, (hb.max_gap, control.max_gap)
  print(f"heartbeat max gap {hb.max_gap:.3f} s while grading, {control.max_gap:.3f} s control;",
        sorted(g.reason for g, _ in results.values()), max(t for _, t in results.values()))
  c = pool.counts()
  assert c["grade_timeout"] == len(timed) and c["graded"] == len(HOSTILE) + 1, c
  # the pool still grades right after all those kills
  g = pool.grade("math", "</think>\\boxed{\\frac{1}{2}}", "0.5", True)
  assert (g.reward, g.reason) == (1.0, "pass"), g


def test_a_grade_past_the_memory_ceiling_is_grade_oom_and_the_worker_replaced():
  p = isolation.GradePool(_section(grade_timeout_s=30.0, grade_memory_mb=64, grade_processes=1))
  try:
    g = p.grade("math", "</think>\\boxed{" + "9" * 80_000_000 + "}", "7", True)
    assert (g.reward, g.reason) == (0.0, "grade_oom"), g
    g = p.grade("math", "</think>\\boxed{7}", "7", True)
    assert (g.reward, g.reason) == (1.0, "pass"), g
    assert p.counts()["grade_oom"] == 1
  finally:
    p.shutdown()


def test_guards_give_zero_without_a_worker_unless_the_gold_has_the_same_hazard():
  for text in HOSTILE[:5] + HOSTILE[8:]:
    assert math_reward.hazard("</think>" + text, "7"), text[:60]
  assert math_reward.hazard("</think>\\boxed{2^{2^{40}}}", "2^{2^{40}}") == ""   # the deadline decides
  assert math_reward.hazard("<think>2^{2^{40}} is huge</think> \\boxed{5}", "5") == ""
  for safe in ("\\boxed{2^{10}}", "\\boxed{5!}", "\\boxed{(n-1)!}", "\\boxed{10^{6}}",
               "\\boxed{\\frac{\\sqrt{3}}{2}}", "\\boxed{[1, \\infty)}"):
    assert math_reward.hazard("</think>" + safe, "1") == "", safe
  p = isolation.GradePool(_section(grade_processes=1))
  try:
    t = time.monotonic()
    gs = [p.grade("math", "</think>" + h, "7", True, guard=math_reward.hazard) for h in HOSTILE[:5]]
    assert time.monotonic() - t < 1.0
    assert {(g.reward, g.reason) for g in gs} == {(0.0, "grade_guard")}, gs
    assert p.counts()["grade_guard"] == 5
  finally:
    p.shutdown()


def test_shipped_pairs_grade_as_before():
  pairs = [json.loads(l) for l in open(PAIRS)]
  assert len(pairs) >= 272 and sum(p["reward"] == 1.0 for p in pairs) >= 200
  assert {"fraction", "radical", "interval", "latex"} <= {p["kind"] for p in pairs}
  isolation.configure(common.Rewards())          # the defaults: what a run grades with
  try:
    got = [rewards.grade("math", "<think>x</think> " + p["answer"], p["gold"]) for p in pairs]
  finally:
    isolation.shutdown()
  diff = [(p, g) for p, g in zip(pairs, got) if g.reward != p["reward"]]
  assert not diff, diff[:5]
  assert not [g for g in got if g.reason.startswith("grade_")]
