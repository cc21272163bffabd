"""A fake generator process and random rollouts, for tests, benchmarks and wiring demos (no model).

`run_fake_generator` leases groups, "generates" random tokens/log-probs with small random sleeps,
stamps each token with the policy version it last fetched (picking up new versions in flight, as
PipelineRL does, unless the lease pins one version), and streams the group back.
"""
from __future__ import annotations

import time
from typing import Optional

import grpc
import numpy as np

from scalerl_jax.protocol import codec
from scalerl_jax.protocol.client import BufferClient, assignment_prompt
from scalerl_jax.types import FINISH_LENGTH, FINISH_STOP, Completion


def random_completion(rng: np.random.Generator, prompt_id: int, length: int, version: int,
                      vocab: int = 1000) -> Completion:
  """A completion of random tokens, log-probs in (-inf, 0], all stamped with `version`."""
  return Completion(prompt_id=prompt_id, tokens=rng.integers(0, vocab, length, dtype=np.int32),
                    logprobs=-rng.exponential(1.0, length).astype(np.float32),
                    versions=np.full(length, version, np.int32), policy_mask=np.ones(length, bool),
                    finish_reason=FINISH_STOP if rng.random() < 0.8 else FINISH_LENGTH,
                    reward=float(rng.integers(0, 2)))


def run_fake_generator(address: str, token: str, generator_id: str, seed: int = 0,
                       stop_event=None, max_sleep_s: float = 0.02, min_len: int = 4,
                       max_len: int = 32, max_seconds: float = 300.0,
                       log_queue=None) -> int:
  """Generator loop; returns the number of rollouts acknowledged. Ends on `stop_event`, after
  `max_seconds`, or when the server goes away."""
  rng = np.random.default_rng(seed)
  c = BufferClient(address, token, retries=2)
  version: Optional[int] = None
  acked = 0
  end = time.time() + max_seconds
  try:
    got = c.fetch_weights(-1, wait_timeout_s=60)
    version = got[0] if got else 0
    while time.time() < end and not (stop_event is not None and stop_event.is_set()):
      for a in c.lease(generator_id, max_groups=1, wait_timeout_s=0.2):
        if version < a.min_version:                       # must generate with >= min_version
          got = c.fetch_weights(version, wait_timeout_s=60)
          version = got[0] if got else version
        p = assignment_prompt(a)
        pinned = a.max_version >= 0
        rollouts = []
        for i in range(a.group_size):
          L = int(rng.integers(min_len, max_len + 1))
          comp = random_completion(rng, a.prompt_id, L, version)
          time.sleep(rng.random() * max_sleep_s)
          if not pinned and rng.random() < 0.5:           # in-flight weight update mid-sequence
            got = c.fetch_weights(version, wait_timeout_s=0)
            if got:
              version = got[0]
              cut = int(rng.integers(1, L))
              comp.versions[cut:] = version
          rollouts.append(codec.completion_to_rollout(
              comp, group_id=a.group_id, sample_index=i, prompt_tokens=p.tokens,
              generator_id=generator_id))
        try:
          acks = c.push(rollouts)
          acked += sum(1 for x in acks if not x.duplicate)
          if log_queue is not None:
            log_queue.put((generator_id, a.group_id, [x.rollout_id for x in acks]))
        except grpc.RpcError as e:
          if e.code() != grpc.StatusCode.FAILED_PRECONDITION:   # lease expired: drop the group
            raise
  except grpc.RpcError as e:
    if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
      raise
  finally:
    c.close()
  return acked
