"""Launch arithmetic shared by the renderer (launch/spec.py) and the preflight (launch/preflight.py).

Everything here is arithmetic on the resolved run config and the model preset, never a compile:

  params / KV bytes per token    the preset's parameter count (tools.describe.count_params on
                                 abstract shapes) and 2 (K, V) x layers x kv_heads x head_dim x
                                 2 bytes (bf16 KV cache) per token
  weight push                    params x the wire bytes per parameter (`wire_bytes_per_param`:
                                 run_config.wire_dtype where it exists, else today's fp32 push)
  generator host memory          the weight versions a generator worker holds in host RAM
                                 (generator.eval_hold_versions + the one being fetched + the
                                 relay's copy of one version when weights.relay_fanout > 0), or at
                                 start one version plus its HF export for vLLM (none when vLLM
                                 starts from the start checkpoint), + VLLM_HOST_BYTES
  vLLM KV cache                  gpu_memory_utilization x HBM x TP - bf16 weights -
                                 VLLM_WORKSPACE_BYTES per GPU (activations, CUDA graphs), or the
                                 explicit generator.kv_cache_bytes; needed: decode_batch x
                                 max_model_len x KV bytes per token
"""
from __future__ import annotations

import copy
import functools
import math

import ml_collections

from scalerl_jax import config as run_config
from scalerl_jax.models import sections as model_sections
from scalerl_jax.tools.describe import count_params

GIB = 2 ** 30
VLLM_HOST_BYTES = 16 * GIB          # vLLM engine + torch + tokenizer-less worker, host RAM (stated)
VLLM_WORKSPACE_BYTES = 4 * GIB      # per GPU: vLLM's profiled activation peak + CUDA graphs (stated)
SHM_BYTES = 2 * (64 << 20)          # the /dev/shm weight-chunk slots (VLLMGenerator, medium Memory)
MEMORY_HEADROOM = 1.15              # requests = estimate x this, rounded up to whole GiB
LOG_BYTES = 2 * GIB                 # a generator pod's logs on its workdir volume (stated)
DISK_MARGIN = 1.2                   # ephemeral-storage request = disk estimate x this, whole GiB
PUSH_BANDWIDTH = 12.5e9             # bytes/s: 100 Gbit/s per pod NIC (stated, not measured)
TARGET_WIRE_BYTES = 2               # bf16 on the wire: the target default
# Weight sync (launch.preflight check_sync): the software's per-stream rate and the delta fraction
# come from the file bench.weights --fanout ... --delta --write-rate writes (measured, with its
# date, commit and machine); without it these stated values are used, labelled "given".
RATE_FILE = "launch/weight_rate.json"
GIVEN_STREAM_RATE = 1.2e9           # bytes/s one Python weight stream (docs/SCALE.md, given)
GIVEN_DELTA_FRACTION = 0.10         # delta bytes / model bf16 bytes per version (the goal, given)
STEP_MFU = 0.4                      # the learner step time's stated MFU (docs/SCALE.md)


@functools.lru_cache(maxsize=None)
def _preset_numbers(model_items: tuple) -> dict:
  c = ml_collections.ConfigDict({"model": dict(model_items)})
  cfg = model_sections.model_config(c)
  counts = count_params(cfg)
  kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
  return dict(params=int(counts["params_total"]), kv_bytes_per_token=int(kv),
              num_kv_heads=int(cfg.num_kv_heads), params_active=int(counts["params_active"]),
              attention_flops_per_token_per_position=12 * cfg.num_layers * cfg.num_heads
              * cfg.head_dim)


def model_numbers(config) -> dict:
  """{params, kv_bytes_per_token, num_kv_heads} of the run's model (from its preset: the start
  checkpoint's config.json is on the data volume, not here)."""
  m = copy.deepcopy(config.model.to_dict())
  m["hf_checkpoint"] = ""
  return _preset_numbers(tuple(sorted((k, v) for k, v in m.items())))


def wire_bytes_per_param(config) -> int:
  """Bytes a float32 parameter takes on the wire to the generators: run_config.wire_dtype of the
  weights section where the code has it (bfloat16: 2), else 4 (the push sends the learner's fp32
  params as is)."""
  return 2 if run_config.wire_dtype(config.weights) in ("bfloat16", "float16") else 4


def engine_bytes_per_param(config) -> int:
  """Bytes per weight in the vLLM engine (its dtype follows model.dtype)."""
  return 4 if str(config.model.dtype) == "float32" else 2


def push(config) -> dict:
  """Bytes of one weight push to one generator and its seconds at PUSH_BANDWIDTH."""
  n = model_numbers(config)["params"]
  b = wire_bytes_per_param(config)
  return dict(bytes_per_param=b, bytes=n * b, seconds=n * b / PUSH_BANDWIDTH,
              bandwidth=PUSH_BANDWIDTH)


def sync_rates(path: str = RATE_FILE) -> dict:
  """{stream: bytes/s, delta: fraction, label} from bench.weights' rate file, else the given
  values (label "given: ..."). The stream rate is the smaller of the file's per-stream rate (a
  staged version, publisher host buffer -> generator host buffer over TCP) and its `version_GBps`
  (the same stream while the learner stages the version on the same cores), where it has one."""
  import json  # local: only the preflight reads the rate file
  import os  # local: as above
  full = path if os.path.isabs(path) else os.path.join(
      os.path.dirname(os.path.dirname(os.path.abspath(__file__))), path)
  try:
    with open(full) as f:
      m = json.load(f)
    stream = float(m["stream_GBps"])
    label = f"measured {m.get('date', '?')} {m.get('commit', '?')} {m.get('machine', '?')}"
    if m.get("version_GBps"):
      stream = min(stream, float(m["version_GBps"]))
      label += (f"; the smaller of per stream {float(m['stream_GBps']):.2f} and staging "
                f"overlapped {float(m['version_GBps']):.2f} GB/s")
    return dict(stream=stream * 1e9, delta=float(m["delta_fraction"]), label=label)
  except (OSError, ValueError, KeyError):
    return dict(stream=GIVEN_STREAM_RATE, delta=GIVEN_DELTA_FRACTION,
                label="given (no measured rate file)")


def sync_seconds(model_bytes: float, generators: int, learner_hosts: int, fanout: int,
                 delta: float, stream: float, nic: float = PUSH_BANDWIDTH) -> float:
  """Seconds until every generator holds a version (weights/relay.py, weights/delta.py).
  Bytes per generator: model_bytes x delta (1 for full versions). A Python weight server sends at
  most `stream` bytes/s in all (one GIL) and a pod at most `nic`. Without relays (fanout 0) the
  learner hosts' sources send every generator its copy: G x bytes / (hosts x min(stream, nic)).
  With relays the sources send one copy (to the root) and each relay passes it to `fanout`
  children, chunks pipelined down the tree: bytes / min(hosts x min(stream, nic),
  min(stream, nic) / fanout, stream) plus one 8 MB chunk per tree level."""
  per_gen = model_bytes * delta
  serve = min(stream, nic)
  if fanout < 1 or generators <= 1:
    return generators * per_gen / (max(1, learner_hosts) * serve)
  rate = min(max(1, learner_hosts) * serve, serve / fanout, stream)
  depth = math.ceil(math.log(generators) / math.log(fanout)) if fanout > 1 else generators
  return per_gen / rate + depth * (8 << 20) / rate


def step_seconds(config, num_devices: int, peak_flops: float, mfu: float = STEP_MFU) -> float:
  """The learner step at `mfu` of the devices' peak: a step's tokens (prompts x generations x
  the longest sequence) x (6 N_active + 12 L H Dh T) FLOPs (docs/SCALE.md's closed form)."""
  m = model_numbers(config)
  t = run_config.max_sequence_len(config.rollout)
  r = config.rollout
  rows = int(r.batch_size or r.prompts_per_step * r.generations_per_prompt)
  per_token = 6.0 * m["params_active"] + m["attention_flops_per_token_per_position"] * t
  return rows * t * per_token / (num_devices * peak_flops * mfu)


def generator_host_bytes(config) -> dict:
  """Host RAM of one generator pod (module docstring): the steady state's held versions and the
  start-up's one version + HF export, the larger of the two, + vLLM's own + the shm slots."""
  n = model_numbers(config)["params"]
  g = config.generator
  versions = int(g.eval_hold_versions) + 1
  wire = wire_bytes_per_param(config)
  # + the weight relay's copy (weights/relay.py): the chunk messages of the version it passes on
  w = config.weights
  relay = n * wire if int(w.get("relay_fanout", 0)) > 0 else 0
  steady = versions * n * wire + relay
  # vLLM starts on generator.vllm_model_dir or the start checkpoint (generation.worker
  # vllm_start_dir: a gs:// one is copied to local disk); else on an HF export of version 0
  started_from_disk = g.vllm_model_dir or config.model.hf_checkpoint
  export = 0 if started_from_disk else n * engine_bytes_per_param(config)
  start = n * wire + export
  total = max(steady, start) + VLLM_HOST_BYTES + SHM_BYTES
  return dict(versions=versions, steady=steady, start=start, total=total, relay=relay)


def generator_memory_request_gib(config) -> int:
  """The generator pod's memory request (GiB): the estimate x MEMORY_HEADROOM, rounded up."""
  return int(math.ceil(generator_host_bytes(config)["total"] * MEMORY_HEADROOM / GIB))


def generator_disk_bytes(config) -> dict:
  """Local disk of one generator pod: the start checkpoint's copy (a gs:// model.hf_checkpoint is
  copied to local disk, vllm/engine.py vllm_start_dir) + the HF export of version 0 (none when
  vLLM starts from a checkpoint) + LOG_BYTES; `request_gib` = total x DISK_MARGIN, rounded up.

  With `generator.ckpt_cache_dir` (a hostPath the node's generator pods share, node_cache.py) the
  copy is on the node's disk, once per node, outside the pod's ephemeral storage: it is reported
  as `node_copy` and not requested by the pod."""
  n = model_numbers(config)["params"]
  g, ckpt = config.generator, str(config.model.hf_checkpoint or "")
  engine = n * engine_bytes_per_param(config)
  fetched = engine if ckpt.startswith("gs://") and not g.vllm_model_dir else 0
  node_copy = fetched if g.ckpt_cache_dir else 0
  copy_b = fetched - node_copy
  export = 0 if (g.vllm_model_dir or ckpt) else engine
  total = copy_b + export + LOG_BYTES
  return dict(copy=copy_b, node_copy=node_copy, export=export, logs=LOG_BYTES, total=total,
              request_gib=int(math.ceil(total * DISK_MARGIN / GIB)))


def kv_cache(config, hbm_bytes: int, tensor_parallel: int) -> dict:
  """What one vLLM engine's KV cache holds vs what the config asks of it (module docstring)."""
  mn = model_numbers(config)
  g = config.generator
  tp = int(tensor_parallel)
  weights = mn["params"] * engine_bytes_per_param(config)
  explicit = int(g.kv_cache_bytes or 0)
  util = float(g.gpu_memory_utilization)
  if explicit:
    capacity = explicit * tp
  else:
    capacity = int(util * hbm_bytes * tp - weights - VLLM_WORKSPACE_BYTES * tp)
  max_len = run_config.vllm_max_model_len(config.rollout)
  per_seq = max_len * mn["kv_bytes_per_token"]
  seqs = int(g.decode_batch)
  return dict(capacity=capacity, per_seq=per_seq, max_model_len=max_len, seqs=seqs,
              needed=seqs * per_seq, fits_seqs=max(0, capacity // per_seq),
              explicit=bool(explicit), gpu_memory_utilization=util, weights=weights)


def buffer_host_bytes(config, learner_hosts: int = 1) -> int:
  """The buffer pod's host RAM: rollouts of max_lag + 2 steps (tokens, log-probs, versions,
  mask: 13 bytes a token at the longest sequence) + the weight versions it holds when weights
  go through it (weights.serve_from="buffer": two)."""
  r = config.rollout
  batch = int(r.batch_size or r.prompts_per_step * r.generations_per_prompt)
  rollouts = (int(r.max_lag) + 2) * batch * run_config.max_sequence_len(config.rollout) * 13
  weights = 0
  if str(config.weights.serve_from) == "buffer":
    weights = 2 * model_numbers(config)["params"] * wire_bytes_per_param(config)
  return rollouts + weights + 2 * GIB


def parse_quantity(q: str) -> int:
  """A Kubernetes memory quantity ("64Gi", "800Gi", "32G", "1024Mi") in bytes."""
  q = str(q)
  units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6,
           "G": 10**9, "T": 10**12}
  for u in sorted(units, key=len, reverse=True):
    if q.endswith(u):
      return int(float(q[:-len(u)]) * units[u])
  return int(float(q))
