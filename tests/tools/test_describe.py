"""describe: parameter counts via jax.eval_shape, checked against HF models built on torch 'meta'."""
import json
import os
import subprocess
import sys

import torch
import transformers

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.tools import describe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _hf_count(cfg, multimodal=False):
  with torch.device("meta"):  # no memory allocated
    if multimodal:
      m = transformers.Llama4ForConditionalGeneration(
          transformers.Llama4Config(text_config=models.to_hf_config(cfg).to_dict()))
    else:
      cls = transformers.LlamaForCausalLM if cfg.family == "llama3" else transformers.Llama4ForCausalLM
      m = cls(models.to_hf_config(cfg))
    return sum(p.numel() for p in m.parameters())


def _config(preset):
  c = common.base_config()
  c.model.preset = preset
  return c


def test_8b_counts():
  d = describe.describe(_config("llama3_8b"))
  assert abs(d["params_total"] / 8.03e9 - 1) <= 0.005
  assert d["params_total"] == d["params_active"] == _hf_count(models.get_preset("llama3_8b"))
  assert d["params_total"] == 8_030_261_248  # Llama-3.1-8B


def test_scout_counts():
  d = describe.describe(_config("llama4_scout_17b_16e"))
  cfg = models.get_preset("llama4_scout_17b_16e")
  # Exact against HF's text decoder (Llama4ForCausalLM), which is what we model.
  assert d["params_total"] == _hf_count(cfg) == 107_769_861_120
  # "109B" is the multimodal checkpoint (text + vision tower, which we do not build):
  assert abs(_hf_count(cfg, multimodal=True) / 109e9 - 1) <= 0.01
  assert abs(d["params_total"] / 109e9 - 1) <= 0.012    # text-only: -1.13 %
  # Active per token: attention + shared expert + 1 of 16 routed experts + embedding + LM head.
  routed_per_layer = 3 * 5120 * 8192
  assert d["params_active"] == d["params_total"] - 48 * 15 * routed_per_layer
  assert abs(d["params_active"] / 17e9 - 1) <= 0.011   # 17.17e9: +1.02 %


def test_cli_prints_one_json_object():
  out = subprocess.run([sys.executable, "-m", "scalerl_jax.tools.describe",
                        "--config=configs/tiny.py"], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  d = json.loads(out.stdout.strip().splitlines()[-1])
  # configs/tiny.py overrides the tiny_llama3 preset's widths (vocab 32, d 128, 2 heads, ...).
  from configs import tiny
  from scalerl_jax.models import sections as model_sections
  cfg = model_sections.model_config(tiny.get_config())
  assert cfg.d_model == 128 and cfg.vocab_size == 32
  assert d["params_total"] == d["params_active"] == _hf_count(cfg)
