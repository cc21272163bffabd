"""HF safetensors in/out: export loads in transformers with matching logits; round trip is exact."""
import json
import os

import jax
import numpy as np
import pytest
import torch
import transformers

from scalerl_jax import models
from scalerl_jax.models import hf_io
from scalerl_jax.models.testing import hf_logits, random_hf_model, rel_err

_fwd = jax.jit(models.forward, static_argnums=1)


def _cfg(name, **kw):
  return models.get_preset(name, vocab_size=256, d_model=128, head_dim=32, ffn_dim=192,
                           expert_ffn_dim=64 if name == "tiny_llama4" else 0,
                           attention_chunk_size=16 if name == "tiny_llama4" else None, **kw)


def _assert_trees_identical(a, b):
  la, ta = jax.tree.flatten(a)
  lb, tb = jax.tree.flatten(b)
  assert ta == tb
  for x, y in zip(la, lb):
    x, y = np.asarray(x), np.asarray(y)
    assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y)


@pytest.mark.parametrize("name,scan,shard", [("tiny_llama3", False, None),
                                             ("tiny_llama4", True, 200_000)])
def test_export_roundtrip_and_hf_logits(tmp_path, name, scan, shard):
  cfg = _cfg(name, scan_layers=scan)
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(0)))
  models.save_hf(cfg, params, str(tmp_path), max_shard_bytes=shard)
  if shard:
    assert os.path.exists(tmp_path / hf_io.INDEX_FILE)
  cfg2, params2 = models.load_hf(str(tmp_path), scan_layers=scan)
  assert cfg2 == cfg
  _assert_trees_identical(params, params2)
  cls = transformers.LlamaForCausalLM if name == "tiny_llama3" else transformers.Llama4ForCausalLM
  hf = cls.from_pretrained(str(tmp_path), attn_implementation="eager").float().eval()
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 40))
  print(f"export rel_err {rel_err(np.asarray(_fwd(params, cfg, tokens)), hf_logits(hf, tokens)):.2e}")
  assert rel_err(np.asarray(_fwd(params, cfg, tokens)), hf_logits(hf, tokens)) <= 1e-4


def test_load_hf_save_pretrained_sharded(tmp_path):
  """A transformers save_pretrained (sharded, with index) loads into params giving HF logits."""
  cfg = _cfg("tiny_llama4", tie_embeddings=False)
  hf = random_hf_model(cfg, seed=3)
  hf.save_pretrained(str(tmp_path), max_shard_size="300KB")
  assert os.path.exists(tmp_path / hf_io.INDEX_FILE)
  cfg2, params = models.load_hf(str(tmp_path))
  tokens = np.random.RandomState(1).randint(0, cfg.vocab_size, (1, 40))
  assert rel_err(np.asarray(_fwd(params, cfg2, tokens)), hf_logits(hf, tokens)) <= 1e-4
  names = dict(models.hf_named_arrays(cfg2, params))
  sd = hf.state_dict()
  assert set(names) == set(sd)
  for k, v in names.items():
    np.testing.assert_array_equal(v, sd[k].numpy())


def test_bf16_export_roundtrip(tmp_path):
  cfg = _cfg("tiny_llama3", num_layers=1, param_dtype="bfloat16")
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(0)))
  models.save_hf(cfg, params, str(tmp_path))
  _, params2 = models.load_hf(str(tmp_path), param_dtype="bfloat16")
  _assert_trees_identical(params, params2)
  hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path))
  assert hf.model.embed_tokens.weight.dtype == torch.bfloat16


def test_errors(tmp_path):
  with pytest.raises(FileNotFoundError):
    models.load_hf(str(tmp_path / "missing"))
  with pytest.raises(FileNotFoundError, match="config.json"):
    models.load_hf(str(tmp_path))
  cfg = _cfg("tiny_llama3", num_layers=1)
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(0)))
  models.save_hf(cfg, params, str(tmp_path))
  # Missing tensor.
  st = hf_io.SafetensorsDir(str(tmp_path))
  tensors = {k: np.array(st.get(k)) for k in st.keys()}
  bad = dict(tensors)
  bad.pop("model.layers.0.mlp.up_proj.weight")
  hf_io.write_safetensors(str(tmp_path / hf_io.SINGLE_FILE), bad)
  with pytest.raises(ValueError, match="up_proj.weight.*missing"):
    models.load_hf(str(tmp_path))
  # Shape mismatch.
  bad = dict(tensors)
  bad["model.norm.weight"] = np.ones((7,), np.float32)
  hf_io.write_safetensors(str(tmp_path / hf_io.SINGLE_FILE), bad)
  with pytest.raises(ValueError, match="shape"):
    models.load_hf(str(tmp_path))
  # No weights file.
  os.remove(tmp_path / hf_io.SINGLE_FILE)
  with pytest.raises(FileNotFoundError, match="safetensors"):
    models.load_hf(str(tmp_path))
  # Unsupported architecture.
  with open(tmp_path / "config.json") as f:
    d = json.load(f)
  d["model_type"] = "gpt2"
  with pytest.raises(ValueError, match="unsupported HF model_type"):
    models.from_hf_config(d)
