"""Thinking tokens' route mismatch: their own decode's experts vs the answer request's prefill's.

    python -m bench.route_mismatch [--dtype bfloat16] [--prompts 16] [--samples 4]
    python -m bench.route_mismatch --config configs/tiny_moe.py --base WORKDIR/base_policy \
        [--wire bfloat16] [--think 3,6]     # a trained MoE on its task's held-out prompts

On the vLLM path (docs/VLLM.md "Routing replay") the routes of a two-phase sample's thinking tokens
come from the answer request's PREFILL over prompt + thinking + injected tokens, not from the decode
forward that sampled them. The JAX sampler records the decode's (`record_routes`); here the same
sequences are teacher-forced through `models.prefill(..., return_routes=True)` and every (thinking
token, MoE layer) whose top-k expert SET differs is counted (prompt tokens are a control: both are
prefill). Model: a random tiny Llama-4 MoE (tiny_llama4: 4 layers, 2 MoE, E = 4, K = 1) at
`--dtype`, temperature 1, thinking budget 24-32 then forced interruption. With `--config` and
`--base` (an HF directory, e.g. configs/tiny_moe.py's SFT base): that trained model, its task's
held-out prompts and interruption phrase, thinking budgets `--think` (short, so that the policy's
own ~1 token per digit gets interrupted), params rounded to `--wire` as the weight wire does.
Last line: JSON (ours = mismatch fraction of thinking tokens, peer = of prompt tokens; lower is
better).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

from bench.common import last_line
from scalerl_jax import config as run_config


def _args(argv=None):
  p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--prompts", type=int, default=16)
  p.add_argument("--samples", type=int, default=4)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--config", default="", help="a configs/*.py file (with --base): its task")
  p.add_argument("--base", default="", help="HF directory of a trained MoE (with --config)")
  p.add_argument("--wire", default="float32", choices=("float32", "bfloat16"),
                 help="round the --base params to this dtype (weights.wire_dtype)")
  p.add_argument("--think", default="3,6", help="thinking budget min,max with --base")
  return p.parse_args(argv)


def _trained(a):
  """(cfg, params, prompts, spec) of `--base` on `--config`'s task (held-out prompts)."""
  import jax  # local: JAX after argument parsing
  import jax.numpy as jnp  # local: JAX after argument parsing
  from scalerl_jax.generation import interruption
  from scalerl_jax import models
  from scalerl_jax.data import build_dataset
  name = os.path.splitext(os.path.basename(a.config))[0]        # configs/tiny_moe.py -> tiny_moe
  lo, hi = map(int, a.think.split(","))
  config = run_config.resolve_config(f"configs/{name}.py", [
      f"--config.rollout.think_budget_min={lo}", f"--config.rollout.think_budget_max={hi}"])
  cfg, params = models.load_hf(a.base, dtype=a.dtype)
  if a.wire == "bfloat16":
    params = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)),
                          params)
  dataset = build_dataset(config.data, config.rollout.max_prompt_len)
  prompts = list(dataset.heldout)[:a.prompts]
  return cfg, params, prompts, interruption.sampling_spec(config, dataset, a.seed)


def main(argv=None) -> int:
  a = _args(argv)
  import jax  # local: JAX after argument parsing
  from scalerl_jax import models
  from scalerl_jax.generation.sampler import JaxSampler
  from scalerl_jax.types import PromptSpec, SamplingSpec
  if a.base:
    cfg, params, prompts, spec = _trained(a)
  else:
    cfg = models.get_preset("tiny_llama4", dtype=a.dtype)
    params = models.init_params(cfg, jax.random.PRNGKey(a.seed))
    rng = np.random.default_rng(a.seed)
    prompts = [PromptSpec(i, rng.integers(10, cfg.vocab_size, 6 + i % 5).astype(np.int32))
               for i in range(a.prompts)]
    spec = SamplingSpec(temperature=1.0, think_budget_min=24, think_budget_max=32,
                        answer_budget=8, interruption_tokens=(7, 8), seed=a.seed)
  groups = JaxSampler(cfg, params, record_routes=True).generate(prompts, a.samples, spec)
  fn = jax.jit(lambda p, t: models.prefill(p, cfg, t, models.init_cache(cfg, 1, t.shape[1]),
                                           return_routes=True)[2])
  diff = {"thinking": [0, 0], "prompt": [0, 0]}
  for p, group in zip(prompts, groups):
    for c in group:
      inj = np.flatnonzero(~c.policy_mask)
      if not len(inj):
        continue
      P, cont = len(p.tokens), len(p.tokens) + int(inj[-1]) + 1
      seq = np.concatenate([p.tokens, c.tokens])[:cont][None].astype(np.int32)
      pre = np.asarray(fn(params, seq))[0]                          # [cont, R, K]
      rec = np.asarray(c.routes)[:cont]
      same = (np.sort(pre, -1) == np.sort(rec, -1)).all(-1)          # [cont, R]
      think = np.zeros(cont, bool)
      think[P:P + int(inj[0])] = True                                # policy tokens before inj
      for name, sel in (("thinking", think), ("prompt", np.arange(cont) < P)):
        diff[name][0] += int((~same[sel]).sum())
        diff[name][1] += int(same[sel].size)
  frac = {k: v[0] / max(v[1], 1) for k, v in diff.items()}
  print(f"{a.dtype}: thinking tokens' (token, MoE layer) pairs whose experts differ between their "
        f"decode and the answer prefill: {frac['thinking']:.4f} of {diff['thinking'][1]}; prompt "
        f"tokens (control): {frac['prompt']:.4f} of {diff['prompt'][1]}")
  last_line(frac["thinking"], frac["prompt"], "mismatch fraction", higher_is_better=False,
            dtype=a.dtype, pairs=diff["thinking"][1], prompt_pairs=diff["prompt"][1],
            model=a.base or "random tiny_llama4", wire=a.wire)
  return 0


if __name__ == "__main__":
  sys.exit(main())
