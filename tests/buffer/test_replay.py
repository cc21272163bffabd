"""The buffer's side of a learner resume (buffer/replay.py), in process and fast.

The learner trained steps 0..1 and checkpointed at step 2, then went on (step 2 delivered, version
3 published, more groups generated) and died. The restarted buffer must re-queue exactly the
untrained groups that the resumed learner's policy could have produced, drop the rest with counts,
hand the dropped prompts back in lease order, and never rewind twice for one resume id.
"""
import json

import numpy as np

from helpers import publish_params
from scalerl_jax.protocol import codec
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient, assignment_prompt
from scalerl_jax.generation.fake import random_completion
from scalerl_jax.types import PromptSpec
from scalerl_jax.buffer.replay import write_learner_state, read_learner_state

TOKEN = "resume-test-token"


def _prompts(n=12):
  return [PromptSpec(100 + i, np.arange(3 + i % 4, dtype=np.int32) + i, str(i)) for i in range(n)]


def _lease_push(c, rng, version, n_groups=1, samples=None, gen="g0"):
  out = []
  for a in c.lease(gen, max_groups=n_groups):
    p = assignment_prompt(a)
    rs = [codec.completion_to_rollout(random_completion(rng, a.prompt_id, 5, version),
                                      group_id=a.group_id, sample_index=i, prompt_tokens=p.tokens,
                                      generator_id=gen)
          for i in range(a.group_size if samples is None else samples)]
    c.push(rs)
    out.append((a.group_id, a.prompt_id, [r.rollout_id for r in rs]))
  return out


def _ids(batch):
  return [r.rollout_id for g in batch.groups for r in g.rollouts]


def _three_steps(tmp_path):
  """A buffer with a WAL; steps 0, 1, 2 delivered, checkpoint 2 durable after step 1. Returns
  (server, client, rng, learner-state path, server kwargs, acked, batches by step)."""
  d, ls = str(tmp_path / "wal"), str(tmp_path / "learner_state.json")
  write_learner_state(ls, 0, 0, None)
  kw = dict(token=TOKEN, prompts_per_step=2, group_size=2, max_lag=1, wal_dir=d, lease_ttl_s=60,
            shuffle_seed=7)
  srv = BufferServer(_prompts(), learner_state=read_learner_state(ls), **kw).start()
  c = BufferClient(srv.address, TOKEN)
  rng = np.random.default_rng(0)
  acked, batches = [], {}
  for s in range(3):                                   # steps 0, 1, 2 delivered
    publish_params(c, s)
    acked += _lease_push(c, rng, s, n_groups=2)
    batches[s] = c.pull_batch(s, timeout_s=5)
    if s == 1:
      write_learner_state(ls, 2, 0, None)            # checkpoint 2 is durable (steps 0, 1 trained)
  return srv, c, rng, ls, kw, acked, batches


def test_buffer_rewinds_to_the_learner_checkpoint_once(tmp_path):
  srv, c, rng, ls, kw, acked, batches = _three_steps(tmp_path)
  trained = _ids(batches[0]) + _ids(batches[1])
  publish_params(c, 3)
  partial = _lease_push(c, rng, 3, samples=1)        # incomplete, version 3
  future = _lease_push(c, rng, 3)                    # complete, but version 3 > checkpoint 2
  port = srv.port
  srv._server.stop(0).wait()                         # the buffer dies with its learner
  c.close()

  write_learner_state(ls, 2, 0, dict(id="resume-1", step=2, npr=None))
  srv2 = BufferServer(_prompts(), port=port, learner_state=read_learner_state(ls), **kw).start()
  try:
    rep = srv2.wal_report["resume"]
    assert rep == dict(step=2, from_ns=3, from_version=3, requeued_groups=2, requeued_rollouts=4,
                       dropped_lost_version_groups=1, dropped_stale_groups=0,
                       dropped_incomplete_groups=1, returned_prompts=2, missing_steps=[])
    c = BufferClient(srv2.address, TOKEN)
    assert c.fetch_version(-1, wait_timeout_s=0) is None       # version 3's weights are gone
    publish_params(c, 2)                                  # the resumed learner's version
    again = c.pull_batch(2, timeout_s=5)
    assert [g.group_id for g in again.groups] == [g.group_id for g in batches[2].groups]
    assert _ids(again) == _ids(batches[2])                       # same rollouts, same order
    trained += _ids(again)
    publish_params(c, 3, tag=1)
    nxt = _lease_push(c, rng, 3, n_groups=2)                     # dropped prompts come back first
    assert [p for _, p, _ in nxt] == [partial[0][1], future[0][1]]
    port = srv2.port
  finally:
    srv2._server.stop(0).wait()
    c.close()
  # A buffer-only restart later must not rewind again for the same resume id.
  srv3 = BufferServer(_prompts(), port=port, learner_state=read_learner_state(ls), **kw).start()
  try:
    assert srv3.wal_report["resume"] is None
    c = BufferClient(srv3.address, TOKEN)
    assert c.status().contents.next_step == 3
    trained += _ids(c.pull_batch(3, timeout_s=5))
    c.close()
  finally:
    srv3.stop()
  acked_ids = [i for _, _, ids in acked + partial + future + nxt for i in ids]
  assert len(trained) == len(set(trained)) == 16                 # 4 steps x 2 groups x 2, no dups
  assert set(trained) <= set(acked_ids)
  dropped = set(partial[0][2]) | set(future[0][2])
  assert not dropped & set(trained)
  print("\n[buffer-rewind]", json.dumps(dict(rewind=rep, acked=len(acked_ids),
                                             trained=len(trained), dropped=len(dropped))))


def test_fresh_buffer_adopts_the_checkpoint_position(tmp_path):
  """Without a WAL (or with a lost one) the buffer starts at the checkpoint's step and version."""
  srv = BufferServer(_prompts(), token=TOKEN, prompts_per_step=2, group_size=2, max_lag=0,
                     learner_state=dict(checkpoint_step=5, retain_from_step=5,
                                        resume=dict(id="x", step=5, npr=None))).start()
  try:
    c = BufferClient(srv.address, TOKEN)
    st = c.status().contents
    assert (st.next_step, st.current_version) == (5, 5)
    publish_params(c, 5)
    rng = np.random.default_rng(1)
    _lease_push(c, rng, 5, n_groups=2)
    assert c.pull_batch(5, timeout_s=5).summary.step == 5
    c.close()
  finally:
    srv.stop()


def _lease_order_after_rewind(tmp_path, release: bool) -> tuple[list, list]:
  """Steps 0..2 delivered, checkpoint 2; then one lease of three version-3 groups: the first and
  last incomplete, the middle one complete (a lost version after the rewind). With `release` the
  generator gives its incomplete groups back (SIGTERM) and the buffer restarts once before the
  learner resumes (a WAL compaction in between). Returns (the three groups' prompts in lease
  order, the prompts leased first after the rewind)."""
  tmp_path.mkdir()
  srv, c, rng, ls, kw, _, _ = _three_steps(tmp_path)
  publish_params(c, 3)
  leased = c.lease("g0", max_groups=3)
  assert len(leased) == 3
  for a, n in zip(leased, (1, 2, 0)):              # pushed samples: incomplete, complete, none
    p = assignment_prompt(a)
    c.push([codec.completion_to_rollout(random_completion(rng, a.prompt_id, 5, 3),
                                        group_id=a.group_id, sample_index=i,
                                        prompt_tokens=p.tokens, generator_id="g0")
            for i in range(n)])
  if release:
    assert c.release("g0") == 2
  port = srv.port
  srv._server.stop(0).wait()
  c.close()
  if release:                                      # a buffer-only restart: compacts the WAL
    srv = BufferServer(_prompts(), port=port, learner_state=read_learner_state(ls), **kw).start()
    srv._server.stop(0).wait()
  write_learner_state(ls, 2, 0, dict(id="resume-1", step=2, npr=None))
  srv = BufferServer(_prompts(), port=port, learner_state=read_learner_state(ls), **kw).start()
  try:
    c = BufferClient(srv.address, TOKEN)
    publish_params(c, 2)
    c.pull_batch(2, timeout_s=5)
    publish_params(c, 3, tag=1)
    nxt = [a.prompt_id for a in c.lease("g1", max_groups=3)]
    c.close()
  finally:
    srv.stop()
  return [a.prompt_id for a in leased], nxt


def test_groups_released_before_a_rewind_come_back_in_lease_order(tmp_path):
  """A generator's SIGTERM release (buffer/durability.py `release`) puts its prompts back at the
  queue front; a learner rewind later returns the rest. The next lease gets all of them in the
  order they were first leased, exactly as after the rewind alone: a resumed run leases what the
  uninterrupted one did (tests/e2e/test_resume.py), whether or not a generator was told to stop first
  (the learner's death sends it SIGTERM). Before groups.PromptQueue the release reversed its
  groups (one appendleft each) and the rewind put the complete group in front of them."""
  order, alone = _lease_order_after_rewind(tmp_path / "alone", release=False)
  order2, released = _lease_order_after_rewind(tmp_path / "released", release=True)
  assert order == order2 and len(set(order)) == 3
  assert alone == order
  assert released == order
