"""Buffer crash faults: the write-ahead log (scalerl_jax/buffer/wal.py) and client reconnects.

Numbers observed here are tabulated in docs/RELIABILITY.md (run with -s to print them).
"""
import hashlib
import json
import os
import signal
import threading
import time

import numpy as np
import pytest

from helpers import buffer_knobs, publish_params, tiny_params
import fault_common as fc
from scalerl_jax.processes import ProcessGroup
from scalerl_jax.protocol import codec
from scalerl_jax.buffer import wal
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient, assignment_prompt
from scalerl_jax.generation.fake import random_completion
from scalerl_jax.types import PromptSpec
from scalerl_jax.weights.stream import StreamFetcher

TOKEN = fc.TOKEN


def _prompts(n=12):
  return [PromptSpec(100 + i, np.arange(3 + i % 4, dtype=np.int32) + i, str(i)) for i in range(n)]


def _group(c, rng, gen="g0", version=0, n=None):
  """Leases one group and returns its rollouts (first `n` samples)."""
  (a,) = c.lease(gen, max_groups=1)
  p = assignment_prompt(a)
  return [codec.completion_to_rollout(random_completion(rng, a.prompt_id, 5, version),
                                      group_id=a.group_id, sample_index=i, prompt_tokens=p.tokens,
                                      generator_id=gen)
          for i in range(a.group_size if n is None else n)]


def _contents(c):
  st = c.status().contents
  return {f.name: getattr(st, f.name) for f in st.DESCRIPTOR.fields}


def test_wal_replay_restores_state_weights_and_idempotency(tmp_path):
  d = str(tmp_path / "wal")
  kw = dict(token=TOKEN, prompts_per_step=2, group_size=3, max_lag=1, wal_dir=d, lease_ttl_s=60)
  srv = BufferServer(_prompts(), **kw).start()
  c = BufferClient(srv.address, TOKEN)
  rng = np.random.default_rng(0)
  publish_params(c, 0)
  pushed = []
  for _ in range(2):
    pushed += _group(c, rng)
  c.push(pushed)
  b0 = c.pull_batch(0, timeout_s=5)
  publish_params(c, 1)
  full = _group(c, rng, version=1)
  partial = _group(c, rng, version=1, n=2)       # an incomplete group stays outstanding
  c.push(full + partial)
  before = _contents(c)
  port = srv.port
  srv._server.stop(0).wait()                     # like a crash: no shutdown work (WAL not closed)
  c.close()
  srv2 = BufferServer(_prompts(), port=port, **kw).start()
  try:
    c = BufferClient(srv2.address, TOKEN)
    assert _contents(c) == before                # digest covers version, ns, groups and rollout ids
    rep = srv2.wal_report
    assert rep["torn"] == [] and rep["restored"]["ns"] == 1 and rep["restored"]["version"] == 1
    acks = c.push(pushed + full + partial)       # delivered, ready and partial: all duplicates
    assert all(a.duplicate for a in acks) and len(acks) == 11
    again = c.pull_batch(0, timeout_s=5)         # retried pull of the delivered step: same groups
    assert [g.group_id for g in again.groups] == [g.group_id for g in b0.groups]
    assert [r.rollout_id for g in again.groups for r in g.rollouts] == \
           [r.rollout_id for g in b0.groups for r in g.rollouts]
    got = StreamFetcher(c).fetch(-1)                            # weights.bin: a packed version
    assert got is not None and got.version == 1
    assert all(np.array_equal(got.params[k], tiny_params()[k]) for k in ("w", "b"))
    assert publish_params(c, 1).version == 1      # idempotent re-publish
    # The rest of the partial group completes the batch of step 1 after the restart.
    a_rest = [codec.completion_to_rollout(random_completion(rng, partial[0].prompt_id, 5, 1),
                                          group_id=partial[0].group_id, sample_index=2,
                                          prompt_tokens=codec.decode(partial[0].prompt_tokens,
                                                                     pb.INT32, "p", 1 << 20),
                                          generator_id="g0")]
    c.push(a_rest)
    b1 = c.pull_batch(1, timeout_s=5)
    assert {g.group_id for g in b1.groups} == {full[0].group_id, partial[0].group_id}
    assert _contents(c)["delivered_rollouts"] == 12
    c.close()
  finally:
    srv2.stop()
  # Compaction: the new segment holds no delivered rollouts except the last batch (retry).
  records, rep = wal.read_all(d, truncate=False)
  assert len(rep["segments"]) == 1 and rep["records"]["snapshot"] == 1


def test_wal_with_an_old_blob_fails_with_the_format_named(tmp_path, monkeypatch):
  """A weights.bin written by the removed blob protocol (one opaque payload, format "safetensors")
  stops the buffer at startup with an error naming the format, not an obscure crash."""
  from scalerl_jax.buffer import server as server_mod
  from scalerl_jax.buffer.weight_store import UnsupportedWeightsFormat
  d = str(tmp_path / "wal")
  kw = dict(token=TOKEN, prompts_per_step=2, group_size=2, max_lag=1, wal_dir=d)
  srv = BufferServer(_prompts(), **kw).start()
  c = BufferClient(srv.address, TOKEN)
  publish_params(c, 0)
  c.close()
  srv.stop()
  blob = b"old safetensors payload"
  w = wal.WAL(d, fsync="none")
  w.save_weights(0, blob, hashlib.sha256(blob).hexdigest(), "safetensors")
  w.close()
  with pytest.raises(UnsupportedWeightsFormat, match="'safetensors'.*blob"):
    BufferServer(_prompts(), **kw)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps(dict(prompt_id=p.prompt_id, tokens=p.tokens.tolist(),
                                             answer=p.answer)) + "\n" for p in _prompts()))
  monkeypatch.setenv("SCALERL_BUFFER_TOKEN", TOKEN)
  with pytest.raises(SystemExit) as e:                     # the command: one line, no traceback
    server_mod.main(["--prompts", str(prompts), "--wal-dir", d, "--no-tune-malloc",
                     *buffer_knobs(2, 2, 8)])
  assert "format 'safetensors'" in str(e.value.code)


@pytest.mark.parametrize("damage", ["short_length", "crc"])
def test_torn_wal_tail_is_truncated_and_reported(tmp_path, caplog, damage):
  d = str(tmp_path / "wal")
  kw = dict(token=TOKEN, prompts_per_step=2, group_size=2, max_lag=1, wal_dir=d)
  srv = BufferServer(_prompts(), **kw).start()
  c = BufferClient(srv.address, TOKEN)
  publish_params(c, 0)
  rs = _group(c, np.random.default_rng(1))
  c.push(rs)
  before = _contents(c)
  c.close()
  srv._server.stop(0).wait()
  seg = wal.segments(d)[-1][1]
  rec = wal.encode(wal.ROLLOUT, rs[0].SerializeToString())
  size = os.path.getsize(seg)
  with open(seg, "ab") as f:                     # a crash mid-write of the next record
    if damage == "short_length":
      f.write(rec[:len(rec) // 2])
    else:
      f.write(rec[:-1] + bytes([rec[-1] ^ 0xFF]))
  torn_bytes = os.path.getsize(seg) - size
  caplog.set_level("WARNING", logger="scalerl.wal")
  srv2 = BufferServer(_prompts(), **kw).start()
  try:
    (t,) = srv2.wal_report["torn"]
    assert t["offset"] == size and t["dropped_bytes"] == torn_bytes
    assert ("runs past end" in t["reason"]) if damage == "short_length" else t["reason"] == "crc32 mismatch"
    assert any("torn tail" in r.getMessage() and "truncated" in r.getMessage() for r in caplog.records)
    c = BufferClient(srv2.address, TOKEN)
    assert _contents(c) == before
    c.close()
    print(f"\n[torn-{damage}] appended {torn_bytes} B at offset {size}: {t}")
  finally:
    srv2.stop()


def _kill9(procs, name):
  p = procs.procs[name]
  os.killpg(p.pid, signal.SIGKILL)
  p.wait()


def test_kill9_buffer_mid_run_loses_no_acked_rollout(tmp_path, monkeypatch):
  monkeypatch.setenv("SCALERL_BUFFER_TOKEN", TOKEN)
  B, G, k, steps, kill_at = 4, 4, 2, 14, (4, 9)
  wal_dir = str(tmp_path / "wal")
  prompts = fc.write_prompts(str(tmp_path / "prompts.jsonl"))
  procs = ProcessGroup(str(tmp_path))
  logs = [str(tmp_path / f"gen{i}.jsonl") for i in range(2)]
  address = procs.start_buffer_argv(fc.buffer_argv(prompts, wal_dir, B, G, k, ttl=20, archive=True),
                                   60, wal_dir)
  c = BufferClient(address, TOKEN, retry_budget_s=60)
  reports, downtime, delivered, by_step = [], [], {}, {}
  state = {"step": -1}

  def killer():
    for s in kill_at:
      while state["step"] < s:
        time.sleep(0.01)
      time.sleep(0.3)                            # generators are pushing, learner is pulling
      t0 = time.time()
      _kill9(procs, "buffer")
      time.sleep(1.0)
      reports.append(procs.restart_buffer()["wal"])
      downtime.append(time.time() - t0)
  try:
    publish_params(c, 0)
    for i in range(2):
      procs.start(f"gen-{i}", fc.gen_argv(address, f"gen-{i}", i, logs[i]), env=fc.ENV)
    kt = threading.Thread(target=killer, daemon=True)
    kt.start()
    for s in range(steps):
      b = c.pull_batch(s, timeout_s=150)   # 60 s timed out once at load ~4 (12 groups leased)
      by_step[s] = [g.group_id for g in b.groups]
      assert len(b.groups) == B
      for g in b.groups:
        assert [r.sample_index for r in g.rollouts] == list(range(G))
        for r in g.rollouts:
          assert r.rollout_id not in delivered, f"rollout {r.rollout_id} trained twice"
          delivered[r.rollout_id] = s
      state["step"] = s
      time.sleep(0.05)                           # "training"
      publish_params(c, s + 1)
    kt.join(60)
    assert len(reports) == len(kill_at)
    for i in range(2):                           # stop generators: the acked set is final
      os.killpg(procs.procs[f"gen-{i}"].pid, signal.SIGTERM)
      procs.procs[f"gen-{i}"].wait(20)
    _kill9(procs, "buffer")                      # one more crash, then count from the WAL
    final = procs.restart_buffer()["wal"]
    again = c.pull_batch(steps - 1, timeout_s=10)
    assert [g.group_id for g in again.groups] == by_step[steps - 1]
    status = c.status()
    learner_retries = c.retried
  finally:
    c.close()
    procs.close(grace_s=5)
  acked, received = set(), set()
  for path in logs:
    for line in fc.read_log(path):
      acked.update(line.get("ids", []))
      acked.update(line.get("dup", []))
      if "leased" in line:
        received.add(line["leased"])
  leased, expired = set(), []                # every segment ever written (--wal-archive)
  for path in wal.audit_segments(wal_dir):
    for t, body in wal.read_segment(path, truncate=False)[0]:
      if t == wal.LEASE:
        leased.add(json.loads(body)["gid"])
      elif t == wal.EXPIRE:
        expired.append(json.loads(body)["gid"])
  records, _ = wal.read_all(wal_dir, truncate=False)
  seen, last, stored = set(), set(), {}
  for t, body in records:
    if t == wal.SEEN:
      seen.update(json.loads(body)["ids"])
    elif t == wal.LAST_BATCH:
      last.update(json.loads(body)["gids"])
    elif t == wal.ROLLOUT:
      r = pb.Rollout.FromString(body)
      stored[r.rollout_id] = r.group_id
  last_ids = {r for r, g in stored.items() if g in last}
  queued = {r for r, g in stored.items() if g not in last}
  assert seen | last_ids == set(delivered), "WAL's delivered set differs from what was trained"
  assert not (queued & set(delivered))
  # A kill -9 between the lease's WAL commit and its reply orphans that lease: no generator ever
  # received it, so it runs out after the TTL (the designed recovery). A lease a generator did
  # receive must never run out: restarts give every restored lease a full TTL and heartbeats renew it.
  assert status.contents.expired_groups == len(expired) <= 2 * (len(kill_at) + 1)
  assert set(expired) <= leased - received, (
      f"leases {sorted(set(expired) & received)} expired although a generator held them")
  lost = acked - set(delivered) - queued
  assert not lost, f"{len(lost)} acknowledged rollouts lost"
  assert status.contents.delivered_rollouts == len(delivered) == steps * B * G
  assert status.contents.stored_rollouts == len(queued)
  summary = dict(steps=steps, kills=len(kill_at) + 1, learner_retries=learner_retries,
                 acked=len(acked), delivered=len(delivered),
                 queued=len(queued), lost=len(lost), orphaned_leases_expired=len(expired), downtime_s=[round(x, 2) for x in downtime],
                 replay=[dict(records=r["records"], restored=r["restored"], torn=r["torn"],
                              replay_s=r["replay_s"]) for r in reports + [final]])
  print("\n[kill9-buffer]", json.dumps(summary))


def test_wal_replay_ppo_off_policy_round(tmp_path):
  """ppo_off_policy: a half-generated round survives a restart with its admission state."""
  d = str(tmp_path / "wal")
  kw = dict(token=TOKEN, prompts_per_step=2, group_size=2, max_lag=2, mode="ppo_off_policy",
            wal_dir=d)
  srv = BufferServer(_prompts(), **kw).start()
  c = BufferClient(srv.address, TOKEN)
  rng = np.random.default_rng(2)
  publish_params(c, 0)
  groups = [_group(c, rng) for _ in range(4)]    # the whole round: k * B = 4 groups
  assert c.lease("g0", max_groups=1) == []
  c.push([r for g in groups[:3] for r in g])
  st = c.status()
  before, cap = _contents(c), st.admission_capacity
  port = srv.port
  c.close()
  srv._server.stop(0).wait()
  srv2 = BufferServer(_prompts(), port=port, **kw).start()
  try:
    c = BufferClient(srv2.address, TOKEN)
    assert _contents(c) == before and c.status().admission_capacity == cap == 0
    assert c.lease("g0", max_groups=1) == []       # the round is still fully leased
    c.push(groups[3])
    ids = [c.pull_batch(s, timeout_s=5) for s in range(2)]
    assert sorted(g.group_id for b in ids for g in b.groups) == sorted(g[0].group_id for g in groups)
    c.close()
  finally:
    srv2.stop()


def test_failed_wal_commit_leaves_no_bytes_behind(tmp_path):
  """A commit that fails mid-write (a full disk: the kernel writes what fits, then errors) must cut
  its bytes off the segment: a torn record followed by later commits hides them from replay (they
  were acked, then lost, and the groups they delivered are delivered again: the chaos run's
  duplicates), and a buffered tail of the failed record written out by the next commit resurrects a
  record the caller was told had failed. Real kernel behaviour, via RLIMIT_FSIZE in a child."""
  import subprocess
  import sys
  d = str(tmp_path / "wal")
  r = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "wal_procs.py"),
                      "full_disk", d], capture_output=True, text=True, timeout=120)
  assert r.returncode == 0, r.stderr[-3000:]
  out = json.loads(r.stdout.strip().splitlines()[-1])
  assert out["error"] is not None and "too large" in out["error"].lower(), out
  assert out["after_fail"] == out["before"], out            # nothing of C (or the DELIVER) left
  recs, torn = wal.read_segment(out["segment"], truncate=False)
  assert torn is None
  assert [(t, b[:1]) for t, b in recs] == [(wal.SNAPSHOT, b"{"), (wal.ROLLOUT, b"A"),
                                           (wal.ROLLOUT, b"B"), (wal.ROLLOUT, b"D")]
  print(f"\n[wal-full-disk] {out}")


def test_wal_commit_after_a_failed_cut_fails_until_the_cut_succeeds(tmp_path, monkeypatch):
  """If even the truncation fails, no later record may land behind the failed one's bytes."""
  import errno
  d = str(tmp_path / "wal")
  w = wal.WAL(d)
  w.start_snapshot(iter([wal.encode(wal.SNAPSHOT, dict(ns=0))]))
  w.append(wal.ROLLOUT, b"A" * 100)
  w.commit()
  seg = wal.segments(d)[-1][1]
  good = os.path.getsize(seg)
  real_writev, real_trunc = os.writev, os.ftruncate

  def half_then_enospc(fd, bufs):          # a short write, as at a full disk, then the error
    data = b"".join(bytes(b) for b in bufs)
    real_writev(fd, [data[:len(data) // 2]])
    raise OSError(errno.ENOSPC, "No space left on device")

  def no_trunc(fd, n):
    raise OSError(errno.EIO, "Input/output error")

  monkeypatch.setattr(os, "writev", half_then_enospc)
  monkeypatch.setattr(os, "ftruncate", no_trunc)
  w.append(wal.ROLLOUT, b"C" * 1000)
  with pytest.raises(OSError, match="No space"):
    w.commit()
  assert os.path.getsize(seg) > good                       # the cut failed: bytes still there
  monkeypatch.setattr(os, "writev", real_writev)
  w.append(wal.ROLLOUT, b"D" * 100)
  with pytest.raises(OSError, match="could not be cut off"):
    w.commit()                                             # refused, not appended behind them
  monkeypatch.setattr(os, "ftruncate", real_trunc)
  w.append(wal.ROLLOUT, b"E" * 100)
  w.commit()
  w.close()
  recs, torn = wal.read_segment(seg, truncate=False)
  assert torn is None and [b[:1] for _, b in recs[1:]] == [b"A", b"E"]
