"""RPC-level behaviour of the live buffer: weights publish/fetch/watch, disconnects, retries."""
import os
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest

from helpers import buffer_knobs, free_port, tiny_params
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol.client import BufferClient, assignment_prompt, pack_push_requests
from scalerl_jax.generation.fake import random_completion
from scalerl_jax.types import PromptSpec
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher

TOKEN = "rpc-test-token"


def _server(port=0, **kw):
  prompts = [PromptSpec(i, np.array([1, 2, i], np.int32), "a") for i in range(6)]
  args = dict(prompts_per_step=2, group_size=4, max_lag=1)
  args.update(kw)
  return BufferServer(prompts, token=TOKEN, port=port, **args).start()


def _rollouts(a, n=None, tag=""):
  rng = np.random.default_rng(a.group_id)
  return [codec.completion_to_rollout(random_completion(rng, a.prompt_id, 8, a.min_version),
                                      group_id=a.group_id, sample_index=i,
                                      prompt_tokens=assignment_prompt(a).tokens,
                                      generator_id="g", rollout_id=f"{a.group_id}-{i}{tag}")
          for i in range(a.group_size if n is None else n)]


def test_weights_publish_fetch_watch_and_checksum():
  srv = _server()
  c = BufferClient(srv.address, TOKEN)
  try:
    assert c.fetch_version(-1, wait_timeout_s=0) is None          # nothing published yet
    watch = c.watch_versions(-1)
    params = {"w": np.random.default_rng(0).standard_normal((9, 1 << 18)).astype(np.float32)}
    pub = StreamPublisher(c, 1, params, chunk_bytes=1 << 20, process_index=0)   # 9 MiB, 1 MiB chunks
    ack = pub.publish()
    assert ack.visible and (ack.version, ack.total_bytes) == (1, params["w"].nbytes)
    got = StreamFetcher(c).fetch(0, wait_timeout_s=5)
    assert got is not None and got.version == 1 and np.array_equal(got.params["w"], params["w"])
    notice = next(watch)
    assert notice.version == 1 and notice.sha256 == pub.sha256
    assert pub.publish().version == 1                              # idempotent re-publish
    # a corrupted chunk never becomes visible
    v2 = StreamPublisher(c, 2, tiny_params(), process_index=0)
    good = ws.parse_weight_message(v2.encode(0))
    assert not isinstance(good, ws.Malformed)
    bad = ws.encode_chunk(2, 0, good.data, good.head.crc32 ^ 1)
    with pytest.raises(grpc.RpcError) as e:
      c.publish_raw(iter([next(v2.messages([])), bad]))
    assert e.value.code() == grpc.StatusCode.DATA_LOSS
    # a one-payload blob (no manifest: the removed protocol) is refused
    blob = pb.WeightChunk(version=2, total_bytes=3, sha256="0" * 64, data=b"abc")
    with pytest.raises(grpc.RpcError) as e:
      c._publish(iter([blob]), metadata=c._md)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "manifest" in e.value.details()
    assert c.status().contents.current_version == 1
    assert c.fetch_version(1, wait_timeout_s=0) is None
    # long-poll: a fetch waiting for version > 1 returns when version 2 lands
    out = {}
    t = threading.Thread(target=lambda: out.update(r=c.fetch_version(1, wait_timeout_s=10)))
    t.start()
    time.sleep(0.3)
    assert v2.publish().visible
    t.join()
    assert out["r"] == 2 and next(watch).version == 2
    watch.cancel()
  finally:
    c.close()
    srv.stop()


def test_disconnect_mid_stream_keeps_acknowledged():
  srv = _server()
  c = BufferClient(srv.address, TOKEN)
  try:
    (a,) = c.lease("g", 1, 1)
    rs = [r.SerializeToString() for r in _rollouts(a)]
    gate = threading.Event()

    def requests():                     # two requests, then hang until cancelled
      yield from pack_push_requests(rs[:1], 1)
      yield from pack_push_requests(rs[1:2], 1)
      gate.wait(10)

    call = c.push_stream(requests())
    acked = [next(call).acks[0].rollout_id for _ in range(2)]
    call.cancel()                       # the generator "disconnects"
    gate.set()
    time.sleep(0.2)
    st = c.status().contents
    assert acked == ["1-0", "1-1"] and st.stored_rollouts == 2
    acks = c.push(rs)                   # reconnect and re-send everything: stored once
    assert [x.duplicate for x in acks] == [True, True, False, False]
    assert acks[-1].group_complete and c.status().contents.stored_rollouts == 4
  finally:
    c.close()
    srv.stop()


def test_client_retries_until_server_is_up():
  port = free_port()
  c = BufferClient(f"127.0.0.1:{port}", TOKEN, retries=8, backoff_s=0.1)
  box = {}
  t = threading.Thread(target=lambda: box.update(st=c.status()))
  t.start()
  time.sleep(0.5)                       # first attempts hit UNAVAILABLE
  srv = _server(port=port)
  try:
    t.join(20)
    assert box["st"].contents.prompts == 6
  finally:
    c.close()
    srv.stop()
  with pytest.raises(grpc.RpcError) as e:   # no server at all: UNAVAILABLE after the retries
    BufferClient(f"127.0.0.1:{port}", TOKEN, retries=1, backoff_s=0.01).status()
  assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_pull_blocks_then_delivers_and_lease_waits_for_admission():
  srv = _server(max_lag=0)
  c = BufferClient(srv.address, TOKEN)
  try:
    got = c.lease("g", 10, 1)
    assert len(got) == 2                                   # k=0: exactly one step of work
    # heartbeats over the wire: a listed group only, or (no list) every group of "g"
    assert c.heartbeat("g", 0, group_ids=[got[0].group_id]).leases_extended == 1
    assert c.heartbeat("g", 0, group_ids=[]).leases_extended == 0
    assert c.heartbeat("g", 0).leases_extended == 2
    t0 = time.time()
    assert c.lease("g", 1, 0.4) == []                      # waits for admission, then gives up
    assert time.time() - t0 >= 0.35
    box = {}
    t = threading.Thread(target=lambda: box.update(b=c.pull_batch(0, timeout_s=10)))
    t.start()
    time.sleep(0.2)
    assert t.is_alive()                                    # the learner blocks for full groups
    c.push([r for a in got for r in _rollouts(a)])
    t.join(10)
    b = box["b"]
    assert len(b.groups) == 2 and all(len(g.rollouts) == 4 for g in b.groups)
    assert list(b.summary.lag.counts) == [2 * 4 * 8]
    with pytest.raises(grpc.RpcError) as e:
      c.pull_batch(1, timeout_s=0.2)                       # k steps ahead: wait, then time out
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
  finally:
    c.close()
    srv.stop()


def test_generated_stubs_are_current_and_work(tmp_path):
  from scalerl_jax.protocol import rollout_pb2_grpc
  here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "scalerl_jax", "protocol")
  subprocess.run(["bash", os.path.join(here, "gen_proto.sh")], check=True, capture_output=True,
                 env=dict(os.environ, OUT_DIR=str(tmp_path), PY=sys.executable))
  for name in ("rollout_pb2.py", "rollout_pb2.pyi", "rollout_pb2_grpc.py"):
    with open(os.path.join(here, name)) as a, open(tmp_path / name) as b:
      assert a.read() == b.read(), f"{name} is stale: run scalerl_jax/protocol/gen_proto.sh"
  srv = _server()
  try:
    with grpc.insecure_channel(srv.address) as ch:
      stub = rollout_pb2_grpc.RolloutBufferStub(ch)
      st = stub.GetStatus(pb.StatusRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),))
      assert st.group_size == 4 and st.mode == "pipeline"
  finally:
    srv.stop()


def test_buffer_server_does_not_import_jax():
  code = ("import sys, scalerl_jax.buffer.server, scalerl_jax.protocol.client; "
          "print(sorted(m for m in ('jax', 'jaxlib', 'flax', 'torch') if m in sys.modules))")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=root)).stdout.strip()
  assert out == "[]"


def test_cli_requires_token(tmp_path):
  p = tmp_path / "p.jsonl"
  p.write_text('{"prompt_id": 1, "tokens": [1, 2]}\n')
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env = {k: v for k, v in os.environ.items() if k != "NO_SUCH_TOKEN_VAR"}
  r = subprocess.run([sys.executable, "-m", "scalerl_jax.buffer.server", "--prompts", str(p),
                      "--token-env", "NO_SUCH_TOKEN_VAR"], capture_output=True, text=True,
                     env=dict(env, PYTHONPATH=root), timeout=60)
  assert r.returncode != 0 and "NO_SUCH_TOKEN_VAR" in r.stderr


def test_from_config_uses_rollout_and_buffer_sections():
  from scalerl_jax import config as common
  cfg = common.base_config()
  cfg.rollout.prompts_per_step, cfg.rollout.generations_per_prompt, cfg.rollout.max_lag = 3, 2, 5
  prompts = [PromptSpec(i, np.array([i], np.int32)) for i in range(4)]
  run = common.RunConfig.from_config(cfg)
  srv = BufferServer.from_sections(run.rollout, run.buffer, run.tls, prompts, token=TOKEN).start()
  try:
    st = BufferClient(srv.address, TOKEN).status()
    assert (st.prompts_per_step, st.group_size, st.max_lag, st.mode) == (3, 2, 5, "pipeline")
    assert st.admission_capacity == (0 + 5 - 0 + 1) * 3
  finally:
    srv.stop()


def test_waiting_pull_and_lease_end_when_the_caller_goes_or_the_server_stops(tmp_path):
  """A PullBatch / LeasePrompts waiting for its batch / admission ends as soon as its caller is gone
  (CANCELLED, the state untouched), and a buffer process told to stop (SIGTERM, what PDEATHSIG
  sends when the learner dies) exits at once instead of holding a handler thread for the rest of a
  600 s pull timeout."""
  from scalerl_jax.buffer import state as admission
  from scalerl_jax.protocol import validation as val
  st = admission.BufferState([PromptSpec(0, np.array([1, 2], np.int32), "a")], prompts_per_step=1,
                             group_size=2, max_lag=0)
  st.lease("g", 1, 0.0)                        # k=0: nothing more is admitted until step 1
  t0 = time.time()
  for call in (lambda: st.pull(0, 600.0, alive=lambda: False),
               lambda: st.lease("g2", 1, 600.0, alive=lambda: False)):
    with pytest.raises(val.RejectError) as e:
      call()
    assert e.value.code == grpc.StatusCode.CANCELLED
  assert time.time() - t0 < 1.0 and st.ns == 0

  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text('{"prompt_id": 0, "tokens": [1, 2], "answer": "x"}\n')
  env = dict(os.environ, SCALERL_BUFFER_TOKEN=TOKEN)
  srv = subprocess.Popen([sys.executable, "-m", "scalerl_jax.buffer.server", "--port", "0",
                          "--prompts", str(prompts), *buffer_knobs(1, 2, 0)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
  try:
    import json
    address = json.loads(srv.stdout.readline())["address"]
    c = BufferClient(address, TOKEN, retries=0)     # no reconnect attempts once it is gone
    errors = []
    def pull():
      try:
        c.pull_batch(0, timeout_s=600)
      except grpc.RpcError as e:
        errors.append(e.code())
    t = threading.Thread(target=pull, daemon=True)
    t.start()
    time.sleep(1.0)                              # the pull is waiting inside the server
    t0 = time.time()
    srv.terminate()
    assert srv.wait(timeout=30) is not None
    assert time.time() - t0 < 10, "the buffer process lingered after SIGTERM"
    t.join(30)
    assert errors and errors[0] != grpc.StatusCode.DEADLINE_EXCEEDED
    c.close()
  finally:
    if srv.poll() is None:
      srv.kill()
