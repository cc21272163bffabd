"""Weight pushes travel in `weights.wire_dtype` (bf16 by default): the bytes on the wire of the
trainer's publisher and of the vLLM push are 2 per parameter and equal the bf16 rounding of the
learner's fp32 masters; an fp32 run (configs/tiny.py) keeps them exact."""
import threading
import types

import ml_dtypes
import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax.generation.vllm import protocol as P
from scalerl_jax.generation.vllm.generator import VLLMGenerator
from scalerl_jax.protocol import weight_chunks as ws
from scalerl_jax.training.trainer import Trainer
from scalerl_jax.weights.stream import flatten


class _RecordingClient:
  """Stands in for the buffer client: keeps every WeightChunk message the publisher sends."""

  def __init__(self):
    self.messages = []

  def publish_raw(self, msgs):
    from scalerl_jax.protocol import rollout_pb2 as pb
    self.messages += [bytes(m) for m in msgs]
    return pb.PublishAck(visible=True)


def _masters(seed=0):
  rng = np.random.default_rng(seed)
  return {"embed": rng.standard_normal((64, 48)).astype(np.float32),
          "lm_head": rng.standard_normal((48, 64)).astype(np.float32),
          "norm": rng.standard_normal((48,)).astype(np.float32)}


def _trainer_push(config, params):
  """Runs the trainer's own publish (Trainer.publish) against a recording client; returns the
  chunks as {(leaf index, start): (dtype name, raw bytes)} and the manifest."""
  client = _RecordingClient()
  fake = types.SimpleNamespace(config=config, client=client, source=None, sources=None, _delta=None,
                               beacon=types.SimpleNamespace(tick=lambda: None),
                               evaluation=types.SimpleNamespace(before_publish=lambda v: None),
                               learner=types.SimpleNamespace(state=types.SimpleNamespace(params=params)))
  Trainer.publish(fake, 1)
  import json
  manifest = json.loads(ws.parse_weight_message(client.messages[0]).head.manifest)
  chunks = []
  for raw in client.messages[1:]:
    m = ws.parse_weight_message(raw)
    t, start, ext = manifest["chunks"][m.head.chunk_index]
    chunks.append((t, start, ext, bytes(m.data)))
  return manifest, chunks


def _reassemble(manifest, chunks, dtype):
  out = [np.zeros(t["shape"], dtype) for t in manifest["tensors"]]
  for t, start, ext, data in chunks:
    box = tuple(slice(a, a + n) for a, n in zip(start, ext))
    out[t][box] = np.frombuffer(data, dtype).reshape(ext)
  return out


def test_trainer_push_is_bf16_on_the_wire_by_default():
  config = common.base_config()
  assert config.weights.wire_dtype == "bfloat16" and common.wire_dtype(config.weights) == "bfloat16"
  params = _masters()
  manifest, chunks = _trainer_push(config, params)
  n_params = sum(x.size for _, x in flatten(params))
  assert sum(len(d) for *_, d in chunks) == 2 * n_params          # 2 bytes per parameter
  assert all(t["dtype"] == "bfloat16" and t["itemsize"] == 2 for t in manifest["tensors"])
  got = _reassemble(manifest, chunks, ml_dtypes.bfloat16)
  for (_, master), arrived in zip(flatten(params), got):          # the bf16 rounding (RNE)
    want = master.astype(ml_dtypes.bfloat16)
    assert np.array_equal(arrived.view(np.uint16), want.view(np.uint16))
    assert not np.array_equal(arrived.astype(np.float32), master)   # really rounded


def test_trainer_push_float32_knob_keeps_exact_masters():
  config = common.base_config()
  config.weights.wire_dtype = "float32"
  params = _masters(1)
  manifest, chunks = _trainer_push(config, params)
  assert sum(len(d) for *_, d in chunks) == 4 * sum(x.size for _, x in flatten(params))
  for (_, master), arrived in zip(flatten(params), _reassemble(manifest, chunks, np.float32)):
    assert np.array_equal(arrived, master)


def test_bad_wire_dtype_is_a_config_error():
  config = common.base_config()
  config.weights.wire_dtype = "fp8"
  with pytest.raises(ValueError, match="weights.wire_dtype='fp8'"):
    common.wire_dtype(config.weights)


def _fake_vllm(dtype):
  """A VLLMGenerator without its engine process: frames it would send are recorded."""
  gen = VLLMGenerator.__new__(VLLMGenerator)
  gen.dtype, gen._shm, gen._update_lock, gen._version = dtype, False, threading.Lock(), 0
  gen._hf_shapes, gen.on_chunk = {}, None   # no start checkpoint; no test hook
  gen.frames = []

  def send(op, header=None, arrays=(), dtypes=None):
    bufs = P.encode({"op": op, **(header or {})}, arrays, dtypes)
    hlen, plen = P.parse_prefix(bytes(bufs[0]))
    gen.frames.append(P.decode(bytes(bufs[1]), b"".join(bytes(b) for b in bufs[2:])))
    return header

  def wait(pend, timeout=None):
    return {"version": 1, "bytes": 0, "names": 0, "pause_s": 0, "load_s": 0,
            "paused_total_s": 0, "prefix_cache_reset": False}, {}
  gen._send, gen._wait = send, wait
  gen._call = lambda op, header=None, arrays=(), timeout=None, dtypes=None: (
      ({"unknown": [], "map": {}}, {}) if op == "weights_check"   # every name known, unmapped
      else wait(send(op, header, arrays, dtypes)))
  return gen


@pytest.mark.parametrize("engine", ["bfloat16", "float32"])
def test_vllm_push_wire_dtype_follows_the_engine(engine):
  """A bf16 engine gets bf16 bytes (2 per parameter, the RNE rounding of the masters, the LM head
  too: vLLM stores the head in the engine dtype and its FP32 head casts at compute time); an fp32
  engine gets the fp32 masters bit for bit."""
  from scalerl_jax import models
  cfg = models.get_preset("tiny_llama3", vocab_size=32, d_model=64, num_heads=2, num_kv_heads=1,
                          ffn_dim=96, num_layers=2, scan_layers=False)
  import jax
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(0)))
  gen = _fake_vllm(engine)
  gen.load_params(params, 1, cfg)
  sent = {}
  for header, arrays in gen.frames:
    for m in header["arrays"]:
      sent[m["name"]] = (m["dtype"], m["nbytes"], arrays[m["name"]])
  want = dict(models.hf_named_arrays(cfg, params))
  assert set(sent) == set(want) and "lm_head.weight" in sent
  for name, master in want.items():
    dt, nbytes, arr = sent[name]
    if engine == "bfloat16":
      assert dt == "bfloat16" and nbytes == 2 * master.size, name
      assert np.array_equal(arr, np.asarray(master, np.float32).astype(ml_dtypes.bfloat16)
                            .view(np.uint16)), name
    else:
      assert dt == "float32" and nbytes == 4 * master.size and np.array_equal(arr, master), name
