"""The fetcher's array pool (weights/pool.py): versions are read into the arrays of a version that
nothing holds any more; a set somebody references (the array, a view of it) or pins is never
written; what the fetcher returns stays bit-exact after its arrays were reused."""
import gc

import ml_dtypes
import numpy as np
import pytest

from helpers import weight_serving
from scalerl_jax.weights.pool import ArrayPool
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher, flatten

TOKEN = "pool-test-token"
SPECS = [((64, 48), np.float32), ((7,), ml_dtypes.bfloat16)]


def _ptrs(arrays) -> list[int]:
  return [a.ctypes.data for a in arrays]


def test_a_free_set_is_reused_a_held_or_pinned_one_never():
  pool = ArrayPool()
  a = pool.take(SPECS)
  first = _ptrs(a)
  assert [(x.shape, x.dtype) for x in a] == [((64, 48), np.float32), ((7,), np.dtype(SPECS[1][1]))]
  assert all(p % 64 == 0 for p in first)                      # aligned: XLA:CPU adopts them
  del a
  b = pool.take(SPECS)                                        # nobody holds the first set
  assert _ptrs(b) == first and (pool.reused, pool.allocated) == (1, 1)
  # Held: the set itself, one array of it, or only a view of one array: never handed out again.
  for hold in (lambda s: s, lambda s: s[1], lambda s: s[0][3:5, ::2]):
    kept = hold(b)
    del b
    c = pool.take(SPECS)
    assert set(_ptrs(c)).isdisjoint(first), "a set that is still referenced was reused"
    del c, kept
    b = pool.take(SPECS)                                      # free again: the same set
    assert _ptrs(b) == first
  # Pinned (the evaluation lane's older version): not reused while pinned, even unreferenced.
  pool.pin(b)
  pool.pin(b)                                                 # pins nest
  del b
  for _ in range(2):
    d = pool.take(SPECS)
    assert set(_ptrs(d)).isdisjoint(first)
    held = d
    del d
    e = [x for x in pool._sets if _ptrs(x.arrays) == first][0].arrays
    pool.unpin(e)
    del e, held
  f = pool.take(SPECS)                                        # both pins gone: reused again
  assert _ptrs(f) == first
  with pytest.raises(ValueError, match="not pinned"):
    pool.unpin(f)
  with pytest.raises(KeyError):
    pool.pin([np.zeros(3)])


def test_arrays_jax_adopted_without_a_copy_are_not_reused_while_the_jax_array_lives():
  """On CPU `jax.device_put` aliases the aligned arrays (the sampler's params are the fetched
  memory) and references their owning buffer, not the array object: the pool must see that."""
  import jax   # local: only this test needs JAX's CPU client
  pool = ArrayPool()
  a = pool.take(SPECS[:1])
  a[0][...] = 1.5
  x = jax.device_put(a[0], jax.devices("cpu")[0])
  assert x.unsafe_buffer_pointer() == a[0].ctypes.data         # adopted, not copied
  first = _ptrs(a)
  del a
  b = pool.take(SPECS[:1])
  assert set(_ptrs(b)).isdisjoint(first) and pool.reused == 0   # the jax array still reads it
  b[0][...] = -2.0
  assert float(x[0, 0]) == 1.5
  del b, x
  pool.take(SPECS[:1])                                          # now free: reused
  assert pool.reused == 1


def test_spare_sets_are_bounded_and_layouts_do_not_mix():
  pool = ArrayPool(spare=1)
  sets = [pool.take(SPECS) for _ in range(3)]                 # 3 held at once: 3 allocated
  assert pool.allocated == 3 and pool.tracked() == 3
  del sets
  again = pool.take(SPECS)                                    # one reused, the 2 other free dropped
  assert pool.reused == 1 and pool.tracked() == 1
  other = pool.take([((5, 5), np.float32)])                   # another layout: fresh arrays
  assert pool.allocated == 4 and other[0].shape == (5, 5) and pool.tracked() == 2
  del again
  third = pool.take([((5, 5), np.float32)])                   # `other` held: fresh; the free set
  assert pool.allocated == 5 and pool.tracked() == 2          # of the old layout is dropped
  assert third[0].ctypes.data != other[0].ctypes.data


@pytest.fixture
def serving():
  with weight_serving(TOKEN, keep=2) as cs:
    yield cs


def _params(seed):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((96, 64)).astype(np.float32),
          "layers": [{"w": rng.standard_normal((64, 48)).astype(np.float32)} for _ in range(2)]}


def _same(got, params) -> bool:
  return all(np.array_equal(np.asarray(a), np.asarray(b))
             for (_, a), (_, b) in zip(flatten(got), flatten(params)))


def test_fetched_versions_stay_exact_while_held_and_after_reuse(serving):
  """The generator holds its current version while the next arrives and an evaluation holds an
  older one: neither is overwritten; a version nobody holds lends its arrays to the next one,
  which arrives bit-exact (over the bulk channel, read in place)."""
  c, src = serving
  f = StreamFetcher(c, delta=False)
  gc.disable()                  # reuse must not wait for a garbage-collector pass
  try:
    got = {}
    for v in range(5):
      StreamPublisher(c, v, _params(v), chunk_bytes=4096, source=src).publish()
      got[v] = f.fetch(v - 1, wait_timeout_s=10)
      assert got[v].version == v and _same(got[v].params, _params(v)), v
      for u, w in got.items():                                # every held version is intact
        assert _same(w.params, _params(u)), (v, u)
      if v == 1:
        evaluation = got.pop(0)                               # pinned by an evaluation (held)
      elif v >= 2:
        got.pop(v - 1)                                        # the generator moved on
    assert _same(evaluation.params, _params(0))
    # v0 held throughout, v1..v3 each dropped after the next arrived: v3 and v4 reused them.
    assert f.pool.reused == 2 and f.pool.allocated == 3, (f.pool.reused, f.pool.allocated)
    assert f.bulk_streams == 5 and f.digests_checked == 5
  finally:
    gc.enable()
