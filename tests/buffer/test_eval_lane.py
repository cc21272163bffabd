"""The buffer's evaluation lane (issue 15 item 4): scheduling ahead of training, version pinning,
validation of requests and results, expiry, and the RPC round trip. No JAX."""
import grpc
import numpy as np
import pytest

from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.buffer.state import BufferState
from scalerl_jax.training.fleet_eval import eval_prompts, summarize_results
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.types import PromptSpec

TRAIN = [PromptSpec(i, np.array([1, 2, 3 + i % 5], np.int32), str(i)) for i in range(32)]
HELD = [PromptSpec(10_000 + i, np.array([4, 5 + i % 3], np.int32), str(i), "") for i in range(10)]


class Clock:
  def __init__(self):
    self.t = 1000.0

  def __call__(self):
    return self.t


def _state(clock=None):
  return BufferState(TRAIN, prompts_per_step=2, group_size=2, max_lag=1, lease_ttl_s=10.0,
                     clock=clock or Clock())


def _request(eval_id=1, version=0, prompts=HELD, samples=3, **kw):
  return pb.EvalRequest(eval_id=eval_id, version=version, samples_per_prompt=samples, seed=7,
                        temperature=kw.get("temperature", 1.0), top_p=kw.get("top_p", 1.0),
                        prompts=[pb.EvalPrompt(prompt_id=p.prompt_id,
                                               prompt_tokens=codec.encode(p.tokens, pb.INT32),
                                               answer=p.answer, task=p.task) for p in prompts])


def _result(a, rewards, version=None, gen="g0"):
  n = len(rewards)
  return pb.EvalGroupResult(eval_id=a.eval_id, group_id=a.group_id, prompt_id=a.prompt_id,
                            rewards=rewards, lengths=[5] * n, finish_reasons=[pb.FINISH_STOP] * n,
                            generator_id=gen, device_seconds=0.5,
                            version=a.min_version if version is None else version)


def test_eval_groups_lease_ahead_of_training_and_only_to_holders():
  st = _state()
  st.set_version(1)
  st.submit_eval(_request(version=1))
  assert st.eval_versions() == [1]
  # A generator that does not hold version 1 gets training groups, never evaluation ones.
  train = st.lease("g-old", 2, 0.0, held_versions=[0])
  assert train and all(a.eval_id == 0 for a in train)
  # One that holds it gets evaluation groups first, pinned to exactly version 1.
  ev = st.lease("g0", 4, 0.0, held_versions=[0, 1], max_eval_groups=6)
  assert [a.group_id for a in ev] == list(range(6)) and all(a.eval_id == 1 for a in ev)
  assert all(a.min_version == a.max_version == 1 and a.group_size == 3 for a in ev)
  assert [a.prompt_id for a in ev] == [p.prompt_id for p in HELD[:6]]
  assert all(a.eval_seed == 7 and a.answer == HELD[a.group_id].answer for a in ev)
  rest = st.lease("g1", 8, 0.0, held_versions=[1])
  assert [a.group_id for a in rest] == list(range(6, 10))
  # Lane empty (all leased): training again; evaluation groups never count in admission.
  cap = st.capacity()
  assert cap > 0 and all(a.eval_id == 0 for a in st.lease("g1", 1, 0.0, held_versions=[1]))
  res = st.collect_eval(1, 0.0)
  assert not res.complete and res.held and res.pending_groups == 10


def test_results_complete_collect_and_never_enter_training():
  st = _state()
  st.submit_eval(_request(version=0))
  ev = st.lease("g0", 10, 0.0, held_versions=[0], max_eval_groups=10)
  before = st.contents()
  ack = st.add_eval_results([_result(a, [1.0, 0.0, float(a.group_id % 2)]) for a in ev[:4]])
  assert (ack.accepted, ack.duplicate) == (4, 0)
  again = st.add_eval_results([_result(ev[0], [1.0, 0.0, 0.0])])   # a retried push
  assert (again.accepted, again.duplicate) == (0, 1)
  st.add_eval_results([_result(a, [0.0, 0.0, 1.0]) for a in ev[4:]])
  res = st.collect_eval(1, 0.0)
  assert res.complete and [g.group_id for g in res.results] == list(range(10))
  assert st.collect_eval(1, 0.0) == res                # a retried collect: the same answer
  assert st.eval_versions() == []
  # Training state untouched: nothing stored, delivered or leased by the evaluation.
  after = st.contents()
  assert (after.stored_rollouts, after.delivered_groups, after.ready_groups) == (0, 0, 0)
  assert after.digest == before.digest
  m = summarize_results(res.results, [""] * 10)
  assert m["val_samples"] == 30 and m["val_prompts"] == 10
  want = np.mean([[1, 0, g % 2] for g in range(4)] + [[0, 0, 1]] * 6)
  assert m["val_pass_rate"] == pytest.approx(want)
  assert m["val_pass_at_n"] == 1.0


@pytest.mark.parametrize("mutate, msg", [
    (dict(version=1), "pinned to version 0"),
    (dict(rewards=[1.0, 0.0]), "expected 3"),
    (dict(rewards=[1.0, 0.0, 2.0]), "verifier range"),
    (dict(rewards=[1.0, 0.0, float("nan")]), "not finite"),
    (dict(prompt_id=5), "prompt_id"),
    (dict(device_seconds=-1.0), "device_seconds"),
    (dict(generator_id=""), "generator_id"),
])
def test_bad_results_are_refused_all_or_nothing(mutate, msg):
  st = _state()
  st.submit_eval(_request())
  ev = st.lease("g0", 2, 0.0, held_versions=[0], max_eval_groups=2)
  good = _result(ev[0], [1.0, 1.0, 1.0])
  bad = _result(ev[1], [1.0, 0.0, 0.0])
  for k, v in mutate.items():
    if k == "rewards":
      del bad.rewards[:]
      bad.rewards.extend(v)
    else:
      setattr(bad, k, v)
  with pytest.raises(val.RejectError, match=msg) as e:
    st.add_eval_results([good, bad])
  assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
  assert st.collect_eval(1, 0.0).pending_groups == 10     # the good one was not stored either


def test_bad_requests_and_unknown_evaluations():
  st = _state()
  for req, msg in [(_request(eval_id=0), "eval_id"), (_request(samples=0), "samples_per_prompt"),
                   (_request(prompts=[]), "prompts"), (_request(temperature=0.0), "temperature"),
                   (_request(top_p=1.5), "top_p")]:
    with pytest.raises(val.RejectError, match=msg):
      st.submit_eval(req)
  with pytest.raises(val.RejectError, match="not published") as e:
    st.submit_eval(_request(version=3))
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
  with pytest.raises(val.RejectError, match="not open") as e:
    st.collect_eval(99, 0.0)
  assert e.value.code == grpc.StatusCode.NOT_FOUND
  a = pb.Assignment(eval_id=5, group_id=0, prompt_id=HELD[0].prompt_id, min_version=0)
  with pytest.raises(val.RejectError, match="not open"):
    st.add_eval_results([_result(a, [1.0, 1.0, 1.0])])
  assert st.submit_eval(_request()).groups == 10
  assert st.submit_eval(_request()).duplicate                # idempotent on the id
  with pytest.raises(val.RejectError, match="not leased"):
    st.add_eval_results([_result(pb.Assignment(eval_id=1, group_id=0,
                                               prompt_id=HELD[0].prompt_id), [1.0] * 3)])
  cancelled = st.collect_eval(1, 0.0, cancel=True)
  assert not cancelled.complete and st.eval_versions() == []


def test_expired_eval_leases_go_back_to_the_front_and_heartbeats_keep_them():
  clock = Clock()
  st = _state(clock)
  st.submit_eval(_request())
  a = st.lease("g0", 3, 0.0, held_versions=[0], max_eval_groups=3)
  b = st.lease("g1", 3, 0.0, held_versions=[0], max_eval_groups=3)
  clock.t += 8
  assert st.heartbeat("g1") >= 3                            # g1's leases extended
  clock.t += 5                                              # g0's expired (ttl 10 s)
  c = st.lease("g2", 3, 0.0, held_versions=[0], max_eval_groups=3)
  assert [x.group_id for x in c] == [x.group_id for x in a]
  assert [x.group_id for x in b] == [3, 4, 5]


def test_an_evaluation_no_live_generator_holds_is_unservable():
  """Pinned to a superseded version that no generator reporting within a lease TTL holds (they
  all restarted, or none fetched it): `unservable`, so the learner stops waiting for it."""
  clock = Clock()
  st = _state(clock)
  st.set_version(1)
  st.submit_eval(_request(eval_id=1, version=1))
  st.set_version(2)
  st.submit_eval(_request(eval_id=2, version=2))            # the newest: fetchable, servable
  st.lease("g0", 1, 0.0, held_versions=[2])                 # a restarted generator: 2 only
  assert not st.collect_eval(1, 0.0).unservable             # superseded just now: grace
  clock.t += 9
  assert not st.collect_eval(1, 0.0).unservable
  clock.t += 2                                              # a lease TTL (10 s) since
  res = st.collect_eval(1, 0.0)
  assert res.unservable and not res.complete and not res.held and res.pending_groups == 10
  assert not st.collect_eval(2, 0.0).unservable             # never while it is the newest
  # A live generator that reports holding version 1 (heartbeat) makes it servable again ...
  assert st.heartbeat("g1", [], held_versions=[1, 2]) == 0
  assert not st.collect_eval(1, 0.0).unservable
  clock.t += 10
  assert not st.collect_eval(1, 0.0).unservable             # its report is a TTL old: still live
  clock.t += 1                                              # ... until it falls silent
  assert st.collect_eval(1, 0.0).unservable
  assert st.heartbeat("g1", []) == 0                        # an old client (no held list):
  assert st.collect_eval(1, 0.0).unservable                 # says nothing about versions
  st.set_version(3)
  clock.t += 11
  assert st.collect_eval(2, 0.0).unservable                 # 2 superseded a TTL ago, unheld
  with pytest.raises(val.RejectError, match="held_versions has"):
    st.heartbeat("g1", [], held_versions=list(range(st.limits.max_held_versions + 1)))


def test_learner_drops_an_unservable_evaluation_at_once():
  """The rehearsal's hang (2026-12-02, commit 1ddc97d, 2-core machine): every generator restarted after the learner started
  over and fetched only the newest version; the learner waited in `wait_held` for an evaluation
  of an older version for eval.timeout_s (30 min). Now it is dropped within a lease TTL, as an
  eval_failed line naming the reason, over the real RPCs."""
  import time
  from scalerl_jax.training.fleet_eval import FleetEvaluator
  srv = BufferServer(TRAIN, token="t", prompts_per_step=2, group_size=2, max_lag=1,
                     lease_ttl_s=0.5).start()
  try:
    c = BufferClient(srv.address, "t", retries=1)
    fe = FleetEvaluator(c, HELD, num_prompts=0, samples_per_prompt=2, seed=0, temperature=1.0,
                        top_p=1.0, hold_versions=2, timeout_s=1800.0)
    srv.state.set_version(1)
    fe.submit(step=1, version=1, snapshot={"compute_hours": 1.0})
    srv.state.set_version(2)
    srv.state.set_version(3)
    c.heartbeat("g-new", 3, group_ids=[], held_versions=[3])   # restarted: holds 3 only
    t0 = time.time()
    fe.wait_held(4)                                    # version 4 would push 1 out of the fleet
    waited = time.time() - t0
    assert 0.4 < waited < 5.0, waited                  # a lease TTL, not eval.timeout_s
    done = fe.poll()
    assert [(e.version, res) for e, res in done] == [(1, None)] and not fe.open
    rec = fe.record(*done[0])
    assert rec["kind"] == "eval_failed" and rec["eval_failed_reason"] == "unservable", rec
    assert rec["step"] == 1 and "val_pass_rate" not in rec
    assert srv.state.eval_versions() == []             # cancelled in the buffer too
    c.close()
  finally:
    srv.stop()


def test_eval_prompts_subset_and_errors():
  assert eval_prompts(HELD, 0) == HELD and eval_prompts(HELD, 10) == HELD
  sub = eval_prompts(HELD, 4, seed=3)
  assert len(sub) == 4 and sub == eval_prompts(HELD, 4, seed=3)
  assert [p.prompt_id for p in sub] == sorted(p.prompt_id for p in sub)   # split order
  with pytest.raises(ValueError, match="held-out split has 10"):
    eval_prompts(HELD, 11)


def test_rpc_round_trip():
  srv = BufferServer(TRAIN, token="t", prompts_per_step=2, group_size=2, max_lag=1).start()
  try:
    c = BufferClient(srv.address, "t", retries=1)
    assert c.submit_eval(_request()).groups == 10
    resp = c.lease_response("g0", 2, 0.0, held_versions=[0], max_eval_groups=10)
    assert list(resp.eval_versions) == [0] and len(resp.assignments) == 10
    assert all(a.eval_id == 1 for a in resp.assignments)
    ack = c.push_eval([_result(a, [1.0, 0.0, 1.0]) for a in resp.assignments])
    assert ack.accepted == 10
    res = c.collect_eval(1, timeout_s=1.0)
    assert res.complete and len(res.results) == 10
    with pytest.raises(grpc.RpcError) as e:
      c.collect_eval(12345)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
      c.submit_eval(_request(eval_id=2, samples=0))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    c.close()
  finally:
    srv.stop()


def test_ledger_books_fleet_evaluation_outside_the_x_axis(monkeypatch):
  from scalerl_jax.training import ledger
  now = [0.0]
  monkeypatch.setattr(ledger.time, "time", lambda: now[0])
  led = ledger.ComputeLedger(train_devices=1, gen_devices=2, params_active=1.0, _last=0.0)
  now[0] = 100.0
  led.tick()                             # 100 s: learner 100 device-s, generators 200
  led.begin_eval()
  now[0] = 110.0                         # a learner wait on evaluation: 10 s to eval
  led.end_eval()
  led.add_eval_gen(30.0)                 # generators report 30 device-s of evaluation leases
  snap = led.snapshot()
  assert snap["compute_hours"] * 3600 == pytest.approx(100 + 220 - 30)
  assert snap["eval_hours"] * 3600 == pytest.approx(10 + 30)
  assert snap["eval_gen_hours"] * 3600 == pytest.approx(30)
  assert snap["compute_hours_with_eval"] * 3600 == pytest.approx(100 + 220 + 10)
  back = ledger.ComputeLedger.resume(led.state_dict(), count_gap=False)
  assert back.eval_gen_seconds == 30.0
  old = {k: v for k, v in led.state_dict().items() if k != "eval_gen_seconds"}
  assert ledger.ComputeLedger.resume(old, count_gap=False).eval_gen_seconds == 0.0  # old ckpts
