"""Field-by-field validation of incoming rollouts (pure: numpy + protobuf, no server state).

Every failure raises `RejectError(code, message)` naming the field and what was wrong; the server turns
it into the gRPC status (INVALID_ARGUMENT for malformed fields, FAILED_PRECONDITION for rollouts whose
lease is gone). Re-verification of the reward is pluggable: pass `verifier(prompt_id, answer, tokens)`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import grpc
import numpy as np

from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
# verifier(prompt_id, answer, completion_tokens) -> reward; None disables re-verification.
Verifier = Callable[[int, str, np.ndarray], float]


class RejectError(Exception):
  """A request the buffer refuses; `code` is the gRPC status to answer with."""

  def __init__(self, code: grpc.StatusCode, message: str):
    super().__init__(message)
    self.code = code
    self.message = message


def invalid(message: str) -> RejectError:
  return RejectError(grpc.StatusCode.INVALID_ARGUMENT, message)


# The buffer's refusals by what went wrong; the status each answers with is decided here, so the
# buffer's state machine (buffer/state.py) names no gRPC type.
def precondition(message: str) -> RejectError:
  """The request is well formed but the state does not allow it (wrong step, stale version)."""
  return RejectError(grpc.StatusCode.FAILED_PRECONDITION, message)


def cancelled(message: str) -> RejectError:
  """The caller went away (a dead learner's pull)."""
  return RejectError(grpc.StatusCode.CANCELLED, message)


def timed_out(message: str) -> RejectError:
  """Nothing arrived within the request's own timeout."""
  return RejectError(grpc.StatusCode.DEADLINE_EXCEEDED, message)


def exhausted(message: str) -> RejectError:
  """A bound is full (open evaluations, pending work)."""
  return RejectError(grpc.StatusCode.RESOURCE_EXHAUSTED, message)


def not_found(message: str) -> RejectError:
  """An id the buffer does not hold."""
  return RejectError(grpc.StatusCode.NOT_FOUND, message)


def unavailable(message: str) -> RejectError:
  """The buffer cannot serve right now (its write-ahead log failed): retry elsewhere / later."""
  return RejectError(grpc.StatusCode.UNAVAILABLE, message)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-field limits (the whole message is bounded separately by grpc max_receive_message_length)."""
  max_id_chars: int = 256
  max_prompt_tokens: int = 8192
  max_completion_tokens: int = 32768
  max_rewards: int = 8
  vocab_size: int = 1 << 24          # token ids must lie in [0, vocab_size)
  reward_min: float = -1.0           # the verifier's range for rewards[0]
  reward_max: float = 1.0
  reward_atol: float = 1e-4          # re-verification tolerance
  max_lease_groups: int = 4096
  max_timeout_s: float = 3600.0
  max_eval_prompts: int = 1 << 20    # prompts of one evaluation request
  max_eval_samples: int = 4096       # samples per prompt of an evaluation
  max_open_evals: int = 64           # evaluations open at once
  max_held_versions: int = 64        # LeaseRequest.held_versions entries
  # MoE routing replay: the model's MoE layers R, experts per token K and expert count E. With
  # route_layers == 0 a rollout carrying `routes` is refused (the buffer was not told the shape).
  route_layers: int = 0
  route_k: int = 0
  num_experts: int = 0


@dataclasses.dataclass(frozen=True)
class LeaseView:
  """The immutable facts of a leased group that a rollout is checked against."""
  group_id: int
  prompt_id: int
  prompt_tokens: np.ndarray
  answer: str
  group_size: int
  min_version: int
  max_version: int                   # -1: unbounded (up to the current published version)


@dataclasses.dataclass
class Checked:
  """What validation learned about a rollout (kept by the buffer for lag accounting)."""
  num_tokens: int
  min_version: int
  version_counts: np.ndarray         # bincount(versions - min_version)
  reward: float = 0.0                # rewards[0] (validated), for No-Positive-Resampling


def check_id(value: str, field: str, limits: Limits) -> None:
  if not value:
    raise invalid(f"{field} is required (empty)")
  if len(value) > limits.max_id_chars:
    raise invalid(f"{field} has {len(value)} chars, limit {limits.max_id_chars}")
  if not value.isprintable():
    raise invalid(f"{field} contains non-printable characters")


MAX_STAT_KEYS = 16


def check_generator_stats(stats) -> dict[str, float]:
  """A heartbeat's generator counters (HeartbeatRequest.stats): at most 16 printable keys of <= 64
  chars, each value finite and in [0, 1e15] (cumulative counts and seconds)."""
  if len(stats) > MAX_STAT_KEYS:
    raise invalid(f"heartbeat stats has {len(stats)} keys, limit {MAX_STAT_KEYS}")
  out = {}
  for k, v in stats.items():
    if not k or len(k) > 64 or not k.isprintable():
      raise invalid(f"heartbeat stats key {k[:64]!r}: 1-64 printable chars")
    v = float(v)
    if not math.isfinite(v) or not 0 <= v <= 1e15:
      raise invalid(f"heartbeat stats {k}={v!r} must be finite and in [0, 1e15]")
    out[str(k)] = v
  return out


def check_timeout(value: float, field: str, limits: Limits) -> float:
  if not math.isfinite(value) or value < 0 or value > limits.max_timeout_s:
    raise invalid(f"{field}={value!r} must be finite and in [0, {limits.max_timeout_s}]")
  return value


_U32 = np.dtype("<u4")
_FINISH = (pb.FINISH_STOP, pb.FINISH_LENGTH, pb.FINISH_INTERRUPTED)


def _decode(t: pb.Tensor, dtype: int, name: str, max_len: int) -> np.ndarray:
  try:
    return codec.decode(t, dtype, name, max_len, unpack_bits=False)
  except codec.CodecError as e:
    raise invalid(str(e)) from None


def check_routes(routes: pb.Routes, num_tokens: int, limits: Limits) -> None:
  """`routes` must be [num_tokens, R, K] with R, K the model's and every expert in [0, E)."""
  if limits.route_layers <= 0:
    raise invalid("routes given but this buffer does not accept them (no MoE route shape "
                  "configured: Limits.route_layers / route_k / num_experts)")
  if (routes.layers, routes.k) != (limits.route_layers, limits.route_k):
    raise invalid(f"routes have {routes.layers} layers x k={routes.k}; the model has "
                  f"{limits.route_layers} MoE layers x k={limits.route_k}")
  want = num_tokens * limits.route_layers * limits.route_k
  if routes.experts.length != want:
    raise invalid(f"routes.experts has length {routes.experts.length}; expected (prompt + "
                  f"completion tokens) {num_tokens} x {limits.route_layers} x {limits.route_k} "
                  f"= {want}")
  experts = _decode(routes.experts, pb.INT32, "routes.experts", want)
  if want and int(experts.view(_U32).max()) >= limits.num_experts:   # negatives wrap
    raise invalid(f"routes.experts must be in [0, {limits.num_experts}); got "
                  f"[{int(experts.min())}, {int(experts.max())}]")


def validate_rollout(r: pb.Rollout, lease: LeaseView, current_version: int, limits: Limits,
                     verifier: Optional[Verifier] = None, id_checked: bool = False) -> Checked:
  """Checks every field of `r` against its lease and the published version; raises RejectError.

  Tensors are checked as zero-copy `np.frombuffer` views with one reduction per bound (token ids as
  one unsigned max, log-probs min+max, versions min+max). `id_checked`: rollout_id was checked."""
  if not id_checked:
    check_id(r.rollout_id, "rollout_id", limits)
  check_id(r.generator_id, "generator_id", limits)
  if r.prompt_id != lease.prompt_id:
    raise invalid(f"prompt_id {r.prompt_id} != {lease.prompt_id} leased for group {lease.group_id}")
  if r.sample_index >= lease.group_size:
    raise invalid(f"sample_index {r.sample_index} out of range for group size {lease.group_size}")
  if r.finish_reason not in _FINISH:
    raise invalid(f"finish_reason {r.finish_reason} is not one of STOP, LENGTH, INTERRUPTED")

  prompt = _decode(r.prompt_tokens, pb.INT32, "prompt_tokens", limits.max_prompt_tokens)
  want = np.asarray(lease.prompt_tokens, "<i4")    # no copy: leases hold int32 already
  if prompt.shape != want.shape or prompt.tobytes() != want.tobytes():
    raise invalid(f"prompt_tokens differ from the tokens of prompt {lease.prompt_id}")

  max_c = limits.max_completion_tokens
  ct, lt, vt, mt = r.completion_tokens, r.logprobs, r.versions, r.policy_mask
  tokens = _decode(ct, pb.INT32, "completion_tokens", max_c)
  n = tokens.size
  if n == 0:
    raise invalid("completion_tokens is empty")
  for name, t in (("logprobs", lt), ("versions", vt), ("policy_mask", mt)):
    if t.length != n:
      raise invalid(f"{name} has length {t.length} but completion_tokens has {n}")
  logprobs = _decode(lt, pb.FLOAT32, "logprobs", max_c)
  versions = _decode(vt, pb.INT32, "versions", max_c)
  _decode(mt, pb.BITS, "policy_mask", max_c)

  if int(tokens.view(_U32).max()) >= min(limits.vocab_size, 1 << 31):   # negatives wrap >= 2**31
    raise invalid(f"completion token ids must be in [0, {limits.vocab_size}); got "
                  f"[{int(tokens.min())}, {int(tokens.max())}]")
  lmin, lmax = float(logprobs.min()), float(logprobs.max())   # NaN propagates through min/max
  if not (math.isfinite(lmin) and math.isfinite(lmax)):
    raise invalid(f"logprobs has {int((~np.isfinite(logprobs)).sum())} non-finite values")
  if lmax > 0.0:
    raise invalid(f"logprobs must be <= 0; max is {lmax}")
  vmin, vmax = int(versions.min()), int(versions.max())
  if vmax > current_version:
    raise invalid(f"token version {vmax} is from the future (published version is {current_version})")
  if vmin < lease.min_version:
    raise invalid(f"token version {vmin} < lease min_version {lease.min_version} of group "
                  f"{lease.group_id} (fetch newer weights before generating)")
  if lease.max_version >= 0 and vmax > lease.max_version:
    raise invalid(f"token version {vmax} > lease max_version {lease.max_version} "
                  f"(ppo_off_policy: the whole round uses one version)")

  if not 1 <= len(r.rewards) <= limits.max_rewards:    # before copying a possibly huge list
    raise invalid(f"rewards must have 1..{limits.max_rewards} values; got {len(r.rewards)}")
  rewards = list(r.rewards)
  if not all(map(math.isfinite, rewards)):
    raise invalid("rewards contain a non-finite value")
  if not limits.reward_min <= rewards[0] <= limits.reward_max:
    raise invalid(f"rewards[0]={rewards[0]} outside verifier range "
                  f"[{limits.reward_min}, {limits.reward_max}]")
  if r.HasField("timing"):
    ts = (r.timing.start_unix_s, r.timing.end_unix_s)
    if not all(math.isfinite(x) and x >= 0 for x in ts):
      raise invalid(f"timing must be finite and >= 0; got {ts}")
  if r.HasField("routes"):
    check_routes(r.routes, prompt.size + n, limits)
  if verifier is not None:
    expect = float(verifier(lease.prompt_id, lease.answer, tokens))
    if abs(expect - float(rewards[0])) > limits.reward_atol:
      raise invalid(f"rewards[0]={rewards[0]} but the verifier gives {expect}")
  counts = np.array([n]) if vmin == vmax else np.bincount(versions - vmin)
  return Checked(num_tokens=n, min_version=vmin, version_counts=counts,
                 reward=float(rewards[0]))


# ---- evaluation lane ------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class EvalPromptView:
  """One checked prompt of an evaluation request (group i of the evaluation)."""
  prompt_id: int
  tokens: np.ndarray                 # int32, a zero-copy view of the request bytes
  answer: str
  task: str


def validate_eval_request(req: pb.EvalRequest, current_version: int, limits: Limits
                          ) -> list[EvalPromptView]:
  """Checks an `EvalRequest` (ids, version, sampling settings, every prompt); raises RejectError.
  The version must be published already (`current_version`): weights generators can fetch."""
  if req.eval_id <= 0:
    raise invalid(f"eval_id must be > 0; got {req.eval_id}")
  if not 0 <= req.version <= current_version:
    raise RejectError(grpc.StatusCode.FAILED_PRECONDITION,
                      f"eval {req.eval_id}: version {req.version} is not published (newest is "
                      f"{current_version})")
  if not 1 <= req.samples_per_prompt <= limits.max_eval_samples:
    raise invalid(f"samples_per_prompt={req.samples_per_prompt} must be in "
                  f"[1, {limits.max_eval_samples}]")
  if not (math.isfinite(req.temperature) and req.temperature > 0):
    raise invalid(f"temperature={req.temperature} must be finite and > 0")
  if not (math.isfinite(req.top_p) and 0 < req.top_p <= 1):
    raise invalid(f"top_p={req.top_p} must be in (0, 1]")
  n = len(req.prompts)
  if not 1 <= n <= limits.max_eval_prompts:
    raise invalid(f"an evaluation needs 1..{limits.max_eval_prompts} prompts; got {n}")
  out = []
  for i, p in enumerate(req.prompts):
    tokens = _decode(p.prompt_tokens, pb.INT32, f"prompts[{i}].prompt_tokens",
                     limits.max_prompt_tokens)
    if tokens.size == 0:
      raise invalid(f"prompts[{i}].prompt_tokens is empty")
    if int(tokens.view(_U32).max()) >= min(limits.vocab_size, 1 << 31):
      raise invalid(f"prompts[{i}]: token ids must be in [0, {limits.vocab_size})")
    for name, text in (("answer", p.answer), ("task", p.task)):
      if len(text) > 1 << 16:
        raise invalid(f"prompts[{i}].{name} has {len(text)} chars, limit {1 << 16}")
    out.append(EvalPromptView(int(p.prompt_id), tokens, p.answer, p.task))
  return out


def validate_eval_result(r: pb.EvalGroupResult, *, version: int, samples: int, prompt_id: int,
                         limits: Limits) -> None:
  """Checks one group's evaluation result against its evaluation; raises RejectError."""
  check_id(r.generator_id, "generator_id", limits)
  if r.version != version:
    raise invalid(f"eval {r.eval_id} group {r.group_id}: generated with version {r.version}, "
                  f"but the evaluation is pinned to version {version}")
  if r.prompt_id != prompt_id:
    raise invalid(f"eval {r.eval_id} group {r.group_id}: prompt_id {r.prompt_id} != {prompt_id}")
  for name, field in (("rewards", r.rewards), ("lengths", r.lengths),
                      ("finish_reasons", r.finish_reasons)):
    if len(field) != samples:
      raise invalid(f"eval {r.eval_id} group {r.group_id}: {len(field)} {name}, expected "
                    f"{samples} (samples_per_prompt)")
  rewards = list(r.rewards)
  if not all(map(math.isfinite, rewards)):
    raise invalid(f"eval {r.eval_id} group {r.group_id}: a reward is not finite")
  if rewards and not (limits.reward_min <= min(rewards) and max(rewards) <= limits.reward_max):
    raise invalid(f"eval {r.eval_id} group {r.group_id}: rewards outside the verifier range "
                  f"[{limits.reward_min}, {limits.reward_max}]")
  if any(n > limits.max_completion_tokens for n in r.lengths):
    raise invalid(f"eval {r.eval_id} group {r.group_id}: a length exceeds "
                  f"{limits.max_completion_tokens}")
  if any(f not in _FINISH for f in r.finish_reasons):
    raise invalid(f"eval {r.eval_id} group {r.group_id}: finish_reasons must be STOP, LENGTH or "
                  f"INTERRUPTED")
  if not (math.isfinite(r.device_seconds) and 0 <= r.device_seconds <= 1e9):
    raise invalid(f"eval {r.eval_id} group {r.group_id}: device_seconds={r.device_seconds} must "
                  f"be finite and in [0, 1e9]")
