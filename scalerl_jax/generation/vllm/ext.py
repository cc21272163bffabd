"""Methods injected into vLLM's model worker (`worker_extension_cls`), reached via `collective_rpc`.

Runs inside vLLM's worker process (.venv-vllm): imports torch and numpy only (never jax). vLLM
mixes this class into its Worker, so `self.model_runner.model` is the live `nn.Module`.

Weight interchange format: HF parameter names ("model.layers.0.self_attn.q_proj.weight", ...).
vLLM's `LlamaForCausalLM.load_weights` maps them itself (q/k/v -> qkv_proj and gate/up ->
gate_up_proj shards, dtype cast to the model dtype). Tensors arrive as (dtype, shape, bytes) triples
because vLLM's collective_rpc serializer turns numpy arrays inside lists into nested lists.
"""
# vllm is installed in .venv-vllm only (this module runs there); the type check runs in .venv.
# pyright: reportMissingImports=false
from __future__ import annotations

import hashlib
import warnings
from typing import Any

import numpy as np
import torch

from scalerl_jax import lazy
from scalerl_jax.generation.vllm.protocol import BF16, read_shm, served_names

# vLLM's layerwise reload, loaded at the first weight update (this module loads into vLLM's workers).
reload = lazy.module("vllm.model_executor.model_loader.reload")

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64}


def _to_tensor(dtype: str, shape, data: bytes) -> torch.Tensor:
  if dtype == "bfloat16":
    t = torch.frombuffer(bytearray(data), dtype=torch.int16).view(torch.bfloat16)
  else:
    t = torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).copy())
  return t.reshape(tuple(shape))


class ScaleRLWorkerExtension:
  """collective_rpc targets: `scalerl_reload_begin/_load_weights/_reload_end`, `scalerl_info`,
  `scalerl_set_head_dtype`.

  An update is begin -> load_weights (any number of chunks) -> end, using vLLM's layerwise
  in-place reload: the CPU (and quantized) backends repack weights after loading, so the plain
  `load_weights` cannot be called twice; the reload path restores checkpoint-format parameters,
  buffers each layer's incoming tensors until the layer is complete, re-runs the post-load
  processing and copies the result back into the original storage (compiled graphs stay valid).
  A fused module (qkv_proj, gate_up_proj) must receive all its parts within one update; layers
  that get no tensors keep their current weights."""

  model_runner: Any     # vLLM's model runner: set by the Worker this class is mixed into

  def scalerl_reload_begin(self) -> bool:
    model = self._scalerl_model()
    _hf_names(model)   # cache the accepted names while parameters are still materialized
    self._scalerl_moe_touched = set()
    reload.initialize_layerwise_reload(model)
    return True

  def scalerl_reload_end(self) -> bool:
    model = self._scalerl_model()
    reload.finalize_layerwise_reload(model, self.model_runner.vllm_config.model_config)
    _repack_cpu_experts(model, getattr(self, "_scalerl_moe_touched", ()))
    return True

  def _scalerl_model(self):
    return self.model_runner.get_model()   # the nn.Module (unwrapped from compile wrappers)

  def scalerl_load_weights(self, tensors: list) -> dict:
    """Loads [(hf_name, dtype, shape, bytes)] into the model (between reload_begin and _end)."""
    return self._scalerl_load_pairs([(name, _to_tensor(dt, shape, data))
                                     for name, dt, shape, data in tensors])

  def scalerl_load_shm(self, path: str, metas: list) -> dict:
    """Loads the tensors of one /dev/shm chunk (vllm.protocol.ShmSlots) into the model: torch views
    of the mapped file, copied once by vLLM's loader (chunks hold whole layers, so the layerwise
    reload finishes with them before the client reuses the file)."""
    cache = self.__dict__.setdefault("_scalerl_shm_maps", {})
    views = read_shm(path, metas, cache)
    pairs = []
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")          # read-only mapping: vLLM only reads (copies) it
      for m in metas:
        t = torch.from_numpy(views[m["name"]])
        pairs.append((m["name"], t.view(torch.bfloat16) if m["dtype"] == BF16 else t))
    return self._scalerl_load_pairs(pairs)

  def scalerl_check_names(self, names: list) -> dict:
    """{"map": {pushed: served name}, "unknown": [...]}: how an update's HF names map onto the
    names this served model accepts (protocol.served_names, from the model vLLM loaded: a
    multimodal Llama-4 holds the text model under `language_model.`), and the ones it does not
    accept ({} and [] when it has no known stacking map: then vLLM's own loader validates)."""
    known = _hf_names(self._scalerl_model())
    if known is None:
      return {"map": {}, "unknown": []}
    mapping, unknown = served_names([n for n in names if "rotary_emb.inv_freq" not in n], known)
    return {"map": mapping, "unknown": unknown}

  def _scalerl_load_pairs(self, pairs: list) -> dict:
    model = self._scalerl_model()
    known = _hf_names(model)
    unknown = [n for n, _ in pairs
               if known is not None and n not in known and "rotary_emb.inv_freq" not in n]
    if unknown:
      raise KeyError(f"unknown HF parameter names (not in the served model): {unknown[:8]}"
                     f"{' ...' if len(unknown) > 8 else ''}")
    touched = self.__dict__.setdefault("_scalerl_moe_touched", set())
    touched.update(n[:n.index(".experts.")] for n, _ in pairs if ".experts." in n)
    with torch.no_grad():
      model.load_weights(iter(pairs))
    return {"n": len(pairs)}

  def scalerl_info(self) -> dict:
    """Reports dtypes, and probes the logits dtype by running the real LM-head path once."""
    model = self._scalerl_model()
    text = _text_model(model)      # a multimodal model's language model holds the LM head
    lp = getattr(text, "logits_processor", None)
    lm_head = getattr(text, "lm_head", None)
    first = next(model.parameters())
    info = {"model_class": type(model).__name__, "model_dtype": str(first.dtype).replace("torch.", ""),
            "lm_head_weight_dtype": str(lm_head.weight.dtype).replace("torch.", "") if lm_head is not None else None,
            "head_dtype": str(getattr(lp, "head_dtype", None)).replace("torch.", ""),
            "num_params": int(sum(p.numel() for p in model.parameters()))}
    if hasattr(text, "config"):
      hidden = text.config.hidden_size
    else:
      assert lm_head is not None, "a model without a config has its lm_head"
      hidden = lm_head.weight.shape[1]
    with torch.no_grad():
      h = torch.randn(2, hidden, dtype=first.dtype, device=first.device)
      logits = model.compute_logits(h)
    info["logits_dtype"] = str(logits.dtype).replace("torch.", "")
    return info

  def scalerl_param_digest(self, per_name: bool = False) -> str | dict[str, str]:
    """sha256 over every parameter and buffer of the served model (names + bytes, name order):
    equal digests = bit-identical weights (tests compare weight transports with it). With
    `per_name`, a {name: sha256} dict instead (to find which tensor differs)."""
    h = hashlib.sha256()
    model = self._scalerl_model()
    tensors = dict(model.named_parameters())
    tensors.update(dict(model.named_buffers()))
    each = {}
    for name in sorted(tensors):
      t = tensors[name].detach().contiguous().cpu()
      data = t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
      h.update(name.encode())
      h.update(data)
      if per_name:
        each[name] = hashlib.sha256(data).hexdigest()
    return each if per_name else h.hexdigest()

  def scalerl_set_head_dtype(self, dtype: str) -> str:
    """Test hook: switches the LM-head projection dtype at run time ("model" = the model dtype)."""
    model = self._scalerl_model()
    lp = _text_model(model).logits_processor
    lp.head_dtype = next(model.parameters()).dtype if dtype == "model" else _TORCH_DTYPES[dtype]
    return str(lp.head_dtype).replace("torch.", "")


_NAME_CACHE: dict[int, set[str] | None] = {}


def _repack_cpu_experts(model, prefixes) -> None:
  """Re-runs the CPU grouped-GEMM prepack of the routed experts whose weights this update loaded.

  vLLM 0.32's `UnquantizedFusedMoEMethod._setup_kernel` calls the experts' own
  `process_weights_after_loading` (for `CPUUnquantizedExperts`: `cpu_prepack_moe_weight`) only on
  the first load; on a weight update it only copies, so the layerwise reload leaves the new expert
  weights in checkpoint layout while the CPU kernel reads them as prepacked (measured on the tiny
  Llama-4: pushing the start weights again changed every expert tensor's bytes and the parity gate
  read mean |delta log-prob| 0.17). GPU backends shuffle inside `convert_to_unquantized_kernel_format`
  and are not touched here. tests/vllm/test_vllm_llama4.py checks that re-pushing the start weights
  restores bit-identical engine parameters."""
  if not prefixes:
    return
  for name, mod in model.named_modules():
    if not any(name == p + ".experts" or name.startswith(p + ".experts.") for p in prefixes):
      continue
    kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is not None and "CPUUnquantizedExperts" in type(experts).__name__ \
        and hasattr(mod, "w13_weight"):
      with torch.no_grad():
        experts.process_weights_after_loading(mod)


def _add_fused_expert_names(names: set, pname: str, param) -> bool:
  """vLLM's fused-MoE parameters (`experts[.routed_experts].w13_weight` [E, 2I, H], `.w2_weight`)
  take the HF checkpoint's fused expert tensors (`experts.gate_up_proj`, `experts.down_proj`, as
  Llama-4 ships them) or per-expert ones (`experts.{e}.gate_proj.weight`, ...)."""
  for suffix, fused, per_expert in ((".w13_weight", "gate_up_proj", ("gate_proj", "up_proj")),
                                    (".w2_weight", "down_proj", ("down_proj",))):
    if pname.endswith(suffix) and ".experts." in pname:
      # vLLM may nest the routed experts (Llama-4: `experts.routed_experts.w13_weight`).
      base = pname[:pname.index(".experts.")] + ".experts."
      names.add(base + fused)
      for e in range(int(param.shape[0])):
        names.update(f"{base}{e}.{w}.weight" for w in per_expert)
      return True
  return False


def _text_model(model) -> Any:
  """The module that holds the LM head and the text config: a multimodal model's language model
  (vLLM's `get_language_model()`, e.g. Llama-4 ForConditionalGeneration's `language_model`), else
  the model itself."""
  get = getattr(model, "get_language_model", None)
  return get() if callable(get) else model


def _hf_names(model) -> set[str] | None:
  """HF names the served model accepts, derived from vLLM's param names and stacking rules.

  Returns None when the model has no known stacking map (then vLLM's own loader validates)."""
  key = id(model)
  if key in _NAME_CACHE:
    return _NAME_CACHE[key]
  mapping = getattr(model, "packed_modules_mapping", None)
  names: set[str] | None = set()
  if mapping is None:
    names = None
  else:
    for pname, param in model.named_parameters():
      if _add_fused_expert_names(names, pname, param):
        continue
      parts = pname.split(".")
      hit = False
      for packed, subs in mapping.items():
        if packed in parts:
          i = parts.index(packed)
          for sub in subs:
            names.add(".".join(parts[:i] + [sub] + parts[i + 1:]))
          hit = True
      if not hit:
        names.add(pname)
    text = _text_model(model)
    if getattr(getattr(text, "config", None), "tie_word_embeddings", False):
      # accepted; vLLM's loader skips it for tied embeddings (under the language model's prefix)
      names.add(next(n + "." for n, m in model.named_modules() if m is text).lstrip(".")
                + "lm_head.weight")
  _NAME_CACHE[key] = names
  return names
