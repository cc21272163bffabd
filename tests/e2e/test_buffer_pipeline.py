"""End-to-end: a real gRPC buffer on 127.0.0.1, two fake generator *processes* (spawn) and a fake
learner loop that pulls complete groups and publishes a new weight version every step.

Checks PipelineRL-k admission (max token lag <= k for k in {0, 1, 8}), complete groups, nothing
delivered twice, the server-side lag histogram, and ppo_off_policy (k batches from one version)."""
import multiprocessing as mp
import time

import numpy as np
import pytest

from helpers import publish_params
from scalerl_jax.protocol import codec
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient, batch_to_arrays
from scalerl_jax.generation.fake import run_fake_generator
from scalerl_jax.types import PromptSpec

TOKEN = "test-token-" + "x" * 16
B, G = 3, 4


def _prompts(n=20):
  return [PromptSpec(100 + i, np.arange(3 + i % 4, dtype=np.int32) + i, str(i)) for i in range(n)]


def _run(mode, k, steps, n_gen=2, train_s=0.02):
  srv = BufferServer(_prompts(), token=TOKEN, prompts_per_step=B, group_size=G, max_lag=k,
                     mode=mode, lease_ttl_s=60).start()
  c = BufferClient(srv.address, TOKEN)
  ctx = mp.get_context("spawn")
  stop = ctx.Event()
  procs = [ctx.Process(target=run_fake_generator, daemon=True,
                       kwargs=dict(address=srv.address, token=TOKEN, generator_id=f"gen{i}",
                                   seed=i, stop_event=stop, max_seconds=120))
           for i in range(n_gen)]
  for p in procs:
    p.start()
  try:
    publish_params(c, 0)
    batches = []
    for s in range(steps):
      b = c.pull_batch(s, timeout_s=60)
      batches.append(b)
      st = c.status()
      assert st.contents.leased_groups + st.contents.ready_groups <= max(k, 1) * B + B
      time.sleep(train_s)
      publish_params(c, s + 1)
    again = c.pull_batch(steps - 1, timeout_s=5)         # retry of the last step: same groups
    assert [g.group_id for g in again.groups] == [g.group_id for g in batches[-1].groups]
    status = c.status()
  finally:
    stop.set()
    for p in procs:
      p.join(timeout=20)
      if p.is_alive():
        p.terminate()
    c.close()
    srv.stop()
  assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
  return batches, status


def _check_common(batches, status):
  group_ids, rollout_ids = set(), set()
  for b in batches:
    assert len(b.groups) == B and b.summary.num_groups == B
    for g in b.groups:
      assert g.group_id not in group_ids, "group delivered twice"
      group_ids.add(g.group_id)
      assert [r.sample_index for r in g.rollouts] == list(range(G)), "incomplete group"
      assert {r.prompt_id for r in g.rollouts} == {g.prompt_id}
      for r in g.rollouts:
        assert r.rollout_id not in rollout_ids, "rollout delivered twice"
        rollout_ids.add(r.rollout_id)
    arrays = batch_to_arrays(b)
    assert arrays["tokens"].shape[0] == B * G
  assert status.contents.delivered_groups == len(group_ids)
  assert status.contents.stale_dropped_groups == 0       # admission wasted nothing
  assert status.rejected.get("INVALID_ARGUMENT", 0) == 0


def _lags(b):
  """Per-token lag s - version over every completion token of the batch."""
  return np.concatenate([b.step - codec.rollout_to_completion(r).versions.astype(np.int64)
                         for g in b.groups for r in g.rollouts])


@pytest.mark.parametrize("k", [0, 1, 8])
def test_pipeline_max_lag(k):
  # A slower learner for k=8 lets the generators run ahead, so the lag window is actually used.
  batches, status = _run("pipeline", k, steps=12 if k < 8 else 16, train_s=0.02 if k < 8 else 0.25)
  _check_common(batches, status)
  overall = 0
  for b in batches:
    lags = _lags(b)
    assert lags.min() >= 0 and lags.max() <= k, (b.step, lags.max())
    overall = max(overall, int(lags.max()))
    hist = np.bincount(lags)
    assert list(b.summary.lag.counts) == hist.tolist()   # server histogram == recomputed
    assert b.summary.lag.negative == 0
  if k == 0:
    assert overall == 0                                   # strict on-policy
  assert status.lag_total.max_lag == overall
  print(f"k={k}: max token lag {overall}, lag histogram {list(status.lag_total.counts)}")


def test_ppo_off_policy_k_batches_per_version():
  k = 3
  batches, status = _run("ppo_off_policy", k, steps=3 * k)
  _check_common(batches, status)
  for b in batches:
    versions = np.concatenate([codec.rollout_to_completion(r).versions
                               for g in b.groups for r in g.rollouts])
    round_start = (b.step // k) * k
    assert set(versions.tolist()) == {round_start}, (b.step, set(versions.tolist()))
    assert b.summary.lag.max_lag == b.step - round_start
  assert status.lag_total.max_lag == k - 1
