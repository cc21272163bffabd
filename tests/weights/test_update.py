"""A failed weight update never becomes a version (issue 44, point 5): a poisoned version (bad
checksum, wrong shape, unknown name, an engine that fails to load it) leaves the generator on the
version it holds, is counted, retried with backoff, and after `weights.update_retries` failures in
a row stops the generator with one line naming the version, the tensor and the cause; the buffer
counts generators that stay behind."""
import collections
import threading
import types

import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax.buffer import state as admission
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.generation.slots import DecodeStats
from scalerl_jax.generation.worker import Worker
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.types import PromptSpec, WeightUpdateError
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import FetchedWeights, StreamFetcher, StreamPublisher
from scalerl_jax.weights.update import backoff_s, check_like

TOKEN = "update-test-token"


def _params(seed=0, rows=16):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((rows, 8)).astype(np.float32),
          "layers": [{"w": rng.standard_normal((8, 8)).astype(np.float32)} for _ in range(2)]}


class RecordingGen:
  """A generator stand-in: its version, every load, and tokens labelled with the version held."""

  def __init__(self, version=1, fail_loads=0):
    self._v, self.loads, self.fail_loads = version, [], fail_loads

  @property
  def version(self):
    return self._v

  def load_params(self, params, version, model_cfg):
    if self.fail_loads:
      self.fail_loads -= 1
      raise RuntimeError("engine load failed\n(traceback lines)")
    self.loads.append(version)
    self._v = version

  def sample_versions(self, n=4):
    return np.full(n, self._v, np.int32)


def _worker(gen, fetch, params, retries=2):
  """A generator Worker with only what `_watch_weights` uses (no buffer, no engine)."""
  w = Worker.__new__(Worker)
  w.id, w.gen, w._fetch, w.model_cfg, w.fatal = "gen-t", gen, fetch, None, ""
  w._stop, w.decode_stats = threading.Event(), DecodeStats()
  w._held, w._pins, w.hold_n = collections.OrderedDict(), set(), 2
  w._held_lock, w._swap_lock = threading.Lock(), threading.Lock()
  w.config = types.SimpleNamespace(weights=common.Weights(update_retries=retries,
                                                          update_backoff_s=0.0))
  w._remember(gen.version, params)
  return w


def _feeder(*versions):
  """A `_fetch` that returns the given FetchedWeights in turn, then the last one forever."""
  it = iter(versions)
  last = [None]

  def fetch(have, wait_timeout_s):
    last[0] = next(it, last[0])
    return last[0]
  return fetch


@pytest.mark.parametrize("poison,name,cause", [
    ("shape", "layers/1/w", r"shape \(8, 9\), the model holds \(8, 8\)"),
    ("name", "layers/0/extra", "unknown weight name"),
    ("missing", "layers/1/w", "missing from the update"),
    ("dtype", "embed", "dtype int32, the model holds float32"),
])
def test_poisoned_version_keeps_old_version_then_stops_with_one_line(poison, name, cause):
  p1 = _params(1)
  bad = _params(2)
  if poison == "shape":
    bad["layers"][1]["w"] = np.zeros((8, 9), np.float32)
  elif poison == "name":
    bad["layers"][0]["extra"] = np.zeros((2,), np.float32)
  elif poison == "missing":
    del bad["layers"][1]["w"]
  else:
    bad["embed"] = bad["embed"].astype(np.int32)
  gen = RecordingGen(1)
  w = _worker(gen, _feeder(FetchedWeights(2, bad)), p1, retries=2)
  w._watch_weights()                       # returns once it gave up
  assert gen.version == 1 and gen.loads == [] and w.held_versions() == [1]
  assert (gen.sample_versions() == 1).all()          # nothing sampled carries version 2
  assert w.decode_stats.weight_failures == 3 and w._stop.is_set()
  assert "\n" not in w.fatal and "version 2" in w.fatal and name in w.fatal, w.fatal
  assert __import__("re").search(cause, w.fatal), w.fatal
  assert "3 failures in a row" in w.fatal


def test_failed_engine_load_is_retried_and_a_good_version_resets_the_count():
  """The engine's own load error (first two tries) is counted and backed off; the third try
  installs the version and only then is it held."""
  p1, p2 = _params(1), _params(2)
  gen = RecordingGen(1, fail_loads=2)
  seen = []
  w = _worker(gen, None, p1, retries=3)

  def fetch(have, wait_timeout_s):
    seen.append(have)
    if gen.version == 2:
      w.stop()
      return None
    return FetchedWeights(2, p2)
  w._fetch = fetch
  w._watch_weights()
  assert gen.loads == [2] and gen.version == 2 and w.held_versions() == [1, 2]
  assert w.decode_stats.weight_failures == 2 and w.fatal == ""
  assert seen[:3] == [1, 1, 1]            # retried from the version held


def test_bad_checksum_through_a_learner_source_is_refused_by_name():
  """A chunk corrupted after its CRC was computed (served by a learner WeightSource, which
  does not re-check): the fetcher raises WeightUpdateError naming the tensor; the watcher keeps
  the old version, retries (the resumed fetch gets the same bad chunk) and gives up."""
  srv = BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN,
                     prompts_per_step=1, group_size=1, max_lag=1).start()
  c = BufferClient(srv.address, TOKEN)
  src = WeightSource(TOKEN)
  try:
    p1, p2 = _params(1), _params(2)
    StreamPublisher(c, 1, p1, chunk_bytes=256, source=src).publish()
    f = StreamFetcher(c)
    got = f.fetch(-1, wait_timeout_s=10)
    assert got.version == 1
    pub = StreamPublisher(c, 2, p2, chunk_bytes=256, source=src)
    target = next(i for i, p in enumerate(pub.plan) if p[0] == 1)   # a chunk of layers/0/w
    enc = pub.encode

    def poisoned(i, host=None):
      msg = enc(i, host)
      if i != target:
        return msg
      m = ws.parse_weight_message(msg)
      data = bytearray(m.data)
      data[3] ^= 0x40
      return ws.encode_chunk(2, i, bytes(data), m.head.crc32)    # the old CRC, new bytes
    pub.encode = poisoned
    pub.publish()
    gen = RecordingGen(1)
    w = _worker(gen, lambda have, wait_timeout_s: f.fetch(have, wait_timeout_s=5), got.params,
                retries=1)
    w._watch_weights()
    assert gen.version == 1 and gen.loads == [] and w.decode_stats.weight_failures == 2
    assert "version 2" in w.fatal and "layers/0/w" in w.fatal and "checksum mismatch" in w.fatal
  finally:
    src.stop()
    c.close()
    srv.stop()


def test_check_like_and_backoff_numbers():
  p = _params(1)
  check_like(3, p, _params(2))                                   # same layout: passes
  check_like(3, p, {"embed": p["embed"].astype(np.float16), "layers": p["layers"]})  # wire dtype
  check_like(3, None, {"anything": np.zeros(1)})                 # nothing held yet: no reference
  with pytest.raises(WeightUpdateError, match="version 3 failed at embed: shape"):
    check_like(3, p, {"embed": np.zeros((4, 8), np.float32), "layers": p["layers"]})
  assert [backoff_s(k, 1.0) for k in (1, 2, 3, 8)] == [1.0, 2.0, 4.0, 60.0]
  assert backoff_s(3, 0.5, cap_s=1.5) == 1.5


def test_buffer_counts_generators_behind_as_a_gauge():
  """Generators report their version in heartbeats; the summary counts the live ones more than
  max(1, max_lag) versions behind (a silent one ages out after the lease TTL)."""
  clock = types.SimpleNamespace(t=1000.0)
  prompts = [PromptSpec(i, np.array([i, i + 1], np.int32), "a") for i in range(4)]
  st = admission.BufferState(prompts, prompts_per_step=1, group_size=1, max_lag=2,
                             clock=lambda: clock.t, lease_ttl_s=10)
  assert "generators_behind" not in st.generator_stats()    # no versions reported yet
  st.set_version(5)
  st.heartbeat("a", version=5)
  st.heartbeat("b", version=3)       # 2 behind: within max_lag
  st.heartbeat("c", version=2)       # 3 behind: counted
  st.heartbeat("d", version=0)
  assert st.generator_stats()["generators_behind"] == 2.0
  clock.t += 11                      # c and d silent past the TTL; a and b report again
  st.heartbeat("a", version=5)
  st.heartbeat("b", version=3)
  assert st.generator_stats()["generators_behind"] == 0.0
