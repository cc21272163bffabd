"""TLS on the run's gRPC channels (config.tls, protocol/rpc.py TLS; docs/ROLLOUT.md "TLS").

Certificates are generated per test session (tests/tls_certs.py). In-process servers: a client with
the CA works; a client without the CA (system roots), with another CA, or in plaintext is refused
with UNAVAILABLE; the bearer token is still checked over TLS; `server_name` pins the name checked in
the certificate; mTLS refuses a client without a certificate; the learner weight source serves over
TLS like the buffer. End to end: a tiny `python -m scalerl_jax.main` run with --config.tls.* (the
buffer process, the learner's weight source and the generator all over TLS), probed while it runs
by a plaintext and a CA-less client (both refused), at generator temperature 0.7: the first,
on-policy step has IS ratios of 1 and KL(gen‖learner) ~ 0 (docs/LEARNER.md)."""
import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from helpers import free_port
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.protocol.rpc import TLS
from scalerl_jax.types import PromptSpec
from scalerl_jax.weights import bulk as wb
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import StreamFetcher, StreamPublisher
import tls_certs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "tls-secret-0123456789"
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("tls")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
  return tls_certs.make_certs(str(tmp_path_factory.mktemp("certs")))


def _server(tls, **kw):
  return BufferServer([PromptSpec(0, np.array([1, 2], np.int32))], token=TOKEN, prompts_per_step=1,
                      group_size=2, max_lag=0, tls=tls, **kw).start()


def _code(address, tls, token=TOKEN):
  """GetStatus through a fresh client with no retries: OK or the refusal's status code."""
  c = BufferClient(address, token, retries=0, tls=tls)
  try:
    c.status()
    return grpc.StatusCode.OK
  except grpc.RpcError as e:
    return e.code()
  finally:
    c.close()


def test_tls_buffer_verifies_and_refuses(certs):
  srv = _server(TLS(cert=certs["cert"], key=certs["key"]))
  try:
    a = srv.address
    assert _code(a, TLS(ca=certs["ca"])) == grpc.StatusCode.OK
    assert _code(a, None) == UNAVAILABLE                            # plaintext client
    assert _code(a, TLS(ca=certs["other_ca"])) == UNAVAILABLE       # another CA
    assert _code(a, TLS(cert=certs["cert"], key=certs["key"])) == UNAVAILABLE   # no CA: system roots
    assert _code(a, TLS(ca=certs["ca"]), token="wrong") == grpc.StatusCode.UNAUTHENTICATED
    # the certificate is checked against server_name instead of the dialed host
    assert _code(a, TLS(ca=certs["ca"], server_name=tls_certs.SERVER_NAME)) == grpc.StatusCode.OK
    assert _code(a, TLS(ca=certs["ca"], server_name="not-in.the.cert")) == UNAVAILABLE
  finally:
    srv.stop(0)
  plain = _server(None)
  try:                                                              # a TLS client, plaintext server
    assert _code(plain.address, TLS(ca=certs["ca"])) == UNAVAILABLE
  finally:
    plain.stop(0)


def test_mutual_tls_requires_a_client_certificate(certs):
  mtls = TLS(cert=certs["cert"], key=certs["key"], ca=certs["ca"], mutual=True)
  srv = _server(mtls)
  try:
    assert _code(srv.address, mtls) == grpc.StatusCode.OK
    assert _code(srv.address, TLS(ca=certs["ca"])) == UNAVAILABLE   # verifies the server, no cert
  finally:
    srv.stop(0)


def test_learner_weight_source_over_tls(certs):
  """The remote-manifest path: announce through the buffer, chunks from the learner's source, both
  over TLS (the fetcher's peer client inherits the TLS settings)."""
  tls = TLS(cert=certs["cert"], key=certs["key"], ca=certs["ca"])
  srv = _server(tls)
  src = WeightSource(TOKEN, tls=tls)
  try:
    params = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64), "b": np.ones(3, np.float32)}
    c = BufferClient(srv.address, TOKEN, tls=TLS(ca=certs["ca"]))
    StreamPublisher(c, 0, params, chunk_bytes=4096, process_index=0, source=src).publish()
    version, got = StreamFetcher(BufferClient(srv.address, TOKEN, tls=TLS(ca=certs["ca"]))).fetch(-1, 10)
    assert version == 0 and all(np.array_equal(got[k], params[k]) for k in params)
    assert src.served_chunks > 1
    assert _code(src.address, None) == UNAVAILABLE                  # the source refuses plaintext
  finally:
    src.stop()
    srv.stop(0)


def test_bulk_weight_channel_over_tls_refuses_plaintext(certs):
  """The bulk weight channel (weights/bulk.py) of a TLS source is TLS too: the fetch goes over it
  (exact), a plaintext bulk client is refused (no chunk served), a TLS client with a wrong token
  gets UNAUTHENTICATED."""
  tls = TLS(cert=certs["cert"], key=certs["key"], ca=certs["ca"])
  srv = _server(tls)
  src = WeightSource(TOKEN, tls=tls)
  try:
    params = {"w": np.arange(4096, dtype=np.float32).reshape(64, 64)}
    c = BufferClient(srv.address, TOKEN, tls=TLS(ca=certs["ca"]))
    StreamPublisher(c, 0, params, chunk_bytes=4096, process_index=0, source=src).publish()
    f = StreamFetcher(c)
    version, got = f.fetch(-1, 10)
    assert version == 0 and np.array_equal(got["w"], params["w"]) and f.bulk_streams == 1
    served = src.served_chunks
    assert f.local_streams == 1 and src.ring_streams == 0       # TLS on the local socket, no ring
    req = pb.FetchWeightsRequest(resume_version=0, streamed=True, wait_timeout_s=1)
    for address in (src.bulk_address, wb.split_address(src.bulk_address)[0]):  # local, TCP
      plain = wb.connect(address, TOKEN, req)                   # no TLS: the handshake fails
      with pytest.raises(OSError):
        list(wb.messages(plain, lambda h, n: None, 1 << 20))
      plain.close()
      bad = wb.connect(address, "wrong", req, tls=TLS(ca=certs["ca"]))
      with pytest.raises(wb.BulkError, match="UNAUTHENTICATED"):
        list(wb.messages(bad, lambda h, n: None, 1 << 20))
      bad.close()
    assert src.served_chunks == served
  finally:
    src.stop()
    srv.stop(0)


def test_config_validation_of_tls(certs, tmp_path):
  from configs import tiny
  from scalerl_jax import recipes
  c = tiny.get_config()
  c.tls.cert = certs["cert"]
  with pytest.raises(recipes.ConfigError, match="tls.cert and tls.key go together"):
    recipes.validate(c)
  c.tls.key, c.tls.ca = certs["key"], str(tmp_path / "missing.pem")
  with pytest.raises(recipes.ConfigError, match="missing.pem' cannot be read"):
    recipes.validate(c)
  c.tls.ca = certs["ca"]
  recipes.validate(c)


def test_tiny_run_over_tls_at_temperature_07(certs, tmp_path):
  port = free_port()
  address = f"127.0.0.1:{port}"
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.total_steps=2", "--config.sft.clean_steps=20",
         "--config.sft.steps=10", "--config.eval.every_steps=100",
         "--config.eval.samples_per_prompt=1", "--config.data.heldout=8",
         "--config.rollout.max_lag=0", "--config.generator.temperature=0.7",
         f"--config.buffer.address={address}", f"--config.tls.cert={certs['cert']}",
         f"--config.tls.key={certs['key']}", f"--config.tls.ca={certs['ca']}"]
  log = open(tmp_path / "run.log", "w")
  p = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT,
                                           "SCALERL_BUFFER_TOKEN": TOKEN},
                       stdout=log, stderr=subprocess.STDOUT)
  try:
    seen = None          # the run's own buffer process, probed while the run uses it
    while p.poll() is None and seen is None:
      if _code(address, TLS(ca=certs["ca"])) == grpc.StatusCode.OK:
        seen = dict(plaintext=_code(address, None), no_ca=_code(address, TLS()),
                    other_ca=_code(address, TLS(ca=certs["other_ca"])))
      else:
        time.sleep(0.2)
    assert p.wait(timeout=900) == 0, open(tmp_path / "run.log").read()[-4000:]
  finally:
    if p.poll() is None:
      p.kill()
  assert seen == dict(plaintext=UNAVAILABLE, no_ca=UNAVAILABLE, other_ca=UNAVAILABLE), seen
  train = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [l for l in train if l["kind"] == "train"]
  assert [l["step"] for l in train] == [1, 2]
  first = train[0]
  print(f"\n[TLS run, T=0.7] step 1: IS ratio mean {first['is_ratio_mean']:.7f} max "
        f"{first['is_ratio_max']:.7f} kl_k3 {first['kl_k3']:.2e}; probes {seen}")
  assert first["max_lag"] == 0
  assert abs(first["is_ratio_mean"] - 1.0) < 1e-3 and first["kl_k3"] < 1e-6
