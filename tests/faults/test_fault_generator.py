"""Generator faults: kill -9 of a generator process mid-group, lease expiry, supervisor restart.

Numbers observed here are tabulated in docs/RELIABILITY.md (run with -s to print them).
"""
import json
import os
import signal
import sys
import time

import pytest

from helpers import publish_params
import fault_common as fc
from scalerl_jax.processes import ProcessGroup
from scalerl_jax.protocol import codec
from scalerl_jax.protocol.client import BufferClient

TOKEN = fc.TOKEN


def _last_partial(path, G):
  """(gid, acked ids) if the newest push line of `path` left its group with 1..G-2 samples."""
  lines = [l for l in fc.read_log(path) if "gid" in l]
  if not lines:
    return None
  gid = lines[-1]["gid"]
  ids = [i for l in lines if l["gid"] == gid for i in l.get("ids", [])]
  return (gid, ids) if 1 <= len(ids) <= G - 2 else None


def test_kill9_generator_mid_group_is_replaced_and_nothing_half_written_is_trained(
    tmp_path, monkeypatch):
  monkeypatch.setenv("SCALERL_BUFFER_TOKEN", TOKEN)
  B, G, k, steps, ttl, kill_at = 4, 4, 2, 12, 3.0, 3
  prompts = fc.write_prompts(str(tmp_path / "prompts.jsonl"))
  procs = ProcessGroup(str(tmp_path))
  procs.max_restarts["gen"] = 3
  address = procs.start_buffer_argv(fc.buffer_argv(prompts, None, B, G, k, ttl=ttl))
  logs = [str(tmp_path / f"gen{i}.jsonl") for i in range(2)]
  c = BufferClient(address, TOKEN)
  published = [(0, time.time())]
  delivered, killed = {}, None
  try:
    publish_params(c, 0)
    for i in range(2):
      procs.start(f"gen-{i}", fc.gen_argv(address, f"gen-{i}", i, logs[i], per_sample=True,
                                          heartbeat_s=0.5, sample_sleep_s=0.05), env=fc.ENV)
    procs.start_supervisor(interval_s=0.25)
    t_start = time.time()
    for s in range(steps):
      if s == kill_at:                           # kill gen-0 while its group is half pushed
        end = time.time() + 30
        while killed is None and time.time() < end:
          killed = _last_partial(logs[0], G)
          time.sleep(0.005)
        assert killed is not None, "gen-0 never had a half-pushed group"
        os.killpg(procs.procs["gen-0"].pid, signal.SIGKILL)
        t_kill, v_kill = time.time(), published[-1][0]
      b = c.pull_batch(s, timeout_s=60)
      for g in b.groups:
        assert [r.sample_index for r in g.rollouts] == list(range(G)), "half-written group"
        for r in g.rollouts:
          assert r.rollout_id not in delivered, f"rollout {r.rollout_id} delivered twice"
          delivered[r.rollout_id] = (s, g.group_id, r)
      procs.check()                              # the watchdog: raises only beyond the limits
      time.sleep(0.05)
      publish_params(c, s + 1)
      published.append((s + 1, time.time()))
    wall = time.time() - t_start
    status = c.status()
  finally:
    c.close()
    procs.close(grace_s=5)
  gid, partial_ids = killed
  assert [e["name"] for e in procs.events] == ["gen-0"]
  restart_t = procs.events[0]["t"]
  assert not set(partial_ids) & set(delivered), "a half-written group's samples were trained"
  assert gid not in {g for _, g, _ in delivered.values()}
  assert status.contents.expired_groups >= 1
  starts = [l for l in fc.read_log(logs[0]) if "start_version" in l]
  assert len(starts) == 2 and starts[0]["pid"] != starts[1]["pid"]
  new = starts[1]
  latest_before = max(v for v, t in published if t <= new["t"])
  assert new["start_version"] >= latest_before >= v_kill   # it fetched the newest weights first
  lines = fc.read_log(logs[0])
  after = {i for l in lines[lines.index(new):] for i in l.get("ids", [])}
  later = [r for rid, (_, _, r) in delivered.items() if rid in after]
  assert later, "the restarted generator contributed nothing"
  min_v = min(int(codec.rollout_to_completion(r).versions.min()) for r in later)
  assert min_v >= new["start_version"]
  summary = dict(steps=steps, wall_s=round(wall, 2), killed_gid=gid, partial_acked=len(partial_ids),
                 detect_and_restart_s=round(restart_t - t_kill, 2),
                 expired_groups=status.contents.expired_groups,
                 delivered=len(delivered), delivered_from_restarted=len(later),
                 version_at_kill=v_kill, restarted_start_version=new["start_version"],
                 restarted_min_token_version=min_v)
  print("\n[kill9-generator]", json.dumps(summary))


def test_supervisor_gives_up_after_max_restarts(tmp_path):
  procs = ProcessGroup(str(tmp_path))
  procs.max_restarts["gen"] = 2
  procs.start("gen-0", [sys.executable, "-c", "import sys; sys.exit(3)"])
  try:
    restarts = 0
    with pytest.raises(RuntimeError, match=r"gen-0 exited with code 3 \(restarted 2 times"):
      for _ in range(200):
        time.sleep(0.05)
        restarts += len(procs.supervise())
    assert restarts == 2
    assert len(open(os.path.join(procs.logdir, "supervisor.log")).readlines()) == 2
  finally:
    procs.close(grace_s=1)
