"""Data-parallel JAX sampler on 2 simulated devices vs one device (tests/generation/test_sampler_devices.py runs
it as `python tests/sampler_devices_procs.py` with 2 XLA:CPU devices); prints one JSON line.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo
import json
import jax, jax.numpy as jnp, numpy as np
from scalerl_jax import models
from scalerl_jax.types import PromptSpec, SamplingSpec
from scalerl_jax.generation.sampler import JaxSampler
assert jax.local_device_count() == 2, jax.local_devices()
cfg = models.get_preset("tiny_llama3", vocab_size=64, num_layers=2, d_model=128, ffn_dim=256,
                        dtype="float32")
assert cfg.num_kv_heads < cfg.num_heads            # GQA
params = models.init_params(cfg, jax.random.PRNGKey(0))
prompts = [PromptSpec(0, np.array([1, 7, 8, 9], np.int32)), PromptSpec(1, np.array([1, 3], np.int32)),
           PromptSpec(2, np.array([4, 5, 6, 7, 8, 9, 10], np.int32))]
# 3 prompts x 1: an odd batch (one padding row); 9..12 thinking tokens, 4 interruption tokens and
# 40 answer tokens: the cache grows past 32 slots.
spec = SamplingSpec(temperature=1.0, think_budget_min=9, think_budget_max=12, answer_budget=40,
                    think_end_tokens=(5,), interruption_tokens=(40, 41, 42, 5),
                    seed=3)
out = {}
for name, devices in (("one", None), ("two", 2)):
  s = JaxSampler(cfg, params, version=2, chunk_steps=5, devices=devices)
  out[name + "_devices"] = s.num_devices
  groups = s.generate(prompts, 1, spec)
  out[name] = [dict(tokens=c.tokens.tolist(), logprobs=c.logprobs.tolist(),
                    versions=c.versions.tolist(), policy=c.policy_mask.tolist(),
                    finish=c.finish_reason) for g in groups for c in g]
  # The learner's log-probs of the same completions.
  ref = []
  for p, g in zip(prompts, groups):
    c = g[0]
    seq = jnp.asarray(np.concatenate([p.tokens, c.tokens])[None])
    lp = jax.nn.log_softmax(models.forward(params, cfg, seq)[0].astype(jnp.float32), -1)
    P = len(p.tokens)
    ref.append([float(lp[P - 1 + t, c.tokens[t]]) for t in range(len(c.tokens))])
  out[name + "_learner"] = ref
print("RESULT " + json.dumps(out))
