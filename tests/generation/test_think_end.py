"""Where thinking ends (generation/interruption.py's rule, shared by the JAX sampler and the vLLM
worker) with a tokenizer that writes `</think>` in several tokens (Llama-3-style byte-level BPE:
"</", "think", ">", and ">\\n" when a newline follows).

The sampler tests script the model's logits (models.prefill / decode_step patched to put all mass
on the next token of a fixed stream), so the token stream is forced, not sampled by chance; they
run on a model config of their own, so no other test shares their jit traces.
"""
import asyncio
import types

import jax.numpy as jnp
import numpy as np
import pytest

from scalerl_jax import models
from scalerl_jax.types import FINISH_INTERRUPTED, FINISH_LENGTH, PromptSpec, SamplingSpec

pytestmark = pytest.mark.xdist_group("think_end")

VOCAB = 512
# An early "</" (and "</" inside "x</y") long before the real "</think>".
EARLY = "Compare a </ b and x</y. So it is 7."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
  from scalerl_jax.data.hf_tokenizer import HFTokenizer
  from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer
  return HFTokenizer(write_llama3_style_tokenizer(str(tmp_path_factory.mktemp("l3")), VOCAB))


def _text_rule(tok):
  from scalerl_jax.generation.interruption import think_end_vocab
  return dict(think_end_tokens=tok.think_end_ids, think_end_text="</think>",
              think_end_vocab=think_end_vocab(tok.vocab_texts, "</think>"))


def test_tokenizer_splits_think_end(tok):
  # The premise: "</think>" is three tokens, and ">" merges with a following newline.
  assert [tok.decode([i]) for i in tok.think_end_ids] == ["</", "think", ">"]
  assert [tok.decode([i]) for i in tok.encode("</think>\n\nThe")][:4] == ["</", "think", ">\n", "\n"]
  assert tok.encode(EARLY).count(tok.think_end_ids[0]) == 2


@pytest.mark.parametrize("tail", [" The answer is 7.", "\n\nThe answer is 7."])
def test_rule_ends_at_the_real_think_end(tok, tail):
  from scalerl_jax.generation.interruption import think_end_automaton
  ids = tok.encode(EARLY + "\n</think>" + tail)
  end = think_end_automaton(**_text_rule(tok)).end_index(ids)
  assert tok.decode(ids[:end]) == EARLY + "\n</think>" + ("\n" if tail[0] == "\n" else "")
  assert end == 24 and tok.decode(ids[end - 3:end - 2]) == "</"   # not 7 (the first "</")
  # Id mode (the exact sequence encode("</think>")) finds the unmerged case only.
  exact = think_end_automaton(tok.think_end_ids).end_index(ids)
  assert exact == (end if tail[0] == " " else -1)


def test_rule_any_split_and_no_false_end(tok):
  from scalerl_jax.generation.interruption import think_end_automaton
  rule = think_end_automaton(**_text_rule(tok))
  # Non-canonical splits still end it, at the token that completes the text.
  t = tok.tok.convert_tokens_to_ids
  assert rule.end_index([t("<"), t("/"), t("th"), t("ink"), t(">Ċ"), t("x")]) == 5
  assert rule.end_index([t("<"), t("</"), t("think"), t(">")]) == 4
  # Partial matches and "</" alone never end it.
  for s in ["</", "</thin", "</ think>", "a </ b </th ink>", "<think>", "</thinking"]:
    assert rule.end_index(tok.encode(s)) == -1, s
  # The rule's vocabulary: only tokens that can start, continue or finish "</think>".
  texts = {w for _, w in _text_rule(tok)["think_end_vocab"]}
  assert {"</", "think", ">", ">\n"} <= texts and "The" not in texts and len(texts) == 14


def test_single_token_think_end_unchanged(tmp_path):
  """The tiny word-level tokenizer (one special `</think>` token): text mode, id mode and the old
  single-id comparison all end thinking at the first `</think>` id."""
  from scalerl_jax.data.hf_tokenizer import HFTokenizer
  from scalerl_jax.data.tiny_hf_tokenizer import write_tiny_tokenizer
  from scalerl_jax.generation.interruption import think_end_automaton, think_end_vocab
  t = HFTokenizer(write_tiny_tokenizer(str(tmp_path / "tiny")))
  (end_id,) = t.think_end_ids
  text = think_end_automaton(t.think_end_ids, "</think>", think_end_vocab(t.vocab_texts))
  exact = think_end_automaton(t.think_end_ids)
  assert end_id in text.ids
  rng = np.random.default_rng(0)
  for _ in range(200):
    s = rng.integers(0, len(t.vocab_texts), size=30)
    first = int(np.argmax(s == end_id)) + 1 if (s == end_id).any() else -1
    assert text.end_index(s) == exact.end_index(s) == first


def test_sampling_spec_uses_text_mode_for_hf_tokenizers(tok):
  from scalerl_jax.config import base_config
  from scalerl_jax.generation import interruption
  ds = types.SimpleNamespace(tokenizer=tok, stop_tokens=(tok.eos_id,),
                             think_end_tokens=tok.think_end_ids,
                             interruption_tokens=lambda text: tuple(tok.encode(text)))
  spec = interruption.sampling_spec(base_config(), ds, seed=0)
  assert spec.think_end_text == "</think>"
  assert spec.think_end_vocab == _text_rule(tok)["think_end_vocab"]
  # A tokenizer without vocab_texts (the built-in tasks): id mode.
  ds.tokenizer = types.SimpleNamespace(encode=tok.encode)
  spec = interruption.sampling_spec(base_config(), ds, seed=0)
  assert spec.think_end_text == "" and spec.think_end_vocab == ()


# ---- the jitted sampler on a forced token stream ------------------------------------------------
@pytest.fixture
def scripted(monkeypatch):
  """A JaxSampler whose model emits `stream` token by token (all probability on the next one)."""
  from scalerl_jax.generation.sampler import JaxSampler
  cfg = models.get_preset("tiny_llama3", vocab_size=VOCAB, num_layers=1, d_model=24, ffn_dim=32,
                          num_heads=2, num_kv_heads=1, head_dim=12, dtype="float32")

  def onehot(script, i, shape):
    nxt = script[jnp.minimum(i, script.shape[0] - 1)]
    return jnp.where(jnp.arange(VOCAB) == nxt, 0.0, -1e9) * jnp.ones(shape + (VOCAB,))

  def prefill(params, cfg, tokens, cache, mask=None, **kw):
    B, P = tokens.shape
    return onehot(params["script"], 0, (B, P)), dict(cache, index=jnp.zeros((), jnp.int32))

  def decode_step(params, cfg, token, cache, **kw):
    i = cache["index"] + 1
    return onehot(params["script"], i, (token.shape[0],)), dict(cache, index=i)

  monkeypatch.setattr(models, "prefill", prefill)
  monkeypatch.setattr(models, "decode_step", decode_step)
  return lambda stream: JaxSampler(cfg, {"script": jnp.asarray(stream, jnp.int32)}, chunk_steps=8)


def _spec(tok, budget, rule):
  inj = tuple(tok.encode(" Okay, time is up. </think>"))
  return inj, SamplingSpec(think_budget_min=budget, think_budget_max=budget, answer_budget=4,
                           interruption_tokens=inj, stop_tokens=(tok.eos_id,), **rule)


@pytest.mark.parametrize("mode", ["id", "text"])
def test_sampler_ends_thinking_only_at_the_real_think_end(tok, scripted, mode):
  """Unmerged "</think> The": both modes end at the real `</think>`, not at the early "</"."""
  stream = tok.encode(EARLY + "\n</think> The answer is 7 indeed.")
  end = stream.index(tok.think_end_ids[1]) + 2          # just past "</", "think", ">"
  assert end == 24 and stream[:end].count(tok.think_end_ids[0]) == 3
  rule = _text_rule(tok) if mode == "text" else dict(think_end_tokens=tok.think_end_ids)
  sampler = scripted(stream)
  # Budget covers the real </think>: natural end, then exactly answer_budget = 4 more tokens.
  _, spec = _spec(tok, 30, rule)
  (c,), = sampler.generate([PromptSpec(0, np.array(tok.encode("Q"), np.int32))], 1, spec)
  assert c.finish_reason == FINISH_LENGTH and c.policy_mask.all()
  assert c.tokens.tolist() == stream[:end + 4]
  # Budget ends before it (after the early "</"s): interrupted at token 14, injection, 4 answers.
  inj, spec = _spec(tok, 14, rule)
  (c,), = sampler.generate([PromptSpec(0, np.array(tok.encode("Q"), np.int32))], 1, spec)
  assert c.finish_reason == FINISH_INTERRUPTED
  assert c.tokens[:14].tolist() == stream[:14] and c.tokens[14:14 + len(inj)].tolist() == list(inj)
  assert len(c.tokens) == 14 + len(inj) + 4 and (~c.policy_mask).sum() == len(inj)


def test_sampler_merged_newline_think_end(tok, scripted):
  """"</think>\\n\\n": the last token is ">\\n"; text mode ends thinking there."""
  stream = tok.encode(EARLY + "\n</think>\n\nThe answer is 7 indeed.")
  end = stream.index(tok.think_end_ids[1]) + 2
  assert tok.decode(stream[end - 1:end]) == ">\n"
  _, spec = _spec(tok, 30, _text_rule(tok))
  (c,), = scripted(stream).generate([PromptSpec(0, np.array(tok.encode("Q"), np.int32))], 1, spec)
  assert c.finish_reason == FINISH_LENGTH and c.policy_mask.all()
  assert c.tokens.tolist() == stream[:end + 4]


# ---- the vLLM worker's use of the same rule (engine replaced by the scripted stream) ------------
@pytest.mark.parametrize("merged", [False, True])
def test_vllm_worker_uses_the_same_rule(tok, merged):
  import dataclasses
  from scalerl_jax.generation.vllm.worker import DEFAULTS, Worker
  stream = tok.encode(EARLY + "\n</think>" + ("\n\n" if merged else " ") + "The answer is 7 indeed.")
  end = stream.index(tok.think_end_ids[1]) + 2
  prompt = tok.encode("Q")

  async def run(self, p, max_tokens, spec, seed):   # the engine: the stream after the prefix
    k = len(p) - len(prompt)
    out = stream[k:k + int(max_tokens)]
    return {"tokens": out, "logprobs": [-0.5] * len(out), "versions": [0] * len(out),
            "finish": "length"}

  w = Worker.__new__(Worker)
  w.cfg, w.version = {**DEFAULTS, "max_model_len": 4096}, 0
  w._run = types.MethodType(run, w)
  inj, spec = _spec(tok, 30, _text_rule(tok))
  header = {"spec": dataclasses.asdict(spec), "n": 1, "prompt_ids": [0]}
  arrays = {"prompt_lens": np.array([len(prompt)]), "prompt_tokens": np.array(prompt)}
  meta, out = asyncio.run(w.generate(header, arrays))
  # Thinking ended at the real </think> (not interrupted); the answer keeps answer_budget = 4
  # tokens (the think request ran to its budget, 30: the 2 extra are cut, as the sampler stops).
  assert meta["completions"][0]["finish_reason"] == FINISH_LENGTH
  assert out["tokens"].tolist() == stream[:end + 4] and out["policy_mask"].all()
  assert len(out["logprobs"]) == len(out["versions"]) == end + 4
