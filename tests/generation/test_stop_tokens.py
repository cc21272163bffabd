"""Issue 46: every eos id a checkpoint lists stops generation (config.json + generation_config.json),
beside END_OF_TURN, and the HF export writes the list back.

A miniature checkpoint (Llama-3-style tokenizer, 1-layer random Llama) whose config.json lists
<|end_of_text|>, <|eot_id|> and whose generation_config.json lists <|end_of_text|>, <|eom_id|>,
<|eot_id|>: <|eom_id|> is in no END_OF_TURN entry (Llama-3.1's tool-call end of message), so
before this change nothing stopped at it. Both samplers take the dataset's stop list through the
SamplingSpec (the JAX sampler's stop set; vLLM's `stop_token_ids` with `ignore_eos`).
"""
import dataclasses
import json

import jax
import pytest

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.data import build_dataset
from scalerl_jax.data.hf_tokenizer import END_OF_TURN, HFTokenizer, checkpoint_eos_ids
from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.types import FINISH_LENGTH, FINISH_STOP, SamplingSpec
from tests.helpers import forcing_weights


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  d = tmp_path_factory.mktemp("ckpt")
  tok = HFTokenizer(write_llama3_style_tokenizer(str(d), vocab_size=512))
  ids = {t: tok.tok.convert_tokens_to_ids(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
  cfg = models.ModelConfig(vocab_size=512, d_model=64, num_layers=1, num_heads=1, num_kv_heads=1,
                           head_dim=64, ffn_dim=128, max_position_embeddings=256,
                           bos_token_id=tok.bos_id, eos_token_id=ids["<|end_of_text|>"])
  params = jax.device_get(models.init_params(cfg, jax.random.PRNGKey(0)))
  models.save_hf(cfg, params, str(d))
  c = json.loads((d / "config.json").read_text())
  c["eos_token_id"] = [ids["<|end_of_text|>"], ids["<|eot_id|>"]]
  (d / "config.json").write_text(json.dumps(c))
  (d / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]}))
  return d, ids


def test_every_listed_eos_id_is_a_stop_token_and_the_export_writes_the_list(ckpt, tmp_path):
  d, ids = ckpt
  assert "<|eom_id|>" not in END_OF_TURN
  want = (ids["<|end_of_text|>"], ids["<|eot_id|>"], ids["<|eom_id|>"])
  assert checkpoint_eos_ids(str(d)) == want
  cfg, params = models.load_hf(str(d))
  assert cfg.eos_token_ids == want and cfg.eos_token_id == want[0]
  models.save_hf(cfg, params, str(tmp_path / "export"))
  out = json.loads((tmp_path / "export" / "config.json").read_text())
  gen = json.loads((tmp_path / "export" / "generation_config.json").read_text())
  assert out["eos_token_id"] == list(want) and gen["eos_token_id"] == list(want)
  assert models.load_hf(str(tmp_path / "export"))[0].eos_token_ids == want
  # the dataset's stop list: the tokenizer's eos, every listed id, END_OF_TURN's present ones
  rows = tmp_path / "m.jsonl"
  rows.write_text(json.dumps({"problem": "What is 1 + 2?", "answer": "3"}) + "\n" +
                  json.dumps({"problem": "What is 2 + 2?", "answer": "4"}) + "\n")
  data = dataclasses.replace(common.Data(), kind="polaris", path=str(rows), tokenizer_path=str(d),
                             heldout=0)
  ds = build_dataset(data, max_prompt_len=96)
  assert set(want) <= set(ds.stop_tokens), ds.stop_tokens


def test_the_jax_sampler_stops_at_an_eos_id_outside_end_of_turn(ckpt, tmp_path):
  d, ids = ckpt
  cfg, params = models.load_hf(str(d))
  rows = tmp_path / "m.jsonl"
  rows.write_text(json.dumps({"problem": "What is 1 + 2?", "answer": "3"}) + "\n")
  data = dataclasses.replace(common.Data(), kind="polaris", path=str(rows), tokenizer_path=str(d),
                             heldout=0)
  ds = build_dataset(data, max_prompt_len=96)
  sampler = JaxSampler(cfg, params)
  sampler.load_weights(forcing_weights(dict(models.hf_named_arrays(cfg, params)),
                                       ids["<|eom_id|>"]), 1)
  spec = SamplingSpec(stop_tokens=ds.stop_tokens, think_budget_min=0, think_budget_max=0,
                      answer_budget=8, seed=0)
  for c in sampler.generate(ds.train[:1], 2, spec)[0]:
    assert list(c.tokens) == [ids["<|eom_id|>"]] and c.finish_reason == FINISH_STOP, c
  # control: without the checkpoint's list (eos + END_OF_TURN only) it runs to its budget
  old = tuple(t for t in ds.stop_tokens if t != ids["<|eom_id|>"])
  for c in sampler.generate(ds.train[:1], 1, dataclasses.replace(spec, stop_tokens=old))[0]:
    assert len(c.tokens) >= 8 and set(c.tokens) == {ids["<|eom_id|>"]} and c.finish_reason == FINISH_LENGTH, c
