"""The synthetic task: tokenizer, split, SFT traces, verifier and the numeric design check."""
import numpy as np
import pytest

from configs import tiny
from scalerl_jax.data import build_dataset, synthetic as syn
from scalerl_jax.data import synthetic_proxy


def test_vocab_and_roundtrip():
  tok = syn.TOKENIZER
  assert tok.vocab_size == syn.VOCAB_SIZE == 32 <= 512
  assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
  text = "<bos> sum 3 7 2 = <think> 3 0 2 </think> 2 <eos>"
  assert tok.decode(tok.encode(text)) == text
  assert tok.encode("307") == tok.encode("3 0 7")
  assert tok.decode([5, 999]) == "</think> <unk:999>"
  with pytest.raises(ValueError, match="unknown word 'hello'"):
    tok.encode("sum hello")


def test_interruption_phrase_tokens_match_config():
  text = tiny.get_config().rollout.interruption_text
  ids = syn.TOKENIZER.encode(text)
  assert ids == syn.TOKENIZER.interruption_ids
  assert len(ids) == 15 and ids[-1] == syn.TOKENIZER.end_think_id
  assert syn.TOKENIZER.decode(ids) == text


def test_problem_format():
  p = syn.Problem(prompt_id=3, terms=(3, 7, 2, 5, 4, 1, 8, 0))
  assert p.partial_sums == (3, 0, 2, 7, 1, 2, 0, 0)
  assert p.answer == "0"
  assert p.prompt_text == "<bos> sum 3 7 2 5 4 1 8 0 = <think>"
  assert p.gold_completion_text == "3 0 2 7 1 2 0 0 </think> 0 <eos>"
  assert len(p.prompt_tokens) == 12 and p.prompt_tokens.dtype == np.int32
  spec = p.to_prompt_spec()
  assert spec.prompt_id == 3 and spec.answer == "0"


def test_split_is_fixed_and_disjoint():
  train, held = syn.make_split(0, n_train=3000, n_heldout=64)
  assert len(train) == 3000 and len(held) == 64
  assert not {p.terms for p in train} & {p.terms for p in held}
  assert len({p.terms for p in train}) == 3000
  assert len({p.prompt_id for p in train + held}) == 3064
  # held-out does not depend on n_train; same seed -> same problems; other seed -> different
  _, held2 = syn.make_split(0, n_train=10, n_heldout=64)
  assert [p.terms for p in held] == [p.terms for p in held2]
  _, held3 = syn.make_split(1, n_train=10, n_heldout=64)
  assert [p.terms for p in held] != [p.terms for p in held3]
  assert all(p.prompt_id >= syn.HELDOUT_ID_OFFSET for p in held)
  # variable number of terms
  train, _ = syn.make_split(0, n_train=200, n_heldout=8, num_terms=(4, 10))
  assert {len(p.terms) for p in train} == set(range(4, 11))


def test_reward():
  r = syn.reward
  assert r("3 0 2 </think> 2 <eos>", "2") == 1.0
  assert r("3 0 2 </think> 2", "2") == 1.0                 # answer budget ran out right after
  assert r("3 0 2 </think> 2 <eos> 7 7", "2") == 1.0       # text after eos is ignored
  assert r("3 0 2 </think> 3 <eos>", "2") == 0.0
  assert r("3 0 2 </think> 2 2 <eos>", "2") == 0.0         # junk in the answer
  assert r("3 0 2 2 <eos>", "2") == 0.0                    # no </think>
  assert r("3 </think> 1 " + syn.INTERRUPTION_TEXT + " 2 <eos>", "2") == 1.0   # last </think> wins
  ids = syn.TOKENIZER.encode("3 0 2 </think> 2 <eos> <pad> <pad>")
  assert r(ids, "2") == 1.0 and r(np.asarray(ids), "5") == 0.0
  from scalerl_jax import rewards
  assert rewards.compute_reward("synthetic", "1 </think> 1 <eos>", "1") == 1.0


def test_sft_examples_noise_rate_and_masks():
  train, _ = syn.make_split(0, n_train=4000, n_heldout=16)
  clean = syn.sft_examples(train[:50], seed=0, step_noise=0.0, interrupt_prob=0.0)
  for p, e in zip(train, clean):
    assert e.correct and not e.interrupted
    assert syn.TOKENIZER.decode(e.tokens) == p.prompt_text + " " + p.gold_completion_text
    assert not e.loss_mask[:e.prompt_len].any() and e.loss_mask[e.prompt_len:].all()
  noisy = syn.sft_examples(train, seed=0)          # defaults: step_noise 0.15, interrupt 0.05
  full = [e for e in noisy if not e.interrupted]
  frac_correct = np.mean([e.correct for e in full])
  # errors are offsets that may cancel mod 10: P(correct) = (1 + 9 (1 - 10q/9)^8) / 10 = 0.309
  assert syn.expected_pass_rate(0.15, 8) == pytest.approx(0.3093, abs=1e-4)
  assert syn.expected_pass_rate(0.0, 8) == 1.0 and syn.expected_pass_rate(0.9, 8) == pytest.approx(0.1)
  assert abs(frac_correct - syn.expected_pass_rate(0.15, 8)) < 0.025
  frac_int = np.mean([e.interrupted for e in noisy])
  assert 0.03 < frac_int < 0.07
  e = next(e for e in noisy if e.interrupted)
  text = syn.TOKENIZER.decode(e.tokens)
  assert syn.INTERRUPTION_TEXT in text
  n_inject = len(syn.TOKENIZER.interruption_ids)
  assert (~e.loss_mask[e.prompt_len:]).sum() == n_inject     # injected phrase not learned
  assert len(e.tokens) - e.prompt_len <= 32 + n_inject
  tokens, mask = syn.pad_batch(noisy[:5])
  assert tokens.shape == mask.shape and tokens.dtype == np.int32
  assert (tokens[~mask & (tokens != 0)] >= 0).all()


def test_sft_examples_deterministic():
  train, _ = syn.make_split(0, n_train=20, n_heldout=4)
  a, b = syn.sft_examples(train, seed=5), syn.sft_examples(train, seed=5)
  assert all((x.tokens == y.tokens).all() for x, y in zip(a, b))


def test_build_dataset_synthetic_from_tiny_config():
  c = tiny.get_config()
  d = build_dataset(c.data, c.rollout.max_prompt_len)
  assert d.kind == "synthetic" and d.reward_name == "synthetic"
  assert len(d.heldout) == c.data.heldout == 64 and len(d.train) == 4096
  assert max(len(s.tokens) for s in d.train) <= c.rollout.max_prompt_len
  assert d.stop_tokens == (syn.TOKENIZER.eos_id,)
  assert d.think_end_tokens == (syn.TOKENIZER.end_think_id,)
  p = d.heldout[0]
  gold = syn.Problem(p.prompt_id, tuple(int(t) for t in d.tokenizer.decode(p.tokens[2:-2]).split()))
  assert d.reward(d.tokenizer.encode(gold.gold_completion_text), p.answer) == 1.0
  with pytest.raises(ValueError, match="max_prompt_len"):
    build_dataset(c.data, 8)


def test_num_terms_max_spreads_problem_lengths_and_gold_thinking():
  """data.synthetic_num_terms_max (issue #25): 2 to 24 digits per problem, each length present, and
  the gold thinking is one token per digit, so thinking lengths spread 1:12 by construction."""
  c = tiny.get_config("tailed")
  c.data.synthetic_num_terms, c.data.synthetic_num_terms_max = 2, 24   # prompts up to 28 tokens
  d = build_dataset(c.data, c.rollout.max_prompt_len)
  counts = [len(s.tokens) - 4 for s in d.train]           # <bos> sum d_1..d_n = <think>
  assert (min(counts), max(counts)) == (2, 24) and set(counts) == set(range(2, 25)), sorted(set(counts))
  assert 10 <= np.median(counts) <= 16                    # uniform over the range (not skewed)
  train, _ = syn.make_split(0, n_train=200, n_heldout=4, num_terms=(2, 24))
  think = [syn.TOKENIZER.encode(p.gold_completion_text).index(syn.TOKENIZER.end_think_id)
           for p in train]
  assert think == [len(p.terms) for p in train]
  c.data.synthetic_num_terms_max = 1                      # below synthetic_num_terms
  with pytest.raises(ValueError, match="synthetic_num_terms_max=1"):
    build_dataset(c.data, c.rollout.max_prompt_len)
  c.data.synthetic_num_terms_max = 24
  c.data.kind = "tiny_code"
  with pytest.raises(ValueError, match="the synthetic task only"):
    build_dataset(c.data, c.rollout.max_prompt_len)


def test_fixed_width_problems_put_every_thinking_step_at_one_offset():
  """configs/tiny.py:lengths, data.synthetic_fixed_width (issue #25): 2-24 digits written in 24 slots (the rest `<unk>`), so
  every prompt has the same length and the digit that gold thinking step i adds sits at the same
  distance behind it whatever the problem's length; the answer and reward are unchanged."""
  c = tiny.get_config("lengths")
  d = build_dataset(c.data, c.rollout.max_prompt_len)
  assert {len(s.tokens) for s in d.train + d.heldout} == {28}      # <bos> sum 24 slots = <think>
  unk = syn.TOKENIZER.unk_id
  counts = [int(np.sum(s.tokens != unk)) - 4 for s in d.train]
  assert (min(counts), max(counts)) == (2, 24) and set(counts) == set(range(2, 25))
  train, _ = syn.make_split(0, n_train=100, n_heldout=4, num_terms=(2, 24), width=24)
  for p in train:
    seq = np.concatenate([p.prompt_tokens, p.gold_completion_tokens])
    n, P = len(p.terms), len(p.prompt_tokens)
    for i in range(n):     # step i (at P + i) adds slot i (index 2 + i): 26 tokens behind it
      assert seq[P + i - 26] == syn.TOKENIZER.token_id(str(p.terms[i]))
    after = syn.TOKENIZER.token_id("=") if n == 24 else unk           # stop where the digits end
    assert seq[P + n - 26] == after and seq[P + n] == syn.TOKENIZER.end_think_id
    assert d.reward(p.gold_completion_tokens, p.answer) == 1.0
  with pytest.raises(ValueError, match="3 terms in 2 slots"):
    syn.Problem(0, (1, 2, 3), width=2)
  c.data.synthetic_num_terms_max = 0
  with pytest.raises(ValueError, match="synthetic_fixed_width"):
    build_dataset(c.data, c.rollout.max_prompt_len)


def test_design_proxy_numbers():
  """Tabular proxy: SFT pass in [0.05, 0.40], RL gain >= 0.25 in 300 steps of 8x8."""
  out = synthetic_proxy.run(seed=0, rl_steps=300)
  assert 0.05 <= out["sft_pass"] <= 0.40
  assert out["gain"] >= 0.25
