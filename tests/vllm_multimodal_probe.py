"""Runs in the vLLM venv (tests/vllm/test_vllm_multimodal.py starts it; PYTHONPATH = the repo +
tests/vllm_mm_shim): vLLM's own Llama4ForConditionalGeneration, built on CPU from a checkpoint
with images on (vision tower and projector included) and not served, against the names our push
sends; and where vLLM's configs put the LM-head dtype of a multimodal model.

argv: checkpoint dir, .npz of the pushed {HF name: array}. Prints one JSON line."""
# vllm is installed in .venv-vllm only (this script runs there); the type check runs in .venv.
# pyright: reportMissingImports=false
import json
import socket
import sys

import numpy as np
import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import initialize_model

from scalerl_jax.generation.vllm import ext
from scalerl_jax.generation.vllm.worker import head_dtype_overrides


def head_dtypes(ckpt: str) -> dict:
  """[engine, text model] head dtype of a bfloat16 engine, with a top-level override and ours."""
  out = {}
  for k, ov in (("top", {"head_dtype": "float32"}), ("ours", head_dtype_overrides(ckpt, "float32"))):
    mc = ModelConfig(model=ckpt, dtype="bfloat16", hf_overrides=ov, limit_mm_per_prompt={"image": 0})
    text = VllmConfig(model_config=mc).with_hf_config(mc.hf_config.text_config, ["LlamaForCausalLM"])
    out[k] = [str(mc.head_dtype), str(text.model_config.head_dtype)]
  return out


def build(ckpt: str):
  """vLLM's model class for `ckpt`, initialized on CPU (float32, images on), weights not loaded."""
  vc = VllmConfig(model_config=ModelConfig(model=ckpt, dtype="float32",
                                           limit_mm_per_prompt={"image": 1}))
  s = socket.socket()
  s.bind(("127.0.0.1", 0))
  port = s.getsockname()[1]
  s.close()
  with set_current_vllm_config(vc):
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(1, 1)
    return initialize_model(vllm_config=vc)


def main() -> None:
  ckpt, npz = sys.argv[1], sys.argv[2]
  out = {"head": head_dtypes(ckpt)}
  pushed = dict(np.load(npz))
  model = build(ckpt)
  params = dict(model.named_parameters())
  worker = ext.ScaleRLWorkerExtension()       # what vLLM's worker runs for `weights_check`
  worker.model_runner = type("Runner", (), {"get_model": lambda self: model})()
  check = worker.scalerl_check_names(list(pushed))
  mapping = check["map"]
  out.update(model_class=type(model).__name__, unknown=check["unknown"],
             tops=sorted({k.split(".")[0] for k in params}),
             vision_layer_params=sum(k.startswith("vision_model.model.layers.") for k in params),
             mapped_all=set(mapping) == set(pushed),
             prefixes=sorted({v[:-len(k)] for k, v in mapping.items()}))
  out["wrong_prefix_unknown"] = len(
      worker.scalerl_check_names(["text_model." + n for n in pushed])["unknown"])
  # Load what the push sends, under the mapped names, with vLLM's own loader (it asserts each
  # tensor's shape against the parameter it lands in).
  # vLLM allocates parameters uninitialized (NaNs possible): fill a marker value first.
  with torch.no_grad():
    for p in params.values():
      p.fill_(-7.0)
    loaded = model.load_weights((mapping.get(n, n), torch.from_numpy(a)) for n, a in pushed.items())
  text = {k for k in params if k.startswith("language_model.")}
  out["loaded_all_text"] = set(loaded) == text
  out["others_changed"] = sorted(k for k in params if k not in text and not bool((params[k] == -7.0).all()))
  out["others"] = sum(k not in text for k in params)
  lm = "language_model."
  same = {"embed": "model.embed_tokens.weight", "lm_head": "lm_head.weight",
          "o_proj": "model.layers.0.self_attn.o_proj.weight"}   # (fused q/k/v: permuted by vLLM)
  out["values"] = {k: torch.equal(params[lm + n], torch.from_numpy(pushed[n])) for k, n in same.items()}
  print(json.dumps(out))


if __name__ == "__main__":
  main()
