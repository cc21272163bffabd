"""Log-prob parity gate between the vLLM generator and a float32 reference learner (JAX venv).

* `make_tiny_llama(dir)`: a random tiny Llama-3 HF checkpoint (the `tiny_llama3` shape: vocab 512,
  d 256, 4 layers, 4 heads, 2 KV heads, head_dim 64, ffn 768), safetensors; nothing is downloaded.
* `reference_logprobs(...)`: teacher-forced per-token log-probs of completions under the reference
  learner at temperature T (log_softmax(logits / T), float32 logits) -- exactly the π_train side of
  the IS ratio. Backend: the project's JAX model (`scalerl_jax.models`) when it provides
  `load_hf` + `forward`, else HF transformers in torch float32.
* `parity_stats(gen_lp, ref_lp)`: per-token |Δ log-prob| mean/max and KL(π_gen || π_ref) estimates
  from the generator's own samples (k1 = E[log π_gen − log π_ref], k3 = E[r − 1 − log r] with
  r = π_ref/π_gen, unbiased and >= 0).

Run `python -m scalerl_jax.generation.vllm.parity` for the full report (fp32 and bf16 engines).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import tempfile
from typing import Sequence

import numpy as np
from safetensors.numpy import load_file

from scalerl_jax import lazy
from scalerl_jax.generation.vllm.generator import VLLMGenerator
from scalerl_jax.rl.mismatch import parity_stats  # the statistics live in the RL library (the learner's gate reads them too)
from scalerl_jax.types import PromptSpec, SamplingSpec

# Deferred to first use: torch / transformers only on the HF reference path (the learner imports
# parity_stats from rl/mismatch.py), JAX only on the JAX reference path (the vLLM venv has none).
torch = lazy.module("torch")
transformers = lazy.module("transformers")
jax = lazy.module("jax")

TINY_LLAMA3 = dict(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
                   tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def make_tiny_llama(path: str | os.PathLike, seed: int = 0, lm_head_std: float = 0.15,
                    **overrides) -> str:
  """Writes a random tiny Llama HF checkpoint to `path` and returns it.

  `lm_head_std` makes the next-token distribution peaked enough for log-prob errors to matter
  (with HF's default 0.02 the tiny model is nearly uniform over the vocab)."""
  torch.manual_seed(seed)
  cfg = transformers.LlamaConfig(**{**TINY_LLAMA3, **overrides})
  model = transformers.LlamaForCausalLM(cfg)
  with torch.no_grad():
    model.lm_head.weight.normal_(0.0, lm_head_std)
  model.save_pretrained(str(path), safe_serialization=True)
  return str(path)


def load_hf_arrays(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of an HF safetensors checkpoint as float32 numpy arrays, HF names."""
  out = {}
  for f in sorted(pathlib.Path(path).glob("*.safetensors")):
    out.update({k: np.asarray(v, np.float32) for k, v in load_file(str(f)).items()})
  return out


def _jax_backend():
  try:
    from scalerl_jax import models  # local: probes for JAX (the vLLM venv has none)
  except ImportError:       # the vLLM venv has no JAX
    return None
  return models


def reference_backend() -> str:
  """'jax' (scalerl_jax.models, float32) when available, else 'hf-torch-fp32'."""
  return "jax" if _jax_backend() is not None else "hf-torch-fp32"


def _pad(seqs: list[np.ndarray]) -> np.ndarray:
  """Right-pads to one [B, T] batch (causal model: padding after a position never affects it)."""
  T = max(len(s) for s in seqs)
  out = np.zeros((len(seqs), T), np.int32)
  for i, s in enumerate(seqs):
    out[i, :len(s)] = s
  return out


def reference_logprobs(model_dir: str | os.PathLike, prompts: Sequence[np.ndarray],
                       completions: Sequence[np.ndarray], temperature: float = 1.0,
                       backend: str = "auto") -> list[np.ndarray]:
  """Per-token log π_ref(y_t | prefix) = log_softmax(logits / T)[y_t], float32 logits, for each
  (prompt, completion) pair, under the checkpoint in `model_dir` run entirely in float32."""
  backend = reference_backend() if backend == "auto" else backend
  seqs = [np.concatenate([np.asarray(p, np.int32), np.asarray(c, np.int32)]).astype(np.int32)
          for p, c in zip(prompts, completions)]
  batch = _pad(seqs)
  T = max(temperature, 1e-6)
  if backend == "jax":
    models = _jax_backend()
    if models is None:
      raise RuntimeError("backend 'jax' needs JAX, which this venv does not have")
    cfg, params = models.load_hf(str(model_dir), dtype="float32", param_dtype="float32")
    logits = jax.jit(models.forward, static_argnums=1)(params, cfg, batch)
    lp = np.asarray(jax.nn.log_softmax(logits.astype("float32") / T, axis=-1))
  elif backend == "hf-torch-fp32":
    model = transformers.LlamaForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
      logits = model(torch.from_numpy(batch.astype(np.int64))).logits.float()
      lp = torch.log_softmax(logits / T, dim=-1).numpy()
  else:
    raise ValueError(f"unknown reference backend {backend!r}")
  out = []
  for i, (p, s) in enumerate(zip(prompts, seqs)):
    pos = np.arange(len(p) - 1, len(s) - 1)
    out.append(lp[i, pos, s[len(p):]].astype(np.float32))
  return out


def run_gate(gen, model_dir, spec, prompts, n: int, backend: str = "auto") -> dict:
  """Samples with `gen` and compares against the reference; returns stats (+ the raw groups)."""
  groups = gen.generate(prompts, n, spec)
  ps, cs, lps, ms = [], [], [], []
  for p, grp in zip(prompts, groups):
    for c in grp:
      ps.append(p.tokens); cs.append(c.tokens); lps.append(c.logprobs); ms.append(c.policy_mask)
  ref = reference_logprobs(model_dir, ps, cs, spec.temperature, backend=backend)
  return {**parity_stats(lps, ref, ms), "groups": groups}


def main(argv=None) -> None:
  """Parity report for each engine dtype x LM-head dtype (run in the JAX venv)."""
  ap = argparse.ArgumentParser(description="vLLM vs reference log-prob parity")
  ap.add_argument("--engine-dtypes", default="bfloat16,float32")
  ap.add_argument("--head-dtypes", default="float32,bfloat16")
  ap.add_argument("--temperature", type=float, default=1.0)
  args = ap.parse_args(argv)
  d = make_tiny_llama(os.path.join(tempfile.mkdtemp(), "tiny"))
  rng = np.random.default_rng(0)
  prompts = [PromptSpec(i, rng.integers(3, 512, 8).astype(np.int32)) for i in range(8)]
  spec = SamplingSpec(temperature=args.temperature, think_budget_min=64, think_budget_max=64,
                      answer_budget=0)
  report = {"reference": reference_backend(), "tokens_per_run": 8 * 4 * 64}
  for dtype in args.engine_dtypes.split(","):
    with VLLMGenerator(d, dtype=dtype, enforce_eager=True, max_model_len=512) as gen:
      for head in args.head_dtypes.split(","):
        gen.set_head_dtype(head)
        res = run_gate(gen, d, spec, prompts, n=4)
        res.pop("groups")
        key = f"engine={dtype},head={head}"
        report[key] = res
        print(json.dumps({key: res}), flush=True)
  print(json.dumps(report))


if __name__ == "__main__":
  main()
