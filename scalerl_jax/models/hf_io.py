"""HF checkpoint I/O: `save_pretrained` directories <-> our params, and the HF name map.

* `load_hf(path)` reads config.json + model.safetensors (or sharded + model.safetensors.index.json)
  tensor by tensor (memory-mapped; no torch), returning host numpy params.
* `save_hf(cfg, params, path)` writes config.json + safetensors that `transformers` loads.
* `hf_named_arrays(cfg, params)` yields (hf_name, numpy array) in HF layout (vLLM weight push).

Safetensors files are read / written with a small built-in codec (numpy memmap + ml_dtypes) so
bfloat16 checkpoints work without torch.
"""
from __future__ import annotations

import json
import os
import struct
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np

from scalerl_jax.models.config import ModelConfig, from_hf_config, to_hf_config

_ST_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16, "F64": np.float64,
              "I64": np.int64, "I32": np.int32, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ------------------------------------------------------------------ safetensors codec
def _read_header(path: str) -> tuple[dict, int]:
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    header = json.loads(f.read(n))
  header.pop("__metadata__", None)
  return header, 8 + n


class SafetensorsDir:
  """Lazy, memory-mapped view of a save_pretrained directory's tensors (name -> numpy)."""

  def __init__(self, path: str):
    if not os.path.isdir(path):
      raise FileNotFoundError(f"checkpoint directory not found: {path}")
    index = os.path.join(path, INDEX_FILE)
    if os.path.exists(index):
      with open(index) as f:
        weight_map = json.load(f)["weight_map"]
      files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(path, SINGLE_FILE)):
      files = [SINGLE_FILE]
    else:
      raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")
    self._where: dict[str, tuple[str, dict, int]] = {}
    for fn in files:
      fp = os.path.join(path, fn)
      if not os.path.exists(fp):
        raise FileNotFoundError(f"shard {fp} listed in {INDEX_FILE} is missing")
      header, start = _read_header(fp)
      for name, info in header.items():
        self._where[name] = (fp, info, start)

  def keys(self) -> list[str]:
    return list(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def get(self, name: str) -> np.ndarray:
    """Returns the tensor `name` (memory-mapped, read-only)."""
    if name not in self._where:
      raise ValueError(f"tensor {name!r} missing from checkpoint")
    fp, info, start = self._where[name]
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(f"tensor {name!r} has unsupported dtype {info['dtype']}")
    dt = np.dtype(_ST_DTYPES[info["dtype"]])
    b, e = info["data_offsets"]
    count = (e - b) // dt.itemsize
    arr = np.memmap(fp, dtype=dt, mode="r", offset=start + b, shape=(count,)) if count else \
        np.zeros((0,), dt)
    return arr.reshape(info["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes a safetensors file (format: u64 header size, JSON header, raw little-endian data)."""
  header, offset, arrays = {}, 0, []
  for name, arr in tensors.items():
    arr = np.ascontiguousarray(arr)
    if arr.dtype not in _ST_NAMES:
      raise ValueError(f"cannot write {name!r} of dtype {arr.dtype}")
    header[name] = {"dtype": _ST_NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
    arrays.append(arr)
  header["__metadata__"] = {"format": "pt"}
  hb = json.dumps(header, separators=(",", ":")).encode()
  hb += b" " * (-len(hb) % 8)
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(hb)))
    f.write(hb)
    for arr in arrays:
      f.write(arr.tobytes())


# ------------------------------------------------------------------ layer tree helpers
def layer_trees(cfg: ModelConfig, params: Any) -> list[dict]:
  """Per-layer param subtrees (list of length L) for scanned or unscanned params."""
  if cfg.scan_layers:
    p = cfg.scan_period
    blocks = params["blocks"]
    return [jax.tree.map(lambda a, b=i // p: a[b], blocks[f"layer_{i % p}"])
            for i in range(cfg.num_layers)]
  return [params[f"layers_{i}"] for i in range(cfg.num_layers)]


def from_layer_trees(cfg: ModelConfig, top: dict, layers: list[dict]) -> dict:
  """Inverse of `layer_trees`: top-level params + per-layer trees -> params for cfg's layout."""
  out = dict(top)
  if cfg.scan_layers:
    p = cfg.scan_period
    out["blocks"] = {f"layer_{j}": jax.tree.map(lambda *xs: np.stack(xs), *layers[j::p])
                     for j in range(p)}
  else:
    out.update({f"layers_{i}": t for i, t in enumerate(layers)})
  return out


# ------------------------------------------------------------------ name map
def _prefix(i: int) -> str:
  return f"model.layers.{i}."


def _layer_to_hf(cfg: ModelConfig, i: int, t: dict) -> Iterator[tuple[str, np.ndarray]]:
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = _prefix(i)
  a = t["attn"]
  yield p + "self_attn.q_proj.weight", np.asarray(a["q"]).reshape(D, N * H).T
  yield p + "self_attn.k_proj.weight", np.asarray(a["k"]).reshape(D, K * H).T
  yield p + "self_attn.v_proj.weight", np.asarray(a["v"]).reshape(D, K * H).T
  yield p + "self_attn.o_proj.weight", np.asarray(a["o"]).reshape(N * H, D).T
  yield p + "input_layernorm.weight", np.asarray(t["attn_norm"]["scale"])
  yield p + "post_attention_layernorm.weight", np.asarray(t["ffn_norm"]["scale"])
  ff = "mlp." if cfg.family == "llama3" else "feed_forward."
  if cfg.layer_is_moe(i):
    m = t["moe"]
    yield p + ff + "router.weight", np.asarray(m["router"]).T
    yield p + ff + "experts.gate_up_proj", np.concatenate(
        [np.asarray(m["gate"]), np.asarray(m["up"])], axis=-1)
    yield p + ff + "experts.down_proj", np.asarray(m["down"])
    for n in ("gate", "up", "down"):
      yield p + ff + f"shared_expert.{n}_proj.weight", np.asarray(m["shared"][n]).T
  else:
    for n in ("gate", "up", "down"):
      yield p + ff + f"{n}_proj.weight", np.asarray(t["mlp"][n]).T


def hf_named_arrays(cfg: ModelConfig, params: Any) -> Iterator[tuple[str, np.ndarray]]:
  """Yields (HF tensor name, numpy array in HF layout/dtype of params), one tensor at a time."""
  yield "model.embed_tokens.weight", np.asarray(params["embed"])
  for i, t in enumerate(layer_trees(cfg, params)):
    yield from _layer_to_hf(cfg, i, t)
  yield "model.norm.weight", np.asarray(params["final_norm"]["scale"])
  if not cfg.tie_embeddings:
    yield "lm_head.weight", np.asarray(params["lm_head"]).T


def _layer_from_hf(cfg: ModelConfig, i: int, get) -> dict:
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = _prefix(i)
  t = {"attn": {"q": get(p + "self_attn.q_proj.weight", (N * H, D)).T.reshape(D, N, H),
                "k": get(p + "self_attn.k_proj.weight", (K * H, D)).T.reshape(D, K, H),
                "v": get(p + "self_attn.v_proj.weight", (K * H, D)).T.reshape(D, K, H),
                "o": get(p + "self_attn.o_proj.weight", (D, N * H)).T.reshape(N, H, D)},
       "attn_norm": {"scale": get(p + "input_layernorm.weight", (D,))},
       "ffn_norm": {"scale": get(p + "post_attention_layernorm.weight", (D,))}}
  ff = "mlp." if cfg.family == "llama3" else "feed_forward."
  if cfg.layer_is_moe(i):
    E, F = cfg.num_experts, cfg.expert_ffn_dim
    gu = get(p + ff + "experts.gate_up_proj", (E, D, 2 * F))
    t["moe"] = {"router": get(p + ff + "router.weight", (E, D)).T,
                "gate": gu[..., :F], "up": gu[..., F:],
                "down": get(p + ff + "experts.down_proj", (E, F, D)),
                "shared": {"gate": get(p + ff + "shared_expert.gate_proj.weight", (F, D)).T,
                           "up": get(p + ff + "shared_expert.up_proj.weight", (F, D)).T,
                           "down": get(p + ff + "shared_expert.down_proj.weight", (D, F)).T}}
  else:
    F = cfg.ffn_dim
    t["mlp"] = {"gate": get(p + ff + "gate_proj.weight", (F, D)).T,
                "up": get(p + ff + "up_proj.weight", (F, D)).T,
                "down": get(p + ff + "down_proj.weight", (D, F)).T}
  return t


def params_from_hf_tensors(cfg: ModelConfig, get_tensor) -> dict:
  """Builds our params from a `get_tensor(hf_name) -> np.ndarray` accessor (shapes checked)."""
  dt = np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)

  def get(name, shape):
    arr = get_tensor(name)
    if tuple(arr.shape) != tuple(shape):
      raise ValueError(f"tensor {name!r}: shape {tuple(arr.shape)} != expected {tuple(shape)}")
    return np.array(arr, dtype=dt)  # copy out of the memmap, cast to param dtype

  V, D = cfg.vocab_size, cfg.d_model
  top = {"embed": get("model.embed_tokens.weight", (V, D)),
         "final_norm": {"scale": get("model.norm.weight", (D,))}}
  if not cfg.tie_embeddings:
    top["lm_head"] = get("lm_head.weight", (V, D)).T
  layers = [_layer_from_hf(cfg, i, get) for i in range(cfg.num_layers)]
  return from_layer_trees(cfg, top, layers)


def load_hf(path: str, **overrides: Any) -> tuple[ModelConfig, dict]:
  """Loads a save_pretrained directory -> (ModelConfig, host numpy params).

  `overrides` replace ModelConfig fields (e.g. dtype='bfloat16', scan_layers=True). Accepts
  Llama4ForConditionalGeneration checkpoints too (text weights under 'language_model.').
  """
  cfg_path = os.path.join(path, "config.json")
  if not os.path.exists(cfg_path):
    raise FileNotFoundError(f"no config.json in {path}")
  with open(cfg_path) as f:
    cfg = from_hf_config(json.load(f), **overrides)
  st = SafetensorsDir(path)
  prefix = "language_model." if "language_model.model.embed_tokens.weight" in st else ""
  params = params_from_hf_tensors(cfg, lambda name: st.get(prefix + name))
  return cfg, params


def save_hf(cfg: ModelConfig, params: Any, path: str, *, dtype: str | None = None,
            max_shard_bytes: int | None = None) -> None:
  """Writes config.json + safetensors (sharded with an index when max_shard_bytes is set)."""
  os.makedirs(path, exist_ok=True)
  hf_cfg = to_hf_config(cfg)
  hf_cfg.architectures = ["LlamaForCausalLM" if cfg.family == "llama3" else "Llama4ForCausalLM"]
  out_dtype = dtype or cfg.param_dtype
  hf_cfg.dtype = out_dtype
  hf_cfg.to_json_file(os.path.join(path, "config.json"))
  np_dt = np.dtype(ml_dtypes.bfloat16) if out_dtype == "bfloat16" else np.dtype(out_dtype)
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for name, arr in hf_named_arrays(cfg, params):
    arr = np.ascontiguousarray(arr, dtype=np_dt)
    if max_shard_bytes and shards[-1] and size + arr.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][name] = arr
    size += arr.nbytes
  if len(shards) == 1:
    write_safetensors(os.path.join(path, SINGLE_FILE), shards[0])
    return
  weight_map, total = {}, 0
  for s, tensors in enumerate(shards):
    fn = f"model-{s + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(os.path.join(path, fn), tensors)
    for name, arr in tensors.items():
      weight_map[name] = fn
      total += arr.nbytes
  with open(os.path.join(path, INDEX_FILE), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
