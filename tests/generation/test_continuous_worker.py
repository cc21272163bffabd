"""The generator worker's continuous loop (generator.continuous=True) against a real buffer server:
groups are pushed one by one as their last sample is graded, a slow grader stalls neither decoding
nor the other groups, PipelineRL-k's staleness bound holds, and the generators' occupancy counters
reach the learner's batch summaries through the heartbeats.

In one process: a BufferServer, the tiny config's model (random weights: rewards do not matter
here), a real `Worker` on a thread, and this test as the learner (pulls batches, publishes
versions)."""
import os
import threading
import time

import jax
import pytest
from helpers import drive_continuous

from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.data import build_dataset
from scalerl_jax.generation.worker import Worker
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.training.trainer import generator_metrics
from scalerl_jax.weights.stream import StreamPublisher

TOKEN = "continuous-worker-test-token"

pytestmark = pytest.mark.xdist_group("sampler")


def test_continuous_worker_pushes_per_group_and_a_slow_grader_stalls_nothing(tmp_path):
  c = tiny.get_config()
  c.generator.continuous = True
  c.generator.decode_batch = 16          # 2 groups of 8 in flight
  c.generator.groups_per_lease = 2
  c.generator.heartbeat_s = 0.5
  c.rollout.think_budget_min, c.rollout.think_budget_max = 4, 40   # a spread of lengths
  c.rewards.log = False
  k, B, G = 2, 2, 8
  ds = build_dataset(c.data, c.rollout.max_prompt_len)
  mcfg = model_sections.model_config(c)
  params = jax.device_get(models.init_params(mcfg, jax.random.PRNGKey(0)))
  srv = BufferServer(ds.train, token=TOKEN, prompts_per_step=B, group_size=G, max_lag=k).start()
  os.environ[c.buffer.auth_token_env] = TOKEN
  client = BufferClient(srv.address, TOKEN, retries=3)
  StreamPublisher(client, 0, params).publish()
  worker = Worker(common.RunConfig.from_config(c), srv.address, "gen-0", "jax", str(tmp_path))
  assert worker.continuous_ok() == ""
  # The first group graded blocks in its grader (a hung sandbox, say) until this test has seen
  # two other groups pushed meanwhile: forced, not timed. Admission lets (k + 1) * B = 6 groups
  # out at version 0 and at most 2 decode at once, so >= 3 groups start decoding after it.
  pushed, slow, release = [], {}, threading.Event()
  grade = worker.rewards

  def rewards(completion, answer, prompt_id=None, log=None):
    if not slow:
      slow["pid"] = prompt_id
    if prompt_id == slow["pid"] and "t0" not in slow:
      slow["t0"] = time.time()
      slow["chunks0"] = worker.decode_stats.chunks
      slow["released"] = release.wait(120)
      slow["t1"] = time.time()
      slow["chunks1"] = worker.decode_stats.chunks
    return grade(completion, answer, prompt_id, log)
  worker.rewards = rewards
  push = worker.client.push

  def record_push(rollouts):
    pushed.append((time.time(), {r.group_id for r in rollouts}, len(rollouts)))
    if "t0" in slow and sum(t > slow["t0"] for t, _, _ in pushed) >= 2:
      release.set()
    return push(rollouts)
  worker.client.push = record_push
  summaries = []

  def on_batch(step, batch):
    lags = [step - int(v) for g in batch.groups for r in g.rollouts
            for v in codec.decode(r.versions, pb.INT32, "versions", 1 << 20)]
    assert max(lags) <= k, lags                      # PipelineRL-k: never staler than k
    summaries.append(dict(batch.summary.generator_stats))
  drive_continuous(worker, client, srv, 6, B, G,
                   publish=lambda v: StreamPublisher(client, v, params).publish(),
                   on_batch=on_batch, timeout_s=300)
  # One push per group, each with the group's G samples.
  assert pushed and all(len(gids) == 1 and n == G for _, gids, n in pushed), pushed
  # While the slow group's grader was stuck, decoding went on and other groups were pushed.
  assert slow["released"], (pushed, slow)
  assert slow["chunks1"] > slow["chunks0"], slow
  during = [t for t, _, _ in pushed if slow["t0"] < t <= slow["t1"]]
  assert len(during) >= 2, (pushed, slow)
  # The heartbeat counters reached the learner's batch summaries: occupancy of a 16-slot decoder.
  m = generator_metrics(summaries[-1])
  assert 0 < m["gen_occupancy"] <= 1.0, m                 # busy slot-steps of 16-slot chunks
  assert summaries[-1]["slot_steps"] % 16 == 0, summaries[-1]
  # with samples waiting, chunks end as samples end (`step(refill=True)`): fewer slot-steps than
  # whole chunks would take (~7 of 16 slots end within each 16-step chunk at these lengths)
  st = worker.decode_stats
  assert st.slot_steps < 16 * c.generator.chunk_steps * st.chunks, st
  # (the summaries carry the last heartbeat's counters; the worker's own are the newest)
  assert worker.decode_stats.grade_s >= slow["t1"] - slow["t0"] - 0.1, (worker.decode_stats, slow)
  assert m["gen_decode_s"] > 0
