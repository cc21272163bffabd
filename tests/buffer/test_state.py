"""Unit tests of the buffer state machine (admission.BufferState) with a fake clock, no gRPC."""
import grpc
import numpy as np
import pytest

from scalerl_jax.buffer import state as admission
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.generation.fake import random_completion
from scalerl_jax.types import PromptSpec


class Clock:
  def __init__(self):
    self.t = 1000.0

  def __call__(self):
    return self.t


def _state(B=1, G=2, k=1, mode="pipeline", n=8, **kw):
  prompts = [PromptSpec(i, np.array([i, i + 1], np.int32), "a") for i in range(n)]
  clock = Clock()
  return admission.BufferState(prompts, prompts_per_step=B, group_size=G, max_lag=k, mode=mode,
                               clock=clock, lease_ttl_s=10, **kw), clock


def _fill(st, a, version=None, rng=np.random.default_rng(0), samples=None, tag=""):
  """Stores rollouts for assignment `a` (all samples unless `samples` given); returns the acks."""
  v = a.min_version if version is None else version
  items = []
  for i in (range(a.group_size) if samples is None else samples):
    r = codec.completion_to_rollout(random_completion(rng, a.prompt_id, 5, v), group_id=a.group_id,
                                    sample_index=i, prompt_tokens=codec.decode(
                                        a.prompt_tokens, pb.INT32, "p", 99),
                                    generator_id="g", rollout_id=f"{a.group_id}-{i}{tag}")
    raw = r.SerializeToString()
    items.append((pb.Rollout.FromString(raw), raw))
  return st.add_rollouts(items)


def test_capacity_formula_pipeline():
  st, _ = _state(B=2, k=3)
  assert st.capacity() == (0 + 3 - 0 + 1) * 2                    # (v + k - ns + 1) * B
  got = st.lease("g", 100, 0)
  assert len(got) == 8 and st.capacity() == 0
  assert st.lease("g", 1, 0) == []                               # nothing beyond the window
  assert {a.min_version for a in got} == {0} and {a.max_version for a in got} == {-1}


def test_k0_is_synchronous():
  st, _ = _state(B=2, k=0)
  a = st.lease("g", 10, 0)
  assert len(a) == 2
  for x in a:
    _fill(st, x)
  b = st.pull(0, 0)
  assert b.summary.lag.max_lag == 0 and st.capacity() == 0       # wait for the new weights
  st.set_version(1)
  a = st.lease("g", 10, 0)
  assert len(a) == 2 and {x.min_version for x in a} == {1}


def test_edf_waits_for_due_group_instead_of_going_stale():
  st, _ = _state(B=1, k=1)
  x, y = st.lease("g", 2, 0)                                     # deadline 0 + 1 = 1
  _fill(st, y)
  assert st.pull(0, 0).summary.num_groups == 1                   # y
  st.set_version(1)
  (z,) = st.lease("g", 5, 0)                                     # deadline 2
  _fill(st, z)
  with pytest.raises(val.RejectError) as e:                      # x is due at step 1: block on it
    st.pull(1, 0)
  assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
  _fill(st, x)
  b = st.pull(1, 0)
  gid = pb.BatchItem.FromString(b.groups[0]).group.group_id
  assert gid == x.group_id and b.summary.lag.max_lag == 1 and st.stale_dropped == 0


def test_idempotent_all_or_nothing_and_validation():
  st, _ = _state(G=2)
  (a,) = st.lease("g", 1, 0)
  acks = _fill(st, a, samples=[0])
  assert not acks[0].duplicate
  assert _fill(st, a, samples=[0])[0].duplicate                  # same rollout id: ack, store once
  before = st.contents()
  with pytest.raises(val.RejectError) as e:                      # new id for a filled slot
    _fill(st, a, samples=[1, 0], tag="x")
  assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
  assert st.contents() == before                                 # sample 1 was not stored either
  with pytest.raises(val.RejectError) as e:                      # version from the future
    _fill(st, a, version=5, samples=[1])
  assert "future" in e.value.message and st.contents() == before
  acks = _fill(st, a, samples=[1])
  assert acks[0].group_complete


def test_pull_resend_and_step_order():
  st, _ = _state(B=1, k=0)
  (a,) = st.lease("g", 1, 0)
  _fill(st, a)
  b0 = st.pull(0, 0)
  assert st.pull(0, 0) is b0                                     # retried pull: same batch
  for bad in (5, -1):
    with pytest.raises(val.RejectError) as e:
      st.pull(bad, 0)
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
  assert st.delivered_groups == 1


def test_lease_expiry_frees_capacity_and_returns_prompt():
  st, clock = _state(B=1, k=0)
  (a,) = st.lease("g", 1, 0)
  _fill(st, a, samples=[0])
  assert st.capacity() == 0
  clock.t += 5
  assert st.heartbeat("g") == 1                                  # extends to t + 10
  clock.t += 8
  assert st.lease("h", 1, 0) == []                               # still leased
  clock.t += 5
  (b,) = st.lease("h", 1, 0)                                     # expired: same prompt again
  assert b.prompt_id == a.prompt_id and b.group_id != a.group_id and st.expired_groups == 1
  with pytest.raises(val.RejectError) as e:
    _fill(st, a, samples=[1])
  assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_heartbeat_listing_groups_lets_an_unknown_lease_expire():
  """A generator's heartbeats extend only the groups it lists: a group leased to it whose lease
  response it never got (lost in a buffer crash; it does not know it holds the group) expires
  after the TTL and its prompt is leased again, instead of blocking its step forever (the hang
  test_fault_buffer's kill -9 of the buffer once hit: 12 groups outstanding, none completing)."""
  st, clock = _state(B=2, k=0)
  known, orphan = st.lease("g", 2, 0)
  for _ in range(4):                                             # 4 heartbeats, 16 s > TTL 10 s
    clock.t += 4
    assert st.heartbeat("g", [known.group_id]) == 1
  (again,) = st.lease("h", 1, 0)
  assert again.prompt_id == orphan.prompt_id and st.expired_groups == 1
  _fill(st, known)                                               # the listed one is still leased
  _fill(st, again)
  assert len(st.pull(0, 0).groups) == 2
  # Without a list (older clients): every incomplete group of the generator is extended.
  st2, clock2 = _state(B=2, k=0)
  st2.lease("g", 2, 0)
  clock2.t += 8
  assert st2.heartbeat("g") == 2
  clock2.t += 8
  assert st2.lease("h", 1, 0) == [] and st2.expired_groups == 0


def test_ppo_off_policy_round():
  st, _ = _state(B=2, k=2, mode="ppo_off_policy")
  got = st.lease("g", 100, 0)
  assert len(got) == 4 and {(a.min_version, a.max_version) for a in got} == {(0, 0)}
  for a in got[:3]:
    _fill(st, a)
  with pytest.raises(val.RejectError):                           # round not complete yet
    st.pull(0, 0)
  _fill(st, got[3])
  st.pull(0, 0)
  st.set_version(1)
  assert st.capacity() == 0                                      # mid-round: no new leases
  assert st.pull(1, 0).summary.lag.max_lag == 1
  st.set_version(2)
  assert st.capacity() == 4
  with pytest.raises(ValueError):
    _state(mode="ppo_off_policy", k=0)


def _records(frames, path):
  """(type, body) pairs of framed WAL records, read back through the WAL's own segment reader."""
  from scalerl_jax.buffer import wal as walmod
  path.write_bytes(b"".join(frames))
  records, torn = walmod.read_segment(str(path))
  assert torn is None
  return records


def test_snapshot_apply_round_trip_rebuilds_the_same_state(tmp_path):
  """Composition contract of the durable side: `snapshot()` yields the whole state as WAL records
  and `apply` of each, on a fresh state, rebuilds it (same snapshot, same contents digest, same next
  batch); a duplicate ROLLOUT record is reported as skipped."""
  from scalerl_jax.buffer import wal as walmod
  st, clock = _state(B=2, G=2, k=2, npr_threshold=0.9, shuffle_seed=3)
  got = st.lease("g", 3, 0)
  for a in got[:2]:
    _fill(st, a)
  _fill(st, got[2], samples=[0])                       # one group half done
  st.pull(0, 0)                                        # delivered at step 0
  st.set_version(1)
  more = st.lease("g", 2, 0)
  _fill(st, more[0])
  decoded = _records(st.snapshot(), tmp_path / "a.log")
  assert {t for t, _ in decoded} >= {walmod.SNAPSHOT, walmod.LEASE, walmod.ROLLOUT, walmod.QUEUE,
                                     walmod.LAST_BATCH, walmod.NPR_STATE}
  fresh, _ = _state(B=2, G=2, k=2, npr_threshold=0.9, shuffle_seed=3)
  assert all(fresh.apply(t, body) for t, body in decoded)
  assert _records(fresh.snapshot(), tmp_path / "b.log") == decoded
  assert fresh.contents().digest == st.contents().digest
  dup = next((t, b) for t, b in decoded if t == walmod.ROLLOUT)
  assert fresh.apply(*dup) is False                    # the same rollout again: skipped
  # both serve the same next lease and the same next batch once complete
  a1, a2 = st.lease("g", 1, 0), fresh.lease("g", 1, 0)
  assert [(a.group_id, a.prompt_id) for a in a1] == [(a.group_id, a.prompt_id) for a in a2]


def test_heartbeat_stats_are_summed_into_every_batch_summary():
  """Generators' cumulative counters (continuous batching occupancy, idle and grading seconds)
  ride on heartbeats; every BatchSummary carries their sum over generator incarnations; bad
  counters are refused with one line and change nothing."""
  from scalerl_jax.training.trainer import generator_metrics
  st, _ = _state(B=1, k=1)
  st.heartbeat("g@1", stats={"slot_steps": 640, "live_row_steps": 600, "idle_s": 1.5})
  st.heartbeat("g@2", stats={"slot_steps": 320, "live_row_steps": 200, "grade_s": 2.0})
  st.heartbeat("g@1", stats={"slot_steps": 1280, "live_row_steps": 1200, "idle_s": 2.5})
  for bad in ({"slot_steps": float("nan")}, {"x" * 65: 1.0}, {"slot_steps": -1.0},
              {f"k{i}": 1.0 for i in range(17)}):
    with pytest.raises(val.RejectError, match="heartbeat stats"):
      st.heartbeat("g@3", stats=bad)
  a = st.lease("g@1", 1, 0)[0]
  _fill(st, a)
  got = dict(st.pull(0, 0).summary.generator_stats)
  assert got == {"slot_steps": 1600.0, "live_row_steps": 1400.0, "idle_s": 2.5, "grade_s": 2.0}
  m = generator_metrics(got)
  assert m == {"gen_occupancy": 1400 / 1600, "gen_idle_s": 2.5, "gen_grade_s": 2.0,
               "gen_decode_s": 0.0}
  assert generator_metrics({}) == {}


def _fast_fleet_lags(max_ahead, steps=12, B=2, k=8):
  """A fleet infinitely faster than the learner (forced, no timing): before every pull the
  generator leases everything admission allows and completes it at once with the newest version;
  the learner pulls step s and publishes version s + 1. Returns each step's lag histogram."""
  st, _ = _state(B=B, G=2, k=k, n=64, max_ahead=max_ahead)
  out = []
  for s in range(steps):
    for a in st.lease("g", 100, 0):
      _fill(st, a, version=st.version)
    out.append(list(st.pull(s, 0).summary.lag.counts))
    st.set_version(s + 1)
  return out, st


def test_freshness_bound_caps_lag_of_a_fast_fleet():
  """PipelineRL-8 with a fast fleet trains every token at lag 8 once the window is full; with
  max_ahead = a the same fleet trains at lag a (0: synchronous), max_lag unchanged (deadlines)."""
  off, st = _fast_fleet_lags(-1)
  assert st.ahead == 8 and st.capacity() == 2               # one batch per published version
  assert all(len(h) == 9 and sum(h[:8]) == 0 for h in off[8:]), off   # every token at lag 8
  for a in (0, 1, 3):
    lags, st = _fast_fleet_lags(a)
    assert all(len(h) == a + 1 and sum(h[:a]) == 0 for h in lags[a:]), (a, lags)
    assert max(len(h) - 1 for h in lags) == a and st.k == 8
  same, _ = _fast_fleet_lags(8)                              # a >= k: PipelineRL-k exactly
  assert same == off


def test_freshness_bound_refused_outside_pipeline_and_below_minus_one():
  with pytest.raises(ValueError, match="max_ahead"):
    _state(k=2, mode="ppo_off_policy", max_ahead=1)
  with pytest.raises(ValueError, match="max_ahead"):
    _state(max_ahead=-2)
