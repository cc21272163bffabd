"""What makes a fetched weight version safe to install, and what a failed one raises.

A generator installs a version only whole: every chunk arrived with its checksum, every tensor has
the name, shape and dtype family of the weights it replaces (`check_like`), and the backend loaded
all of it. Anything else raises `WeightUpdateError` (the version, the tensor and the cause, as one
line) and the generator keeps sampling with the version it holds (generation/worker.py retries with
backoff, `backoff_s`, and exits after `weights.update_retries` failed updates in a row). No JAX.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from scalerl_jax.types import WeightUpdateError


def _named(params, prefix: str = "") -> dict[str, Any]:
  """{"a/b/0/c": leaf} of nested dicts / lists / tuples."""
  if isinstance(params, dict):
    out: dict[str, Any] = {}
    for k, v in params.items():
      out.update(_named(v, f"{prefix}{k}/"))
    return out
  if isinstance(params, (list, tuple)):
    out = {}
    for i, v in enumerate(params):
      out.update(_named(v, f"{prefix}{i}/"))
    return out
  return {prefix.rstrip("/"): params}


def _family(dtype) -> str:
  d = np.dtype(dtype)
  return "float" if d.kind == "f" or d.name == "bfloat16" else d.kind


def check_like(version: int, reference, params) -> None:
  """Raises WeightUpdateError unless `params` has exactly `reference`'s tensor names, shapes and
  dtype families (floats of any width are one family: the wire dtype may differ from the
  reference's). `reference` is the version the generator holds; None skips the check."""
  if reference is None:
    return
  ref, new = _named(reference), _named(params)
  unknown = sorted(set(new) - set(ref))
  if unknown:
    raise WeightUpdateError(version, unknown[0], f"unknown weight name ({len(unknown)} unknown)")
  missing = sorted(set(ref) - set(new))
  if missing:
    raise WeightUpdateError(version, missing[0], f"missing from the update ({len(missing)} missing)")
  for name, a in new.items():
    b = ref[name]
    if tuple(np.shape(a)) != tuple(np.shape(b)):
      raise WeightUpdateError(version, name, f"shape {tuple(np.shape(a))}, the model holds "
                                             f"{tuple(np.shape(b))}")
    if _family(a.dtype) != _family(b.dtype):
      raise WeightUpdateError(version, name, f"dtype {np.dtype(a.dtype).name}, the model holds "
                                             f"{np.dtype(b.dtype).name}")


def backoff_s(failures: int, first_s: float, cap_s: float = 60.0) -> float:
  """Seconds to wait after the `failures`-th failure in a row: first_s, doubling, at most cap_s."""
  return min(cap_s, first_s * 2.0 ** max(0, failures - 1))
