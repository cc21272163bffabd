"""Reused host arrays for fetched weight versions (issue 44, "at the limit of the machine").

A fetcher that writes every version into freshly allocated arrays pays a page fault per 4 KiB of
the model on every version: on a 2-core AMD EPYC, memcpy into fresh memory ran at 0.15-0.4 of
memcpy into memory written before (docs/SCALE.md), and the receive path sits behind it. The pool
hands out the arrays of a version nobody holds any more, so the next version is read into memory
that is already mapped.

Who holds a version: the generator (its current params, `Worker._held`, the engine's params; on
CPU `jax.device_put` adopts the arrays without a copy and keeps a reference to them), the
evaluation lane (versions pinned by open evaluations stay in `_held`), the fetcher itself (a
partial version it will resume, the base of the next delta). Each of those holds a Python
reference to the arrays (or to a view of them, which references the same owning buffer). The pool
counts them: a set of arrays is reused only when the pool's own references are the only ones left
(CPython reference counts of each array and of its owning buffer, calibrated once against the same
code path) and no explicit `pin` holds it. A set anybody still references is never written; a
caller that never releases anything only costs fresh arrays, as before.

Memory: the pool keeps at most `spare` unreferenced sets of the layout being fetched (the one the
next version is read into; free sets of another layout are dropped); every other set it tracks is
alive only because somebody else holds it. No JAX.
"""
from __future__ import annotations

import math
import sys
import threading
from typing import Sequence

import numpy as np


def aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """np.empty with a 64-byte aligned data pointer (XLA:CPU then aliases it instead of copying)."""
  dtype = np.dtype(dtype)
  n = int(math.prod(shape)) * dtype.itemsize
  raw = np.empty(n + align, np.uint8)
  off = (-raw.ctypes.data) % align
  return raw[off:off + n].view(dtype).reshape(shape)


class _Set:
  """One version's arrays and their owning buffers, with explicit pins."""
  __slots__ = ("key", "arrays", "owners", "pins")

  def __init__(self, key, arrays: list):
    self.key, self.arrays, self.pins = key, arrays, 0
    self.owners = [a.base for a in arrays]     # aligned_empty's arrays are views of their buffer


def _extra_refs(s: _Set, base_array: int, base_owner: int) -> bool:
  """True when anything but the pool references one of s's arrays or owning buffers."""
  for a, o in zip(s.arrays, s.owners):
    if sys.getrefcount(a) > base_array or sys.getrefcount(o) > base_owner:
      return True
  return False


def _calibrate() -> tuple[int, int]:
  """The reference counts `_extra_refs` sees for a set only the pool holds (measured on the same
  code path, so interpreter versions that count borrowed references differently agree)."""
  s = _Set(None, [aligned_empty((2,), np.uint8)])
  for a, o in zip(s.arrays, s.owners):
    return sys.getrefcount(a), sys.getrefcount(o)
  raise AssertionError("unreachable")


_BASE = _calibrate()


class ArrayPool:
  """Host arrays for fetched versions, reused once nothing holds them (see module docstring)."""

  def __init__(self, spare: int = 1):
    """`spare`: unreferenced sets kept for reuse (memory: one model each)."""
    self.spare = max(0, int(spare))
    self._sets: list[_Set] = []
    self._lock = threading.Lock()
    self.reused = 0              # sets handed out again
    self.allocated = 0           # sets allocated fresh

  def take(self, specs: Sequence[tuple[tuple[int, ...], np.dtype]]) -> list[np.ndarray]:
    """Arrays of the given (shape, dtype)s: a free set of that layout (its contents are the old
    version's bits: the caller overwrites all of them), else fresh 64-byte aligned arrays."""
    key = tuple((tuple(int(d) for d in shape), np.dtype(dt).str) for shape, dt in specs)
    with self._lock:
      free = [s for s in self._sets if not s.pins and not _extra_refs(s, *_BASE)]
      same = [s for s in free if s.key == key]
      hit = same[0] if same else None
      # Kept unreferenced: at most `spare` sets of this layout, the one handed out included; free
      # sets of another layout (a resharded model) are dropped.
      drop = [s for s in free if s.key != key] + same[max(1, self.spare):]
      self._sets = [s for s in self._sets if all(s is not d for d in drop)]
      if hit is not None:
        self.reused += 1
        self._sets.remove(hit)
        self._sets.append(hit)   # newest last
        return list(hit.arrays)
      arrays = [aligned_empty(shape, dt) for shape, dt in specs]
      self._sets.append(_Set(key, arrays))
      self.allocated += 1
      return list(arrays)

  def _find(self, arrays: Sequence[np.ndarray]) -> _Set:
    for s in self._sets:
      if len(s.arrays) == len(arrays) and all(a is b for a, b in zip(s.arrays, arrays)):
        return s
    raise KeyError("these arrays are not a set of this pool")

  def pin(self, arrays: Sequence[np.ndarray]) -> None:
    """Never reuse this set until `unpin` (counted: pins nest)."""
    with self._lock:
      self._find(arrays).pins += 1

  def unpin(self, arrays: Sequence[np.ndarray]) -> None:
    """Ends one `pin` of this set."""
    with self._lock:
      s = self._find(arrays)
      if s.pins <= 0:
        raise ValueError("unpin of a set that is not pinned")
      s.pins -= 1

  def tracked(self) -> int:
    """Sets the pool tracks (held by somebody, pinned, or spare)."""
    with self._lock:
      return len(self._sets)
