"""Fuzz the live buffer (a `python -m scalerl_jax.buffer.server` process on 127.0.0.1) with
malformed, oversize, wrong-type, NaN, future-version and unauthenticated requests.

Every request must get its expected status code, the server must not crash (no handler exception,
process alive, still serving), and the buffer contents (digest over everything stored) must not
change. Random cases come from a fixed seed; a table adds targeted ones and raw garbage bytes sent
through a generic channel call. The whole fuzz runs twice: plaintext and over TLS (the server with a
certificate from tests/tls_certs.py, every client verifying it with the CA)."""
import hashlib
import json
import math
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest

from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.protocol.client import BufferClient, assignment_prompt, pack_push_requests
from scalerl_jax.generation.fake import random_completion
from scalerl_jax.protocol.rpc import TLS, open_channel
from scalerl_jax.weights.stream import StreamPublisher
from helpers import buffer_knobs, publish_params, tiny_params
import tls_certs

TOKEN = "fuzz-secret-0123456789"
SVC = "/scalerl.rollout.v1.RolloutBuffer/"
MAX_MSG = 1 << 20
MAX_TOKENS = 64
IA, RE, UA = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.UNAUTHENTICATED)
FP, DL = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS
KINDS = {"LeasePrompts": "uu", "PushRollouts": "ss", "PullBatch": "us", "PublishWeights": "su",
         "FetchWeights": "us", "WatchVersion": "us", "GetStatus": "uu", "Heartbeat": "uu",
         "SubmitEval": "uu", "PushEvalResults": "uu", "CollectEval": "uu"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", params=["plaintext", "tls"])
def server(tmp_path_factory, request):
  d = tmp_path_factory.mktemp("fuzz")
  tls = TLS()
  if request.param == "tls":
    certs = tls_certs.make_certs(str(d / "certs"))
    tls = TLS(cert=certs["cert"], key=certs["key"], ca=certs["ca"])
  prompts = d / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_id": 7 + i, "tokens": [1, 2, 3 + i],
                                         "answer": "4"}) + "\n" for i in range(4)))
  env = dict(os.environ, FUZZ_TOKEN=TOKEN, PYTHONPATH=ROOT)
  # its log (a line per refused message) to a file: an unread pipe blocks
  with open(d / "server.err", "w") as err:
    proc = subprocess.Popen(
        [sys.executable, "-m", "scalerl_jax.buffer.server", "--port", "0", "--prompts", str(prompts),
         *buffer_knobs(2, 2, 1, max_completion_tokens=MAX_TOKENS, buffer__auth_token_env="FUZZ_TOKEN",
                       buffer__max_message_bytes=MAX_MSG)] + tls.argv(), stdout=subprocess.PIPE, stderr=err, env=env, text=True)
  line = proc.stdout.readline()
  assert line, (d / "server.err").read_text()
  port = json.loads(line)["port"]
  yield proc, f"127.0.0.1:{port}", tls, d / "server.err"
  proc.terminate()
  proc.wait(timeout=10)


def _call(ch, method, payload, md=(("authorization", f"Bearer {TOKEN}"),)):
  """Sends raw bytes (or a list of raw messages for client-streaming) and returns the status code."""
  kind = KINDS.get(method, "uu")
  ident = lambda b: b
  path = SVC + method
  try:
    if kind == "uu":
      ch.unary_unary(path, ident, ident)(payload, metadata=md, timeout=20)
    elif kind == "us":
      list(ch.unary_stream(path, ident, ident)(payload, metadata=md, timeout=20))
    elif kind == "su":
      ch.stream_unary(path, ident, ident)(iter(payload), metadata=md, timeout=20)
    else:
      list(ch.stream_stream(path, ident, ident)(iter(payload), metadata=md, timeout=20))
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


def _valid_rollout(a, sample, rid, n=6, version=0):
  rng = np.random.default_rng(sample)
  c = random_completion(rng, a.prompt_id, n, version)
  return codec.completion_to_rollout(c, group_id=a.group_id, sample_index=sample,
                                     prompt_tokens=assignment_prompt(a).tokens,
                                     generator_id="fuzz-gen", rollout_id=rid)



# Each mutation makes a valid rollout invalid in one specific way.
def _mutations(a):
  i32 = lambda x: np.asarray(x, np.int32).tobytes()

  def lp(vals):
    def m(r):
      d = r.logprobs.data
      arr = np.frombuffer(d[: len(d) // 4 * 4], np.float32).copy()
      if arr.size == 0:
        arr = np.zeros(1, np.float32)
      arr[: len(vals)] = vals
      r.logprobs.data = arr.tobytes()
    return m

  def ver(v):
    def m(r):
      d = r.versions.data
      arr = np.frombuffer(d[: len(d) // 4 * 4], np.int32).copy()
      if arr.size == 0:
        arr = np.zeros(1, np.int32)
      arr[-1] = v
      r.versions.data = arr.tobytes()
    return m

  def reward(x):
    def m(r):
      if r.rewards:
        r.rewards[0] = x
      else:
        r.rewards.append(x)
    return m

  return {
      "nan_logprob": lp([np.nan]), "inf_logprob": lp([np.inf]), "neg_inf_logprob": lp([-np.inf]),
      "positive_logprob": lp([0.5]), "future_version": ver(10 ** 6), "version_plus_one": ver(1),
      "negative_version": ver(-1),
      "logprobs_short": lambda r: r.logprobs.CopyFrom(codec.encode(np.zeros(2), pb.FLOAT32)),
      "versions_long": lambda r: r.versions.CopyFrom(codec.encode(np.zeros(9), pb.INT32)),
      "mask_short": lambda r: r.policy_mask.CopyFrom(codec.encode(np.ones(3), pb.BITS)),
      "bytes_vs_length": lambda r: setattr(r.logprobs, "data", r.logprobs.data[:-1]),
      "length_field_lies": lambda r: setattr(r.completion_tokens, "length", 5),
      "tokens_wrong_dtype": lambda r: setattr(r.completion_tokens, "dtype", pb.FLOAT32),
      "logprobs_wrong_dtype": lambda r: setattr(r.logprobs, "dtype", pb.INT32),
      "unknown_dtype": lambda r: setattr(r.versions, "dtype", 77),
      "empty_completion": lambda r: [t.CopyFrom(codec.encode(np.zeros(0), d)) for t, d in (
          (r.completion_tokens, pb.INT32), (r.logprobs, pb.FLOAT32), (r.versions, pb.INT32),
          (r.policy_mask, pb.BITS))],
      "too_many_tokens": lambda r: [t.CopyFrom(codec.encode(np.zeros(MAX_TOKENS + 1), d)) for t, d
                                    in ((r.completion_tokens, pb.INT32), (r.logprobs, pb.FLOAT32),
                                        (r.versions, pb.INT32), (r.policy_mask, pb.BITS))],
      "negative_token": lambda r: setattr(r.completion_tokens, "data", i32([-5] * 6)),
      "unknown_group": lambda r: setattr(r, "group_id", 10 ** 9),
      "zero_group": lambda r: setattr(r, "group_id", 0),
      "wrong_prompt_id": lambda r: setattr(r, "prompt_id", a.prompt_id + 1000),
      "prompt_tokens_differ": lambda r: r.prompt_tokens.CopyFrom(codec.encode([9, 9], pb.INT32)),
      "sample_out_of_range": lambda r: setattr(r, "sample_index", 2),
      "finish_unspecified": lambda r: setattr(r, "finish_reason", 0),
      "finish_unknown": lambda r: setattr(r, "finish_reason", 9),
      "no_rewards": lambda r: r.ClearField("rewards"),
      "nan_reward": reward(math.nan), "inf_reward": reward(math.inf),
      "reward_out_of_range": reward(5.0),
      "too_many_rewards": lambda r: r.rewards.extend([0.0] * 20),
      "empty_rollout_id": lambda r: setattr(r, "rollout_id", ""),
      "long_rollout_id": lambda r: setattr(r, "rollout_id", "x" * 1000),
      "nonprintable_id": lambda r: setattr(r, "rollout_id", "bad\x00id"),
      "empty_generator_id": lambda r: setattr(r, "generator_id", ""),
      "nan_timing": lambda r: setattr(r.timing, "start_unix_s", math.nan),
      "refill_sample0": lambda r: setattr(r, "sample_index", 0),   # slot 0 is already stored
  }


def test_fuzz_live_server(server):
  proc, address, tls, err_log = server
  c = BufferClient(address, TOKEN, tls=tls)
  publish_params(c, 0)
  (a,) = c.lease("fuzz-gen", 1, 5)
  assert c.push([_valid_rollout(a, 0, "stored-0")])[0].rollout_id == "stored-0"
  before = c.status().contents
  ch = open_channel(address, tls, [("grpc.max_send_message_length", 64 << 20)])
  cases = []                                        # (name, method, payload, metadata|None, codes)

  # -- unauthenticated: every method, missing / wrong / malformed bearer
  for m in KINDS:
    payload = [b""] if KINDS[m][0] == "s" else b""
    for md_name, md in (("none", ()), ("wrong", (("authorization", "Bearer nope"),)),
                        ("no_bearer", (("authorization", TOKEN),)),
                        ("prefix", (("authorization", f"Bearer {TOKEN[:-1]}"),))):
      cases.append((f"unauth_{md_name}_{m}", m, payload, md, {UA}))
  # valid-looking rollout but no token: must not be stored
  good1 = _valid_rollout(a, 1, "would-be-stored")
  cases.append(("unauth_valid_push", "PushRollouts", list(pack_push_requests(
      [good1.SerializeToString()])), (), {UA}))

  rng_eval = np.random.default_rng(4321)
  # -- targeted rollout mutations
  muts = _mutations(a)
  for name, mut in muts.items():
    r = _valid_rollout(a, 1, f"t-{name}")
    mut(r)
    cases.append((f"rollout_{name}", "PushRollouts",
                  list(pack_push_requests([r.SerializeToString()])), None, {IA}))
  # all-or-nothing: a valid rollout followed by a bad one in the same PushRequest
  bad = _valid_rollout(a, 1, "aon-bad")
  muts["nan_logprob"](bad)
  cases.append(("all_or_nothing", "PushRollouts", list(pack_push_requests(
      [good1.SerializeToString(), bad.SerializeToString()])), None, {IA}))

  # -- size limits
  big = _valid_rollout(a, 1, "huge", n=(MAX_MSG // 8))
  cases.append(("oversize_push", "PushRollouts", [big.SerializeToString()], None, {RE}))
  cases.append(("oversize_lease", "LeasePrompts",
                pb.LeaseRequest(generator_id="g" * (MAX_MSG + 10), max_groups=1)
                .SerializeToString(), None, {RE}))

  # -- other RPCs with bad fields
  L = lambda **kw: pb.LeaseRequest(**kw).SerializeToString()
  for name, req in (("lease_zero", L(generator_id="g", max_groups=0)),
                    ("lease_huge", L(generator_id="g", max_groups=10 ** 9)),
                    ("lease_no_id", L(max_groups=1)),
                    ("lease_nan_wait", L(generator_id="g", max_groups=1, wait_timeout_s=math.nan)),
                    ("lease_neg_wait", L(generator_id="g", max_groups=1, wait_timeout_s=-1)),
                    ("lease_inf_wait", L(generator_id="g", max_groups=1, wait_timeout_s=math.inf))):
    cases.append((name, "LeasePrompts", req, None, {IA}))
  P = lambda **kw: pb.PullRequest(**kw).SerializeToString()
  cases += [("pull_future_step", "PullBatch", P(step=5), None, {FP}),
            ("pull_negative_step", "PullBatch", P(step=-3), None, {FP}),
            ("pull_nan_timeout", "PullBatch", P(step=0, timeout_s=math.nan), None, {IA}),
            ("pull_bad_learner_id", "PullBatch", P(step=0, learner_id="\x01"), None, {IA}),
            ("pull_not_ready", "PullBatch", P(step=0, timeout_s=0), None,
             {grpc.StatusCode.DEADLINE_EXCEEDED})]
  # Weights: version 1's manifest and chunks (streamed, the one protocol), broken one way each.
  v1 = StreamPublisher(c, 1, tiny_params(2), process_index=0)
  first, c0 = next(v1.messages([])), ws.parse_weight_message(v1.encode(0))
  assert not isinstance(c0, ws.Malformed)
  head = pb.WeightChunk.FromString(first)
  M = lambda **kw: pb.WeightChunk(**{**dict(version=1, total_bytes=head.total_bytes,
                                            sha256=head.sha256, format=head.format,
                                            manifest=head.manifest), **kw}).SerializeToString()
  C = lambda data=c0.data, **kw: ws.with_data(pb.WeightChunk(**{**dict(
      version=1, chunk_index=0, crc32=c0.head.crc32), **kw}).SerializeToString(), data)
  blob = pb.WeightChunk(version=1, total_bytes=3, sha256="0" * 64, data=b"abc").SerializeToString()
  cases += [("weights_bad_crc", "PublishWeights", [first, C(crc32=c0.head.crc32 ^ 1)], None, {DL}),
            ("weights_nonhex_sha", "PublishWeights", [M(sha256="z" * 64)], None, {IA}),
            ("weights_manifest_sha", "PublishWeights", [M(sha256="0" * 64)], None, {IA}),
            ("weights_bad_manifest", "PublishWeights", [M(manifest="{}", sha256=hashlib.sha256(b"{}").hexdigest())], None, {IA}),
            ("weights_not_newer", "PublishWeights", [M(version=0)], None, {FP}),
            ("weights_negative_version", "PublishWeights", [M(version=-2)], None, {IA}),
            ("weights_blob_no_manifest", "PublishWeights", [blob], None, {IA}),
            ("weights_chunk_index", "PublishWeights", [first, C(chunk_index=99)], None, {IA}),
            ("weights_chunk_size", "PublishWeights", [first, C(data=c0.data[:4])], None, {IA}),
            ("weights_chunk_other_version", "PublishWeights", [first, C(version=2)], None, {IA}),
            ("weights_second_manifest", "PublishWeights", [first, first], None, {IA}),
            ("weights_too_big", "PublishWeights", [M(total_bytes=1 << 62)], None, {RE}),
            ("weights_empty_stream", "PublishWeights", [], None, {IA}),
            ("fetch_nan_wait", "FetchWeights",
             pb.FetchWeightsRequest(wait_timeout_s=math.nan).SerializeToString(), None, {IA}),
            ("fetch_not_streamed", "FetchWeights",
             pb.FetchWeightsRequest(have_version=-1).SerializeToString(), None, {FP}),
            ("heartbeat_no_id", "Heartbeat", pb.HeartbeatRequest().SerializeToString(), None, {IA}),
            ("unknown_method", "NoSuchMethod", b"", None, {grpc.StatusCode.UNIMPLEMENTED})]
  # -- the evaluation lane (issue 15): bad requests, results for unknown evaluations, garbage
  def E(**kw):
    base = dict(eval_id=1, version=0, samples_per_prompt=2, temperature=1.0, top_p=1.0,
                prompts=[pb.EvalPrompt(prompt_id=7, prompt_tokens=codec.encode([1, 2], pb.INT32))])
    return pb.EvalRequest(**{**base, **kw}).SerializeToString()
  NF = grpc.StatusCode.NOT_FOUND
  cases += [("eval_zero_id", "SubmitEval", E(eval_id=0), None, {IA}),
            ("eval_zero_samples", "SubmitEval", E(samples_per_prompt=0), None, {IA}),
            ("eval_future_version", "SubmitEval", E(version=99), None, {FP}),
            ("eval_no_prompts", "SubmitEval", E(prompts=[]), None, {IA}),
            ("eval_nan_temperature", "SubmitEval", E(temperature=math.nan), None, {IA}),
            ("eval_top_p_zero", "SubmitEval", E(top_p=0.0), None, {IA}),
            ("eval_bad_tensor", "SubmitEval", E(prompts=[pb.EvalPrompt(
                prompt_id=7, prompt_tokens=pb.Tensor(dtype=pb.FLOAT32, length=1, data=b"abcd"))]),
             None, {IA}),
            ("eval_short_tensor", "SubmitEval", E(prompts=[pb.EvalPrompt(
                prompt_id=7, prompt_tokens=pb.Tensor(dtype=pb.INT32, length=3, data=b"abcd"))]),
             None, {IA}),
            ("eval_results_unknown", "PushEvalResults", pb.EvalPushRequest(results=[
                pb.EvalGroupResult(eval_id=77, group_id=0, prompt_id=7, rewards=[1.0, 0.0],
                                   lengths=[1, 1], finish_reasons=[1, 1], generator_id="g")])
             .SerializeToString(), None, {FP}),
            ("eval_collect_unknown", "CollectEval",
             pb.EvalCollectRequest(eval_id=77).SerializeToString(), None, {NF}),
            ("eval_collect_nan", "CollectEval",
             pb.EvalCollectRequest(eval_id=77, timeout_s=math.nan).SerializeToString(), None,
             {IA})]
  for i in range(12):
    junk = rng_eval.integers(0, 256, int(rng_eval.integers(1, 200)), dtype=np.uint8).tobytes()
    m = ("SubmitEval", "PushEvalResults", "CollectEval")[i % 3]
    # junk that happens to parse is refused by validation, or names no open evaluation
    cases.append((f"garbage_{m}_{i}", m, junk, None, {IA, FP, NF}))
  # wrong message types on the wire
  cases += [("wrong_type_lease_as_push", "PushRollouts",
             [pb.LeaseRequest(generator_id="gen", max_groups=3).SerializeToString()], None, {IA}),
            ("wrong_type_status_as_push", "PushRollouts", [before.SerializeToString()], None, {IA}),
            ("wrong_type_rollout_as_lease", "LeasePrompts", good1.SerializeToString(), None, {IA}),
            ("wrong_type_unwrapped_rollout", "PushRollouts", [good1.SerializeToString()], None,
             {IA}),
            ("empty_push_request", "PushRollouts", [b""], None, {IA})]

  # -- raw garbage bytes through a generic channel call (fixed seed)
  rng = np.random.default_rng(1234)
  for i in range(60):
    junk = rng.integers(0, 256, int(rng.integers(1, 400)), dtype=np.uint8).tobytes()
    m = ("PushRollouts", "LeasePrompts")[i % 2]
    cases.append((f"garbage_{m}_{i}", m, [junk] if m == "PushRollouts" else junk, None, {IA}))

  # -- random multi-mutations of valid rollouts (fixed seed)
  names = sorted(muts)
  for i in range(150):
    r = _valid_rollout(a, 1, f"rand-{i}", n=int(rng.integers(1, MAX_TOKENS)))
    chosen = rng.choice(names, size=int(rng.integers(1, 4)), replace=False)
    for n in chosen:
      muts[n](r)
    cases.append((f"random_{i}_{'+'.join(chosen)}", "PushRollouts",
                  list(pack_push_requests([r.SerializeToString()])), None, {IA}))

  failures, counts = [], {}
  for name, method, payload, md, want in cases:
    got, details = (_call(ch, method, payload) if md is None else _call(ch, method, payload, md))
    counts[got.name] = counts.get(got.name, 0) + 1
    if got not in want:
      failures.append(f"{name}: got {got.name} ({details}), want {[w.name for w in want]}")
    if got == IA:
      assert details, f"{name}: INVALID_ARGUMENT without a message"
  after = c.status()
  print(f"\nfuzz: {len(cases)} requests, status codes {counts}")
  assert len(cases) >= 200
  assert not failures, "\n".join(failures[:20])
  assert after.contents == before, "buffer contents changed"
  assert proc.poll() is None, "server process died"
  c.close()
  ch.close()
  proc.terminate()
  proc.wait(timeout=10)
  err = err_log.read_text()
  assert "Traceback" not in err and "Exception calling application" not in err, err[-3000:]
