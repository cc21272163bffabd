"""Test helpers: random tiny HF reference models (needs torch + transformers; nothing downloaded)."""
from __future__ import annotations

import numpy as np

from scalerl_jax import lazy
from scalerl_jax.models import families
from scalerl_jax.models.config import ModelConfig, to_hf_config
from scalerl_jax.models.hf_io import params_from_hf_tensors

# torch + transformers (the HF reference) load at first use: tests that need only rel_err skip them.
torch = lazy.module("torch")
transformers = lazy.module("transformers")


def random_hf_model(cfg: ModelConfig, seed: int = 0, std: float = 0.02):
  """Builds a random float32 HF LlamaForCausalLM / Llama4ForCausalLM matching `cfg` (eval mode).

  Norm weights are randomized too (1 + noise) so a wrong norm mapping cannot hide.
  """
  torch.manual_seed(seed)
  hf_cfg = to_hf_config(cfg)
  hf_cfg._attn_implementation = "eager"
  cls = getattr(transformers, families.get(cfg.family).hf_model_class)
  model = cls(hf_cfg).float().eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith("norm.weight"):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(std * torch.randn_like(p))
  return model


def params_from_torch(cfg: ModelConfig, model) -> dict:
  """Our params (numpy) from a torch HF model's state_dict."""
  sd = {k: v.detach().float().cpu().numpy() for k, v in model.state_dict().items()}
  if cfg.tie_embeddings:
    sd.pop("lm_head.weight", None)

  def get(name):
    if name not in sd:
      raise ValueError(f"tensor {name!r} missing from state_dict")
    return sd[name]
  return params_from_hf_tensors(cfg, get)


def hf_logits(model, tokens: np.ndarray, attention_mask: np.ndarray | None = None) -> np.ndarray:
  """float32 logits [B,T,V] of a torch HF model on int tokens [B,T]."""
  with torch.no_grad():
    kw = {}
    if attention_mask is not None:
      kw["attention_mask"] = torch.as_tensor(attention_mask, dtype=torch.long)
    out = model(input_ids=torch.as_tensor(np.asarray(tokens), dtype=torch.long), **kw)
  return out.logits.float().numpy()


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
  """max |a-b| / max |b|."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
