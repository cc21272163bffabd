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

import jax
import pytest
from helpers import drive_continuous

from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax import config as common
from scalerl_jax import models, rewards
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.data import build_dataset
from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer
from scalerl_jax.generation import fake
from scalerl_jax.generation.worker import Worker
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.config import apply_overrides
from scalerl_jax.rewards import isolation
from scalerl_jax.rewards import math as math_reward
from scalerl_jax.training.trainer import generator_metrics
from scalerl_jax.weights.stream import StreamPublisher

pytestmark = pytest.mark.xdist_group("grade_isolation")

PAIRS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "math_pairs.jsonl")
DEADLINE_S = 1.5
SLACK_S = 1.0          # kill + reap of the overrunning worker, on a loaded 2-core machine
# Below the deadline: a grade that held the GIL (the replaced thread pool) would stall the
# heartbeat for at least DEADLINE_S (> 60 s for 2^{2^40}); the control run measures 0.01-0.06 s,
# the grading run 0.07-0.33 s on the shared 2-core machine (scheduling, not the GIL).
HEARTBEAT_BOUND_S = 1.0
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


def test_generator_serving_hostile_answers_keeps_decoding_heartbeating_and_pushing(tmp_path):
  """A real Worker (scripted backend, generator.continuous, the math reward, guards off so every
  hostile answer runs into the deadline) against a real buffer: every 5th sample boxes a hostile
  answer; all groups are pushed, heartbeats never pause past the bound, decoding goes on while
  grades time out, and the faults reach the heartbeat counters."""
  write_llama3_style_tokenizer(str(tmp_path / "tok"), vocab_size=512)
  rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3, 7) for b in (11, 12)]
  (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = tiny.get_config()
  apply_overrides(c, [
      "--config.data.kind=polaris", "--config.data.heldout=2", f"--config.data.path={tmp_path / 'math.jsonl'}",
      f"--config.data.tokenizer_path={tmp_path / 'tok'}", "--config.data.template=reasoning_instruct",
      "--config.generator.backend=scripted", "--config.generator.continuous=True",
      "--config.generator.decode_batch=8", "--config.generator.groups_per_lease=2",
      "--config.generator.heartbeat_s=0.1", "--config.generator.scripted_hostile_every=5",
      "--config.rewards.grade_timeout_s=1.0", "--config.rewards.grade_guard=False",
      "--config.rewards.log=False", "--config.model.vocab_size=512", "--config.model.num_layers=1",
      "--config.model.d_model=64", "--config.model.num_heads=1", "--config.model.ffn_dim=128",
      "--config.rollout.max_prompt_len=96", "--config.rollout.think_budget_min=48",
      "--config.rollout.think_budget_max=64", "--config.rollout.answer_budget=32"])
  B, G = 2, 4
  ds = build_dataset(c.data, c.rollout.max_prompt_len)
  params = jax.device_get(models.init_params(model_sections.model_config(c), jax.random.PRNGKey(0)))
  token = "grade-isolation-test-token"
  srv = BufferServer(ds.train, token=token, prompts_per_step=B, group_size=G, max_lag=1).start()
  os.environ[c.buffer.auth_token_env] = token
  client = BufferClient(srv.address, token, retries=3)
  StreamPublisher(client, 0, params).publish()
  worker = Worker(common.RunConfig.from_config(c), srv.address, "gen-0", "scripted", str(tmp_path))
  assert worker.continuous_ok() == ""
  beats, hb = [], worker.client.heartbeat

  def heartbeat(*a, **kw):
    beats.append(time.monotonic())
    return hb(*a, **kw)
  worker.client.heartbeat = heartbeat
  grades, grade = [], worker.rewards

  def rewards_(completion, answer, prompt_id=None, log=None):
    t, chunks = time.monotonic(), worker.decode_stats.chunks
    r = grade(completion, answer, prompt_id, log)
    grades.append((time.monotonic() - t, worker.decode_stats.chunks - chunks, r))
    return r
  worker.rewards = rewards_
  rewards_seen = []
  drive_continuous(
      worker, client, srv, 2, B, G,
      publish=lambda v: StreamPublisher(client, v, params).publish(),
      on_batch=lambda _, b: rewards_seen.extend(r.rewards[0] for g in b.groups for r in g.rollouts),
      timeout_s=120)
  gen = worker.gen
  assert isinstance(gen, fake.ScriptedInstructModel) and gen.hostile >= 3, gen.hostile
  st = worker.decode_stats
  assert st.grade_timeout >= 3 and st.graded >= 2 * B * G, st
  # decoding went on while grades ran into their deadline (other slots kept decoding)
  slow = [(s, d) for s, d, _ in grades if s >= 0.9]
  assert len(slow) >= 3 and sum(d for _, d in slow) > 0, slow
  # right answers still score (even samples are right, reasoning_instruct boxes them)
  assert 1.0 in rewards_seen
  gaps = [b - a for a, b in zip(beats, beats[1:])]
  assert beats and max(gaps) < 0.1 + HEARTBEAT_BOUND_S, max(gaps)
  m = generator_metrics(st.heartbeat_stats())
  assert m["gen_grade_timeout"] == st.grade_timeout and 0 < m["gen_grade_fail_frac"] < 1, m


def test_fault_counts_reach_metrics_and_the_health_signal():
  from scalerl_jax.generation.slots import DecodeStats
  from scalerl_jax.training.health import HealthMonitor
  st = DecodeStats(slot_steps=10, live_row_steps=5)
  for reason in ["pass"] * 90 + ["grade_timeout"] * 6 + ["grade_oom", "grade_error"] + ["grade_guard"] * 2:
    st.count_grade(reason)
  m = generator_metrics(st.heartbeat_stats())
  assert (m["gen_graded"], m["gen_grade_timeout"], m["gen_grade_oom"], m["gen_grade_error"],
          m["gen_grade_guard"]) == (100, 6, 1, 1, 2)
  assert m["gen_grade_fail_frac"] == pytest.approx(0.10)
  h = HealthMonitor(dataclasses.replace(common.Health(), max_grade_fail_frac=0.05,
                                        abort_on="grade_fail", abort_from_step=3))
  out = h.check({"step": 1, **m})
  assert out["health/grade_fail"] == pytest.approx(0.10) and out["health/grade_fail_alarm"] == 1
  # the rate is over the grades since the previous record: 100 more, 1 fault -> 1 %
  m2 = dict(m, gen_graded=200.0, gen_grade_timeout=7.0)
  out = h.check({"step": 2, **m2})
  assert out["health/grade_fail"] == pytest.approx(0.01) and out["health/grade_fail_alarm"] == 0
  from scalerl_jax.training.health import RunUnhealthy
  with pytest.raises(RunUnhealthy, match="grade_fail"):
    h.check({"step": 3, **dict(m2, gen_graded=210.0, gen_grade_timeout=17.0)})
