"""HF checkpoint I/O: `save_pretrained` directories <-> our params, and the HF name map.

* `load_hf(path)` reads config.json + model.safetensors (or sharded + model.safetensors.index.json)
  tensor by tensor (memory-mapped; no torch), returning host numpy params.
* `save_hf(cfg, params, path)` writes config.json + safetensors that `transformers` loads.
* `hf_named_arrays(cfg, params)` yields (hf_name, numpy array) in HF layout (vLLM weight push).

Safetensors files are read / written with the project's one codec (models/safetensors_format.py:
numpy memmap + ml_dtypes) so bfloat16 checkpoints work without torch. How each of our params is made
from HF tensors is declared once, as `Source`s (`layer_sources` / `param_sources`): a full load
applies them to whole tensors, the sharded start-checkpoint loader (models/hf_slices.py) to slices.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Iterator

import jax
import ml_dtypes
import numpy as np

from scalerl_jax.models import families
from scalerl_jax.models import safetensors_format as st_format
from scalerl_jax.data.hf_tokenizer import checkpoint_eos_ids
from scalerl_jax.models.config import ModelConfig, from_hf_config, to_hf_config

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ------------------------------------------------------------------ safetensors codec
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
    self._where: dict[str, tuple[str, st_format.TensorInfo]] = {}
    for fn in files:
      fp = os.path.join(path, fn)
      if not os.path.exists(fp):
        raise FileNotFoundError(f"shard {fp} listed in {INDEX_FILE} is missing")
      with open(fp, "rb") as f:
        def read(o, n, f=f) -> bytes:
          f.seek(o)
          return f.read(n)
        infos, _ = st_format.parse_header(read, size=os.path.getsize(fp), where=fp)
      for name, info in infos.items():
        self._where[name] = (fp, info)

  def keys(self) -> list[str]:
    return list(self._where)

  def __contains__(self, name: str) -> bool:
    return name in self._where

  def get(self, name: str) -> np.ndarray:
    """Returns the tensor `name` (memory-mapped, read-only)."""
    if name not in self._where:
      raise ValueError(f"tensor {name!r} missing from checkpoint")
    fp, info = self._where[name]
    count = info.nbytes // info.dtype.itemsize
    arr = np.memmap(fp, dtype=info.dtype, mode="r", offset=info.offset, shape=(count,)) \
        if count else np.zeros((0,), info.dtype)
    return arr.reshape(info.shape)


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
  """Writes a safetensors file (models/safetensors_format.py)."""
  st_format.write_file(path, tensors)


# ------------------------------------------------------------------ layer tree helpers
def layer_trees(cfg: ModelConfig, params: Any) -> list[dict]:
  """Per-layer param subtrees (list of length L) for scanned or unscanned params."""
  if cfg.scan_layers:
    p = cfg.scan_period
    blocks = params["blocks"]
    return [jax.tree.map(lambda a, b=i // p: a[b], blocks[f"layer_{i % p}"])
            for i in range(cfg.num_layers)]
  return [params[f"layers_{i}"] for i in range(cfg.num_layers)]


def from_layer_trees(cfg: ModelConfig, top: dict, layers: list[dict], stack=None) -> dict:
  """Inverse of `layer_trees`: top-level params + per-layer trees -> params for cfg's layout
  (`stack(*leaves)` combines a scanned param's layers; default np.stack)."""
  out = dict(top)
  stack = stack or (lambda *xs: np.stack(xs))
  if cfg.scan_layers:
    p = cfg.scan_period
    out["blocks"] = {f"layer_{j}": jax.tree.map(stack, *layers[j::p])
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
  ff = families.get(cfg.family).ff_prefix
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


@dataclasses.dataclass(frozen=True)
class Source:
  """How one of our params (one layer's, for layer params) is made from one HF tensor:
  `ours = hf.reshape(view)[fixed indices].transpose(perm)`.

  `view` is a row-major reshape of the stored `hf_shape` (splits e.g. N*H into N, H), `fixed`
  pins view axes to one index and drops them (the gate / up halves of a fused gate_up_proj),
  and our axis j is the remaining view axis `perm[j]`."""
  name: str
  hf_shape: tuple[int, ...]
  view: tuple[int, ...]
  perm: tuple[int, ...]
  fixed: tuple[tuple[int, int], ...] = ()

  @property
  def kept(self) -> tuple[int, ...]:
    """The view axes that remain after `fixed` (in view order)."""
    pinned = {a for a, _ in self.fixed}
    return tuple(a for a in range(len(self.view)) if a not in pinned)

  @property
  def shape(self) -> tuple[int, ...]:
    """Our param's shape."""
    kept = self.kept
    return tuple(self.view[kept[p]] for p in self.perm)

  def view_box(self, box) -> list[tuple[int, int]]:
    """Our index box [(start, stop)] per our axis -> the box of the HF view it reads."""
    out: list[Any] = [None] * len(self.view)   # every axis is set below
    for a, i in self.fixed:
      out[a] = (i, i + 1)
    kept = self.kept
    for j, p in enumerate(self.perm):
      out[kept[p]] = tuple(box[j])
    return out

  def to_ours(self, block: np.ndarray, whole: bool = False) -> np.ndarray:
    """An HF-view block -> our layout (a view). `block` is read with a `view_box` (its fixed
    axes have size 1), or is the `whole` view."""
    fixed = dict(self.fixed)
    idx = tuple((fixed[a] if whole else 0) if a in fixed else slice(None)
                for a in range(len(self.view)))
    return block[idx].transpose(self.perm)

  def apply(self, arr: np.ndarray, dtype) -> np.ndarray:
    """The whole HF tensor -> our param in `dtype` (a new C-contiguous array)."""
    if tuple(arr.shape) != tuple(self.hf_shape):
      raise ValueError(f"tensor {self.name!r}: shape {tuple(arr.shape)} != expected "
                       f"{tuple(self.hf_shape)}")
    return np.array(self.to_ours(arr.reshape(self.view), whole=True), dtype=dtype, order="C")


def _src(name, hf_shape, view=None, perm=None, fixed=()) -> Source:
  view = tuple(view or hf_shape)
  return Source(name, tuple(hf_shape), view,
                tuple(perm if perm is not None else range(len(view) - len(fixed))), tuple(fixed))


def _linear(name, out_dim, in_dim) -> Source:
  """An HF Linear weight [out, in] -> our kernel [in, out]."""
  return _src(name, (out_dim, in_dim), perm=(1, 0))


def layer_sources(cfg: ModelConfig, i: int) -> dict:
  """Layer i's param tree with a `Source` at every leaf (the inverse of `_layer_to_hf`)."""
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = _prefix(i)
  t: dict[str, dict[str, Any]] = {"attn": {"q": _src(p + "self_attn.q_proj.weight", (N * H, D), (N, H, D), (2, 0, 1)),
                "k": _src(p + "self_attn.k_proj.weight", (K * H, D), (K, H, D), (2, 0, 1)),
                "v": _src(p + "self_attn.v_proj.weight", (K * H, D), (K, H, D), (2, 0, 1)),
                "o": _src(p + "self_attn.o_proj.weight", (D, N * H), (D, N, H), (1, 2, 0))},
       "attn_norm": {"scale": _src(p + "input_layernorm.weight", (D,))},
       "ffn_norm": {"scale": _src(p + "post_attention_layernorm.weight", (D,))}}
  ff = families.get(cfg.family).ff_prefix
  if cfg.layer_is_moe(i):
    E, F = cfg.num_experts, cfg.expert_ffn_dim
    gu = p + ff + "experts.gate_up_proj"
    t["moe"] = {"router": _linear(p + ff + "router.weight", E, D),
                "gate": _src(gu, (E, D, 2 * F), (E, D, 2, F), fixed=((2, 0),)),
                "up": _src(gu, (E, D, 2 * F), (E, D, 2, F), fixed=((2, 1),)),
                "down": _src(p + ff + "experts.down_proj", (E, F, D)),
                "shared": {"gate": _linear(p + ff + "shared_expert.gate_proj.weight", F, D),
                           "up": _linear(p + ff + "shared_expert.up_proj.weight", F, D),
                           "down": _linear(p + ff + "shared_expert.down_proj.weight", D, F)}}
  else:
    F = cfg.ffn_dim
    t["mlp"] = {"gate": _linear(p + ff + "gate_proj.weight", F, D),
                "up": _linear(p + ff + "up_proj.weight", F, D),
                "down": _linear(p + ff + "down_proj.weight", D, F)}
  return t


@dataclasses.dataclass(frozen=True)
class Stacked:
  """A scanned param: block b is layer `sources[b]` (leading axis = the scanned blocks)."""
  sources: tuple[Source, ...]

  @property
  def shape(self) -> tuple[int, ...]:
    return (len(self.sources),) + self.sources[0].shape


def param_sources(cfg: ModelConfig) -> dict:
  """The param tree of `cfg` (scanned or not) with a `Source` (or `Stacked` of per-layer Sources
  for scanned layers) at every leaf: which HF tensor, and which part of it, each param is."""
  V, D = cfg.vocab_size, cfg.d_model
  top = {"embed": _src("model.embed_tokens.weight", (V, D)),
         "final_norm": {"scale": _src("model.norm.weight", (D,))}}
  if not cfg.tie_embeddings:
    top["lm_head"] = _linear("lm_head.weight", V, D)
  layers = [layer_sources(cfg, i) for i in range(cfg.num_layers)]
  return from_layer_trees(cfg, top, layers, stack=lambda *xs: Stacked(tuple(xs)))


def param_dtype(cfg: ModelConfig) -> np.dtype:
  """numpy dtype of cfg.param_dtype (bfloat16 via ml_dtypes)."""
  return np.dtype(ml_dtypes.bfloat16) if cfg.param_dtype == "bfloat16" else np.dtype(cfg.param_dtype)


def params_from_hf_tensors(cfg: ModelConfig, get_tensor) -> dict:
  """Builds our params from a `get_tensor(hf_name) -> np.ndarray` accessor (shapes checked)."""
  dt = param_dtype(cfg)

  def one(src) -> np.ndarray:
    if isinstance(src, Stacked):
      return np.stack([s.apply(get_tensor(s.name), dt) for s in src.sources])
    return src.apply(get_tensor(src.name), dt)
  return jax.tree.map(one, param_sources(cfg), is_leaf=lambda x: isinstance(x, (Source, Stacked)))


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
  eos = checkpoint_eos_ids(path)   # config.json's and generation_config.json's, in order
  if len(eos) > 1 and "eos_token_ids" not in overrides:
    cfg = cfg.replace(eos_token_ids=eos)
  st = SafetensorsDir(path)
  prefix = "language_model." if "language_model.model.embed_tokens.weight" in st else ""
  params = params_from_hf_tensors(cfg, lambda name: st.get(prefix + name))
  return cfg, params


def write_config(cfg: ModelConfig, path: str, dtype: str | None = None) -> np.dtype:
  """Writes config.json (+ generation_config.json with the whole eos list) for tensors in `dtype`
  (default cfg.param_dtype) into directory `path`; returns that dtype as numpy's."""
  hf_cfg = to_hf_config(cfg)
  hf_cfg.architectures = [families.get(cfg.family).hf_architecture]
  out_dtype = dtype or cfg.param_dtype
  hf_cfg.dtype = out_dtype
  hf_cfg.to_json_file(os.path.join(path, "config.json"))
  if cfg.eos_token_ids:   # the whole stop list, where vLLM and transformers' generate() read it
    with open(os.path.join(path, "generation_config.json"), "w") as f:
      json.dump({"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}, f,
                indent=2)
  return np.dtype(ml_dtypes.bfloat16) if out_dtype == "bfloat16" else np.dtype(out_dtype)


def save_hf(cfg: ModelConfig, params: Any, path: str, *, dtype: str | None = None,
            max_shard_bytes: int | None = None) -> None:
  """Writes config.json + safetensors (sharded with an index when max_shard_bytes is set)."""
  os.makedirs(path, exist_ok=True)
  np_dt = write_config(cfg, path, dtype)
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
