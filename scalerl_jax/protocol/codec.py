"""Array <-> `Tensor` codec and `Completion` <-> `Rollout` conversion (no copies where avoidable).

Arrays travel as raw little-endian bytes plus a declared dtype; decoding is `np.frombuffer` (zero-copy,
read-only views). The policy mask is bit-packed (`np.packbits(bitorder="little")`).
"""
from __future__ import annotations

import time
import uuid

import numpy as np

from scalerl_jax.types import FINISH_INTERRUPTED, FINISH_LENGTH, FINISH_STOP, Completion
from scalerl_jax.protocol import rollout_pb2 as pb
_NP_DTYPES: dict[int, np.dtype] = {pb.INT32: np.dtype("<i4"), pb.FLOAT32: np.dtype("<f4")}

FINISH_TO_PB = {FINISH_STOP: pb.FINISH_STOP, FINISH_LENGTH: pb.FINISH_LENGTH,
                FINISH_INTERRUPTED: pb.FINISH_INTERRUPTED}
FINISH_FROM_PB = {v: k for k, v in FINISH_TO_PB.items()}


class CodecError(ValueError):
  """A tensor whose dtype/length/bytes disagree."""


def encode(array: np.ndarray, dtype: pb.DType) -> pb.Tensor:
  """Encodes a 1-D array as a `Tensor` of the given `pb.DType`."""
  a = np.asarray(array).reshape(-1)
  if dtype == pb.BITS:
    data = np.packbits(a.astype(bool, copy=False), bitorder="little").tobytes()
  else:
    data = np.ascontiguousarray(a, dtype=_NP_DTYPES[dtype]).tobytes()
  return pb.Tensor(dtype=dtype, length=a.size, data=data)


def nbytes_for(dtype: int, length: int) -> int:
  """Exact byte size of `length` elements of `dtype`."""
  if dtype == pb.BITS:
    return (length + 7) // 8
  return _NP_DTYPES[dtype].itemsize * length


def decode(t: pb.Tensor, dtype: int, name: str, max_len: int, unpack_bits: bool = True
           ) -> np.ndarray:
  """Decodes and checks a `Tensor` (dtype, length bound, exact byte size). Raises CodecError.

  With unpack_bits=False a BITS tensor is only checked and returned as its packed uint8 bytes."""
  if t.dtype != dtype:
    raise CodecError(f"{name}: dtype {pb.DType.Name(t.dtype) if t.dtype in pb.DType.values() else t.dtype}"
                     f" != expected {pb.DType.Name(dtype)}")
  if t.length > max_len:
    raise CodecError(f"{name}: length {t.length} exceeds limit {max_len}")
  want = nbytes_for(dtype, t.length)
  data = t.data                      # one access: each access of a bytes field makes a new object
  if len(data) != want:
    raise CodecError(f"{name}: {len(data)} bytes but length {t.length} of "
                     f"{pb.DType.Name(dtype)} needs {want}")
  if dtype == pb.BITS:
    if not unpack_bits:
      return np.frombuffer(data, np.uint8)
    return np.unpackbits(np.frombuffer(data, np.uint8), count=t.length,
                         bitorder="little").astype(bool)
  return np.frombuffer(data, _NP_DTYPES[dtype])


def completion_to_rollout(c: Completion, *, group_id: int, sample_index: int,
                          prompt_tokens: np.ndarray, generator_id: str,
                          rewards: tuple[float, ...] | None = None, rollout_id: str | None = None,
                          start_unix_s: float = 0.0, end_unix_s: float | None = None) -> pb.Rollout:
  """Builds the wire message for one completion of a leased group."""
  return pb.Rollout(
      rollout_id=rollout_id or f"{generator_id}-{group_id}-{sample_index}-{uuid.uuid4().hex[:12]}",
      prompt_id=int(c.prompt_id), group_id=int(group_id), sample_index=int(sample_index),
      prompt_tokens=encode(prompt_tokens, pb.INT32),
      completion_tokens=encode(c.tokens, pb.INT32), logprobs=encode(c.logprobs, pb.FLOAT32),
      versions=encode(c.versions, pb.INT32), policy_mask=encode(c.policy_mask, pb.BITS),
      rewards=list(rewards if rewards is not None else (c.reward,)),
      finish_reason=FINISH_TO_PB[c.finish_reason], generator_id=generator_id,
      timing=pb.Timing(start_unix_s=start_unix_s,
                       end_unix_s=time.time() if end_unix_s is None else end_unix_s),
      routes=None if c.routes is None else encode_routes(c.routes))


def encode_routes(routes: np.ndarray) -> pb.Routes:
  """int [N,R,K] expert choices (N = prompt + completion tokens) -> the wire `Routes`."""
  routes = np.asarray(routes)
  if routes.ndim != 3:
    raise ValueError(f"routes must be [tokens, layers, k]; got shape {routes.shape}")
  return pb.Routes(experts=encode(routes.reshape(-1), pb.INT32), layers=routes.shape[1],
                   k=routes.shape[2])


def decode_routes(r: pb.Rollout) -> np.ndarray | None:
  """The (validated) rollout's routes as int32 [N,R,K], or None when it has none."""
  if not r.HasField("routes"):
    return None
  t = r.routes
  flat = decode(t.experts, pb.INT32, "routes.experts", 1 << 31)
  return flat.reshape(-1, int(t.layers), int(t.k))


def rollout_to_completion(r: pb.Rollout) -> Completion:
  """Decodes a (validated) wire rollout back into a `Completion` (arrays are read-only views)."""
  big = 1 << 31
  return Completion(
      prompt_id=int(r.prompt_id),
      tokens=decode(r.completion_tokens, pb.INT32, "completion_tokens", big),
      logprobs=decode(r.logprobs, pb.FLOAT32, "logprobs", big),
      versions=decode(r.versions, pb.INT32, "versions", big),
      policy_mask=decode(r.policy_mask, pb.BITS, "policy_mask", big),
      finish_reason=FINISH_FROM_PB.get(r.finish_reason, FINISH_STOP),
      reward=float(r.rewards[0]) if r.rewards else 0.0, routes=decode_routes(r))
