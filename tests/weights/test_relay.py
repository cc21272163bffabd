"""Relay fan-out (issue 44): generators pass on the chunks they fetched (a tree of fan-out k), so
the learner source's egress per version is about one model whatever the number of generators; a
relay killed mid-version does not stop the others from completing it."""
import threading

import numpy as np

from scalerl_jax.buffer import state as admission
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.types import PromptSpec
from scalerl_jax.weights import delta as wd
from scalerl_jax.protocol.weight_chunks import tree_parents
from scalerl_jax.weights.relay import start_relay
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher, flatten

TOKEN = "relay-test-token"


def _params(seed):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((128, 64)).astype(np.float32),
          "layers": [{"w": rng.standard_normal((64, 64)).astype(np.float32)} for _ in range(3)]}


def _step(p, rng):
  return {"embed": (p["embed"] + 1e-3 * (rng.random(p["embed"].shape) < 0.05)).astype(np.float32),
          "layers": [{"w": (x["w"] * np.float32(1 + 1e-3 * (rng.random() < 0.5))).astype(
              np.float32)} for x in p["layers"]]}


def _bits(params):
  return [np.asarray(leaf).reshape(-1).view(np.uint16).copy() for _, leaf in flatten(params)]


def _ref(params):
  return _bits({"embed": params["embed"].astype(wd_bf16()),
                "layers": [{"w": x["w"].astype(wd_bf16())} for x in params["layers"]]})


def wd_bf16():
  import ml_dtypes
  return ml_dtypes.bfloat16


def test_tree_parents():
  addrs = [f"g{j}" for j in range(10)]
  assert tree_parents(0, 2, addrs) == []
  assert tree_parents(9, 2, addrs) == ["g4", "g1", "g0"]
  assert tree_parents(9, 1, addrs, depth=2) == ["g8", "g7"]        # a chain
  assert tree_parents(5, 0, addrs) == []                             # relays off


def _stop(relays, src, c, srv):
  for r in relays:
    r.stop()
  src.stop()
  c.close()
  srv.stop()


def _fleet(c, G, fanout):
  relays = [start_relay(TOKEN, host="127.0.0.1") for _ in range(G)]
  addrs = [r.address for r in relays]
  fetchers = []
  for j in range(G):
    f = StreamFetcher(c)
    f.relay = relays[j]
    f.parents = (lambda j=j: tree_parents(j, fanout, addrs))
    f.relay_wait_s = 5.0
    fetchers.append(f)
  return relays, fetchers


def _fetch_all(fetchers, have, results):
  def run(j, f):
    try:
      results[j] = f.fetch(have, wait_timeout_s=20)
    except Exception as e:  # noqa: BLE001 -- reported by the assertion
      results[j] = e
  ts = [threading.Thread(target=run, args=(j, f)) for j, f in enumerate(fetchers)]
  for t in ts:
    t.start()
  return ts


def test_source_egress_is_one_model_per_version_and_everyone_is_bit_identical():
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  src = WeightSource(TOKEN)
  enc = wd.DeltaEncoder(full_every=100)
  G = 6
  relays, fetchers = _fleet(c, G, fanout=2)
  rng = np.random.default_rng(0)
  try:
    params = _params(0)
    for v in range(4):
      if v:
        params = _step(params, rng)
      pub = StreamPublisher(c, v, params, chunk_bytes=4096, source=src, wire_dtype="bfloat16",
                            delta=enc)
      before = src.served_bytes
      results = {}
      ts = _fetch_all(fetchers, v - 1, results)
      pub.publish()
      for t in ts:
        t.join(60)
      ref = _ref(params)
      for j in range(G):
        got = results[j]
        assert not isinstance(got, Exception) and got.version == v, (j, got)
        assert all(np.array_equal(a, b) for a, b in zip(_bits(got.params), ref)), (v, j)
      egress = src.served_bytes - before
      one_model = sum(len(m) for m in src.versions[v].chunks if m is not None) if v == 0 else \
          sum(len(m or b"") for m in src.versions[v].delta_chunks for b in [b""])
      assert egress <= 1.2 * one_model, (v, egress, one_model)        # G = 6 generators
    assert sum(f.delta_chunks for f in fetchers) > 0                   # deltas flowed down
    assert all(relays[j].served_chunks > 0 for j in (0, 1, 2))          # the inner nodes relayed
    assert all(relays[j].served_chunks == 0 for j in (3, 4, 5))         # the leaves did not
    assert sum(f.relay_failovers for f in fetchers) == 0
  finally:
    _stop(relays, src, c, srv)


def test_relay_killed_mid_version_does_not_stop_the_others():
  """Generator 1 (parent of 3 and 4 in a binary tree) stops relaying after it received a few
  chunks of the version: its children fail over to the next ancestor and complete it."""
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  src = WeightSource(TOKEN)
  G = 5
  relays, fetchers = _fleet(c, G, fanout=2)
  try:
    params = _params(1)
    pub = StreamPublisher(c, 0, params, chunk_bytes=2048, source=src)
    killed = threading.Event()

    def kill_after(i, f=fetchers[1]):
      if f.received_chunks == 4 and not killed.is_set():
        killed.set()
        relays[1].stop()            # its relay dies mid-version (children's streams break)
    fetchers[1].on_chunk = kill_after
    results = {}
    ts = _fetch_all(fetchers, -1, results)
    pub.publish()
    for t in ts:
      t.join(60)
    assert killed.is_set()
    ref = [np.asarray(leaf).copy() for _, leaf in flatten(params)]
    for j in range(G):
      got = results[j]
      assert not isinstance(got, Exception) and got.version == 0, (j, got)
      assert all(np.array_equal(a, b) for a, (_, b) in zip(ref, flatten(got.params))), j
    assert fetchers[3].relay_failovers + fetchers[4].relay_failovers >= 1
  finally:
    _stop(relays, src, c, srv)


def test_buffer_assigns_the_relay_tree_from_heartbeats():
  clock = [1000.0]
  prompts = [PromptSpec(0, np.array([1, 2], np.int32), "a")]
  st = admission.BufferState(prompts, prompts_per_step=1, group_size=1, max_lag=1,
                             clock=lambda: clock[0], lease_ttl_s=10)
  for j in range(5):
    st.heartbeat(f"gen-{j}@1", version=0, relay_address=f"h{j}:1")
  assert st.relay_parents("gen-0@1", 2) == []
  assert st.relay_parents("gen-4@1", 2) == ["h1:1", "h0:1"]
  clock[0] += 11                                   # gen-1 stops heartbeating: the tree re-forms
  for j in (0, 2, 3, 4):
    st.heartbeat(f"gen-{j}@1", version=0, relay_address=f"h{j}:1")
  assert st.relay_parents("gen-4@1", 2) == ["h2:1", "h0:1"]
