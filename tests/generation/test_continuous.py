"""Continuous batching (generation/continuous.py): a freed slot takes the next sample mid-decode,
and that sample decodes exactly as it does alone; weight swaps stamp mixed slots correctly;
log-probs equal the learner's forward although the ring of cache columns wraps around."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs import tiny
from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.generation.continuous import ContinuousDecoder
from scalerl_jax.generation.continuous_loop import ContinuousLoop
from scalerl_jax.generation.eval_lane import EvalLane
from scalerl_jax.generation.jax_engine import JaxEngine
from scalerl_jax.generation.slots import SlotRequest, requests_for
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.types import FINISH_INTERRUPTED, PromptSpec, SamplingSpec

END_THINK = 5
INTERRUPT = (40, 41, 42, END_THINK)
SPEC = SamplingSpec(temperature=1.0, think_budget_min=4, think_budget_max=30, answer_budget=12,
                    think_end_tokens=(END_THINK,), interruption_tokens=INTERRUPT, seed=7)

# Thinking never ends by itself (no end-of-thinking tokens, no stop tokens): every completion is
# exactly its think budget + 4 interruption tokens + its answer budget long.
FIXED = SamplingSpec(temperature=1.0, think_budget_min=0, think_budget_max=30, answer_budget=12,
                     interruption_tokens=INTERRUPT, seed=7)

pytestmark = pytest.mark.xdist_group("sampler")   # the same tiny model as test_sampler.py


@pytest.fixture(scope="module")
def model():
  cfg = models.get_preset("tiny_llama3", vocab_size=64, num_layers=2, d_model=128, ffn_dim=256,
                          dtype="float32")
  return cfg, models.init_params(cfg, jax.random.PRNGKey(0))


def _learner_logprobs(cfg, params, prompt, completion):
  """log softmax of the learner's full forward (float64 on the host) at each completion token."""
  seq = np.concatenate([prompt, completion])[None]
  logits = np.asarray(models.forward(params, cfg, jnp.asarray(seq)), np.float64)[0]
  m = logits.max(-1, keepdims=True)
  logp = logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))
  P = len(prompt)
  return np.array([logp[P - 1 + t, completion[t]] for t in range(len(completion))])


def _req(pid, tokens, think, answer, sample=0, seed=7):
  return SlotRequest(PromptSpec(pid, np.asarray(tokens, np.int32)), sample, seed, think, answer)


def test_freed_slot_is_refilled_and_decodes_as_alone(model):
  cfg, params = model
  # Two slots, three samples: A ends early (1 thinking token, 4 interruption tokens, 2 answer
  # tokens), B runs long (30 + 4 + 12), C waits and takes A's slot while B is mid-sequence.
  # The ring holds 48 columns: C (46 tokens) starts at decode step 8 and wraps around it.
  a = _req(1, [1, 7, 8, 9], think=0, answer=2)
  b = _req(2, [1, 3], think=30, answer=12)
  c = _req(3, [4, 5, 6, 7, 8, 9, 10], think=30, answer=12, sample=3)
  dec = ContinuousDecoder(JaxSampler(cfg, params, version=4), capacity=2, spec=FIXED,
                          max_prompt_len=16, max_completion_len=48, chunk_steps=8)
  dec.insert([a, b])
  done = dec.step()
  assert [r.prompt.prompt_id for r, _ in done] == [1] and dec.free == 1
  assert done[0][1].finish_reason == FINISH_INTERRUPTED
  assert done[0][1].tokens[1:5].tolist() == list(INTERRUPT) and len(done[0][1].tokens) == 7
  dec.insert([c])                              # into A's slot, B in flight (8 tokens in)
  assert len(dec.in_flight) == 2
  got = {r.prompt.prompt_id: comp for r, comp in dec.run([])}
  assert set(got) == {2, 3}
  assert len(got[2].tokens) == len(got[3].tokens) == 46   # C: columns 8..53 of a 48-ring
  # C alone in a fresh one-slot decoder: the same tokens; log-probs to float32 rounding.
  alone = ContinuousDecoder(JaxSampler(cfg, params, version=4), capacity=1, spec=FIXED,
                            max_prompt_len=16, max_completion_len=48, chunk_steps=8).run([c])
  (_, ref), = alone
  assert got[3].tokens.tolist() == ref.tokens.tolist()
  np.testing.assert_allclose(got[3].logprobs, ref.logprobs, atol=1e-5)
  assert got[3].policy_mask.tolist() == ref.policy_mask.tolist()
  # ... and both equal the learner's forward (T = 1): the ring's columns hold the right keys.
  for r, comp in ((b, got[2]), (c, got[3])):
    assert np.all(comp.versions == 4)
    lp = _learner_logprobs(cfg, params, r.prompt.tokens, comp.tokens)
    pol = comp.policy_mask
    np.testing.assert_allclose(comp.logprobs[pol], lp[pol], atol=2e-5)
    assert np.all(comp.logprobs[~pol] == 0.0)
  st = dec.stats
  assert st.completions == 3 and 0 < st.occupancy <= 1
  assert st.tokens == st.live_row_steps == 7 + 46 + 46
  assert st.slot_steps == 2 * 8 * st.chunks


def test_a_chunk_stops_when_a_sample_ends_and_its_slot_is_refilled_at_once(model):
  """refill, stop_after 1 (2 slots: capacity / 8, at least 1): the chunk ends at the step A's
  7th (last) token is decoded, not at the chunk's 8th step, and C takes A's slot 1 step
  earlier. The samples are the same as with whole chunks (tokens exact, log-probs to float32
  rounding), and fewer slot-steps are spent on them."""
  cfg, params = model
  a = _req(1, [1, 7, 8, 9], think=0, answer=2)            # 7 tokens
  b = _req(2, [1, 3], think=30, answer=12)                # 46 tokens
  c = _req(3, [4, 5, 6, 7, 8, 9, 10], think=9, answer=3, sample=3)   # 16 tokens
  make = lambda: ContinuousDecoder(JaxSampler(cfg, params, version=4), capacity=2, spec=FIXED,
                                   max_prompt_len=16, max_completion_len=48, chunk_steps=8)
  dec = make()
  dec.insert([a, b])
  (r, comp), = dec.step(refill=True)
  assert r is a and len(comp.tokens) == 7
  assert dec.stats.slot_steps == 2 * 7 and dec.stats.live_row_steps == 7 + 7
  dec.insert([c])
  got = {r.prompt.prompt_id: comp for r, comp in [(r, comp)] + dec.run([])}
  whole = make()
  whole.insert([a, b])
  ref = {r.prompt.prompt_id: comp for r, comp in whole.step()}
  whole.insert([c])
  ref.update({r.prompt.prompt_id: comp for r, comp in whole.run([])})
  assert sorted(got) == sorted(ref) == [1, 2, 3]
  for pid in got:
    assert got[pid].tokens.tolist() == ref[pid].tokens.tolist(), pid
    np.testing.assert_allclose(got[pid].logprobs, ref[pid].logprobs, atol=1e-5)
    assert got[pid].versions.tolist() == ref[pid].versions.tolist()
  assert dec.stats.live_row_steps == whole.stats.live_row_steps == 7 + 46 + 16
  # whole chunks: 6 chunks of 8 steps (B's 46 tokens end in the 6th); the early stop: 7 steps,
  # then (nothing waits) whole chunks again: 7 + 5 x 8 = 47 steps (B's 46th token in the last)
  assert whole.stats.slot_steps == 2 * 48 and dec.stats.slot_steps == 2 * 47
  assert dec.stats.occupancy > whole.stats.occupancy


def test_samples_do_not_depend_on_slot_or_neighbours(model):
  """The same 12 requests through 3 slots and through 12 slots: identical completions."""
  cfg, params = model
  prompts = [PromptSpec(i, np.arange(1, 3 + i, dtype=np.int32) % 60 + 1) for i in range(4)]
  reqs = requests_for(prompts, 3, SPEC)
  out = {}
  for cap in (3, 12):
    dec = ContinuousDecoder(JaxSampler(cfg, params), capacity=cap, spec=SPEC, max_prompt_len=16,
                            chunk_steps=8)
    out[cap] = {(r.prompt.prompt_id, r.sample_index): c for r, c in dec.run(reqs)}
  assert len(out[3]) == 12
  for key, c in out[12].items():
    assert c.tokens.tolist() == out[3][key].tokens.tolist(), key
    np.testing.assert_allclose(c.logprobs, out[3][key].logprobs, atol=1e-5)
  # samples of one prompt differ (per-sample keys), and the budgets are the spec's draws
  assert len({tuple(out[12][(0, j)].tokens) for j in range(3)}) == 3


def test_live_slots_are_packed_into_a_smaller_bucket_without_changing_samples(model):
  """8 slots, budgets 0-30: as samples end, the live ones are moved down and only a bucket of
  8/4/2/1 rows is decoded, and attention reads a window of the ring (16 or 32 of its 48
  columns) while the samples in flight are young. Every sample decodes as in the dense decoder
  (row_buckets=1, every ring column), the moved ones included, and fewer rows are computed."""
  cfg, params = model
  prompts = [PromptSpec(i, np.arange(2, 4 + i, dtype=np.int32)) for i in range(4)]
  reqs = requests_for(prompts, 3, FIXED)
  out, stats = {}, {}
  for nb in (1, 4):
    dec = ContinuousDecoder(JaxSampler(cfg, params), capacity=8, spec=FIXED, max_prompt_len=16,
                            chunk_steps=8, row_buckets=nb, windows=nb > 1)
    assert dec.buckets == [8] if nb == 1 else dec.buckets == [1, 2, 4, 8]
    out[nb] = {(r.prompt.prompt_id, r.sample_index): c for r, c in dec.run(reqs)}
    stats[nb] = dec.stats
  dense, packed = stats[1], stats[4]
  assert dense.moves == dense.window_chunks == 0 and dense.row_steps == dense.slot_steps
  assert 0 < packed.window_chunks < packed.chunks
  assert packed.moves > 0 and packed.row_steps < 0.8 * packed.slot_steps
  assert packed.live_row_steps == dense.live_row_steps == sum(len(c.tokens) for c in out[1].values())
  assert packed.compute_occupancy > dense.compute_occupancy == dense.occupancy
  assert len(out[4]) == 12
  for key, c in out[1].items():
    assert c.tokens.tolist() == out[4][key].tokens.tolist(), key
    np.testing.assert_allclose(c.logprobs, out[4][key].logprobs, atol=1e-5)
    assert c.policy_mask.tolist() == out[4][key].policy_mask.tolist()


def test_weight_swap_with_mixed_slots_stamps_versions(model):
  cfg, params = model
  params2 = models.init_params(cfg, jax.random.PRNGKey(1))
  s = JaxSampler(cfg, params, version=0)
  dec = ContinuousDecoder(s, capacity=2, spec=FIXED, max_prompt_len=16, chunk_steps=8)
  short = _req(1, [1, 7, 8, 9], think=0, answer=2)
  long = _req(2, [1, 3], think=30, answer=12)
  dec.insert([short, long])
  first = dec.step()                         # 8 tokens of `long` under version 0
  assert [r.prompt.prompt_id for r, _ in first] == [1]
  s.set_params(params2, 1)                   # applied before the next chunk / insertion
  late = _req(3, [4, 5, 6], think=30, answer=12)
  dec.insert([late])                         # prefilled with version 1
  got = {r.prompt.prompt_id: c for r, c in dec.run([])}
  v = got[2].versions
  # `long`: its first 8 tokens and the 9th (sampled from logits version 0 computed) are version
  # 0, every later one version 1; its old KV is kept.
  assert v[:9].tolist() == [0] * 9 and np.all(v[9:] == 1) and len(v) == 46
  assert np.all(got[3].versions == 1)
  lp = _learner_logprobs(cfg, params2, late.prompt.tokens, got[3].tokens)
  pol = got[3].policy_mask
  np.testing.assert_allclose(got[3].logprobs[pol], lp[pol], atol=2e-5)


def test_a_sample_moved_down_after_a_weight_swap_keeps_its_versions_and_kv(model):
  """`long` in slot 1 is alone once `short` ends: it moves to slot 0 (a 1-row bucket) as the
  swap to version 1 lands. Its versions and log-probs are those of the decoder that never moves
  it (row_buckets=1), and its old KV is kept (the learner's forward under version 0 matches its
  first tokens)."""
  cfg, params = model
  params2 = models.init_params(cfg, jax.random.PRNGKey(1))
  got = {}
  for nb in (1, 2):
    s = JaxSampler(cfg, params, version=0)
    dec = ContinuousDecoder(s, capacity=2, spec=FIXED, max_prompt_len=16, chunk_steps=8,
                            row_buckets=nb)
    dec.insert([_req(1, [1, 7, 8, 9], think=0, answer=2), _req(2, [1, 3], think=30, answer=12)])
    assert [r.prompt.prompt_id for r, _ in dec.step()] == [1]
    s.set_params(params2, 1)
    (r, got[nb]), = dec.run([])
    assert dec.stats.moves == (nb - 1) and r.prompt.prompt_id == 2
  v = got[2].versions
  assert v[:9].tolist() == [0] * 9 and np.all(v[9:] == 1) and len(v) == 46
  assert got[2].tokens.tolist() == got[1].tokens.tolist()
  np.testing.assert_allclose(got[2].logprobs, got[1].logprobs, atol=1e-5)
  lp = _learner_logprobs(cfg, params, np.asarray([1, 3], np.int32), got[2].tokens)
  np.testing.assert_allclose(got[2].logprobs[:8], lp[:8], atol=2e-5)


def test_bad_requests_fail_with_one_line(model):
  cfg, params = model
  dec = ContinuousDecoder(JaxSampler(cfg, params), capacity=1, spec=SPEC, max_prompt_len=16)
  with pytest.raises(ValueError, match="max_prompt_len"):
    dec.insert([_req(1, np.ones(17), 4, 4)])
  with pytest.raises(ValueError, match="free slots"):
    dec.insert([_req(1, [1], 4, 4), _req(2, [1], 4, 4)])
  with pytest.raises(ValueError, match="exceed the model's"):
    ContinuousDecoder(JaxSampler(cfg, params), 1, SPEC, max_prompt_len=16,
                      max_completion_len=cfg.max_position_embeddings)


def test_prompt_bank_prefills_a_groups_prompt_once_and_a_swap_refills_it(model):
  """A group's samples enter as slots free (three inserts here): its prompt is prefilled once
  and copied from the bank after; each sample decodes as it does alone. After a weight swap the
  same prompt is prefilled again with the new weights (learner forward under params2)."""
  cfg, params = model
  params2 = models.init_params(cfg, jax.random.PRNGKey(1))
  s = JaxSampler(cfg, params, version=0)
  dec = ContinuousDecoder(s, capacity=2, spec=FIXED, max_prompt_len=16, chunk_steps=8)
  prompt = [4, 5, 6, 9]
  g = [_req(9, prompt, think=t, answer=2, sample=j) for j, t in enumerate((0, 30, 1, 2))]
  dec.insert(g[:2])
  assert dec.prompt_prefills == 1               # two samples, one prompt
  got = {r.sample_index: c for r, c in dec.step()}
  assert set(got) == {0} and dec.free == 1
  dec.insert([g[2]])                             # the same prompt: from the bank
  got.update({r.sample_index: c for r, c in dec.step()})
  assert 2 in got and dec.prompt_prefills == 1
  dec.insert([g[3]])
  assert dec.prompt_prefills == 1
  got.update({r.sample_index: c for r, c in dec.run([])})
  assert sorted(got) == [0, 1, 2, 3]
  for j in range(4):                             # as alone, without the bank's history
    (_, ref), = ContinuousDecoder(JaxSampler(cfg, params, version=0), capacity=1, spec=FIXED,
                                  max_prompt_len=16, chunk_steps=8).run([g[j]])
    assert got[j].tokens.tolist() == ref.tokens.tolist(), j
    np.testing.assert_allclose(got[j].logprobs, ref.logprobs, atol=1e-5)
  s.set_params(params2, 1)
  late = _req(9, prompt, think=3, answer=2, sample=4)
  dec.insert([late])                             # the swap emptied the bank: prefilled again
  assert dec.prompt_prefills == 2
  (_, c), = dec.run([])
  assert np.all(c.versions == 1)
  lp = _learner_logprobs(cfg, params2, late.prompt.tokens, c.tokens)
  np.testing.assert_allclose(c.logprobs[c.policy_mask], lp[c.policy_mask], atol=2e-5)


class _Lane(EvalLane, ContinuousLoop):
  """A Worker's two bases, with the fields `_eval_sample` and `continuous_ok` read."""

  def __init__(self, model_cfg, params, **overrides):
    c = tiny.get_config()
    for k, v in overrides.items():
      section, name = k.split("__")
      setattr(c[section], name, v)
    self.config = common.RunConfig.from_config(c)
    self.engine = JaxEngine(self.config)
    self.model_cfg, self.backend = model_cfg, "jax"
    self.gen = JaxSampler(model_cfg, params, record_routes=bool(c.rl.routing_replay))


def test_an_evaluation_lease_on_a_continuous_generator_decodes_through_slots(model):
  """generation/eval_lane.py `_eval_sample`: through `generator.eval_decode_batch` slots (3, fewer
  than the lease's 12 samples: freed slots take the waiting ones) the groups come back in prompt
  order, sample j of each exactly what a decoder of those slots samples for it alone, every token
  stamped with the pinned version; with eval_decode_batch 0, a drain generator or one that falls
  back to the drain loop (version-capped rounds), exactly the static batch's groups (`generate`),
  which sample other tokens (their own random streams)."""
  cfg, params = model
  prompts = [PromptSpec(10 + i, np.arange(2, 4 + 2 * i, dtype=np.int32) % 60 + 1) for i in range(4)]
  pinned = lambda: JaxSampler(cfg, params, version=3, chunk_steps=16)
  toks = lambda groups: [[c.tokens.tolist() for c in g] for g in groups]
  got = _Lane(cfg, params, generator__eval_decode_batch=3)._eval_sample(pinned(), prompts, 3, SPEC)
  alone = {(r.tag, r.sample_index): c for r, c in ContinuousDecoder(
      pinned(), capacity=1, spec=SPEC, max_prompt_len=32).run(requests_for(prompts, 3, SPEC))}
  assert [len(g) for g in got] == [3, 3, 3, 3]
  assert toks(got) == [[alone[(i, j)].tokens.tolist() for j in range(3)] for i in range(4)]
  assert all(np.all(c.versions == 3) and len(c.versions) for g in got for c in g)
  static = toks(pinned().generate(prompts, 3, SPEC))
  for drain in ({"generator__eval_decode_batch": 0}, {"generator__continuous": False},
                {"rollout__mode": "ppo_off_policy"}):
    assert toks(_Lane(cfg, params, **drain)._eval_sample(pinned(), prompts, 3, SPEC)) == static, drain
  assert toks(got) != static
