"""The paper's five recipes (PAPER_NOTES §4) and the switches that compose with them: named
override sets of the ScaleRL config, applied by the resolver (`scalerl_jax.config.resolve`).

`config.recipe` names one of RECIPES, optionally `+SWITCH[+SWITCH...]`; explicit `--config.x=y`
overrides win over the recipe. Leave-one-out ablations need no recipe: flip one switch of the
`scalerl` recipe, e.g. `--config.rl.loss=dapo`, `--config.rl.aggregation=sample`,
`--config.rl.adv_norm=prompt`, `--config.rl.zero_variance_filter=False`,
`--config.rl.no_positive_resampling=False`, `--config.rl.length_control=penalty`,
`--config.model.fp32_lm_head=False`, `--config.rollout.mode=ppo_off_policy`; rollout correction and
freshness are named SWITCHES (`--config.recipe=scalerl+token_band`).
"""
from __future__ import annotations

from scalerl_jax.config._base import ConfigError


# Batch 80 x 16 (Qwen2.5 / MiniMax) relative to ScaleRL's 48 x 16.
_BIG_BATCH = 80 / 48

# Sources (issue #28): "P §n" = /work/shared/PAPER_NOTES.md section n (the ScaleRL paper, arXiv
# 2510.13786: §4 "Recipes compared" lists each recipe; §3 defines the switches). Where the ScaleRL
# paper is silent the recipe's own paper is cited; a value neither gives is marked "our choice"
# with the reason. Keys a recipe does not set keep base_config's (ScaleRL's) value, e.g.
# rollout.max_lag = 8 (the "-8" of PPO-off-policy-8, P §4), generations_per_prompt = 16 (P §4),
# optimizer and length budgets (P §4: shared by every recipe compared). tests/config/test_recipes.py
# checks every resolved value below.
RECIPES = {
    "scalerl": {},   # base_config is ScaleRL (P §3, §4)
    "deepseek_grpo": {
        "rl.loss": "ppo",                   # GRPO's clipped surrogate (P §4 "GRPO")
        "rl.clip_eps_low": 0.2,             # P §4 "ε 0.2/0.2"
        "rl.clip_eps_high": 0.2,            # P §4
        "rl.aggregation": "sample",         # P §4 "sample avg" (P §3: sample-level = GRPO)
        "rl.adv_norm": "prompt",            # P §3: per-prompt std "as in GRPO"
        "rl.zero_variance_filter": False,   # our choice: GRPO (DeepSeekMath, arXiv 2402.03300)
                                            # keeps every group; P lists filtering only for
                                            # Qwen2.5 and ScaleRL
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3), not GRPO's
        "model.fp32_lm_head": False,        # P §4 names the FP32 head only for MiniMax/ScaleRL
        "rollout.mode": "ppo_off_policy"},  # P §4 "PPO-off-policy-8" (k = max_lag = 8)
    "qwen_dapo": {
        "rl.loss": "dapo",                  # P §4 "DAPO"
        "rl.clip_eps_low": 0.2,             # P §4 "ε 0.2/0.26"
        "rl.clip_eps_high": 0.26,           # P §4
        "rl.aggregation": "prompt",         # P §4 "prompt avg"
        "rl.adv_norm": "prompt",            # DAPO (arXiv 2503.14476) keeps GRPO's group
                                            # (r - mean) / std advantage (P §3 "per-prompt std")
        "rl.zero_variance_filter": True,    # P §4 "zero-variance dropped"
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3)
        "model.fp32_lm_head": False,        # P §4 (FP32 head: MiniMax/ScaleRL only)
        "rollout.mode": "ppo_off_policy",   # P §4 "PPO-off-policy-8"
        "rollout.prompts_per_step": _BIG_BATCH},   # P §4 "80×16 batch"
    "magistral": {
        "rl.loss": "dapo",                  # P §4 "DAPO"
        "rl.clip_eps_low": 0.2,             # Magistral (arXiv 2506.10910) §2.1: clip-higher with
        "rl.clip_eps_high": 0.28,           # ε_low ~0.2 and ε_high tuned in [0.26, 0.28]; we take
                                            # 0.28, the top of that range (= base_config's DAPO
                                            # ε_high), since P gives no value
        "rl.aggregation": "prompt",         # P §4 "prompt avg" (Magistral §2.1 divides by the
                                            # group's total length Σ|o_i|)
        "rl.adv_norm": "batch",             # Magistral §2.1: r - group mean, then normalised by
                                            # the minibatch's mean/std (P §3 "batch-level")
        "rl.zero_variance_filter": True,    # Magistral §2.1 "eliminating non-diverse groups"
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3)
        "model.fp32_lm_head": False,        # P §4 (FP32 head: MiniMax/ScaleRL only)
        "rollout.mode": "pipeline"},        # P §4 "PipelineRL"; k = 8 and 48×16 are our choice:
                                            # P gives neither for Magistral, so ScaleRL's
    "minimax": {
        "rl.loss": "cispo",                 # P §4 "CISPO"; ε_max = 5 is ScaleRL's (P §3: 4/5/8
                                            # equal), our choice: P gives none for MiniMax
        "rl.aggregation": "prompt",         # P §4 "prompt avg" (MiniMax-M1, arXiv 2506.13585,
                                            # §3.1: 1/Σ|o_i| over the group)
        "rl.adv_norm": "prompt",            # MiniMax-M1 §3.1: Â is GRPO's group-relative
                                            # advantage (r - mean) / std within the group
        "rl.zero_variance_filter": False,   # our choice: P lists filtering only for Qwen2.5 and
                                            # ScaleRL (zero-variance groups have Â = 0 anyway;
                                            # kept, they still count in the prompt average)
        "rl.no_positive_resampling": False,  # ScaleRL's curriculum (P §3)
        "model.fp32_lm_head": True,         # P §4 "CISPO + FP32 head"
        "rollout.mode": "ppo_off_policy",   # P §4 "PPO-off-policy" (k = 8: our choice, as the
                                            # other PPO-off-policy recipes; P gives no k)
        "rollout.prompts_per_step": _BIG_BATCH},   # P §4 "80×16"
}


# Switches (issue #45): each is ONE named override set that composes with any recipe as
# `RECIPE+SWITCH[+SWITCH...]`, e.g. `--config.recipe=scalerl+token_band` or
# `python -m scalerl_jax.compare --recipes=scalerl,scalerl+token_band` (the leave-one-out /
# add-one-in runs of the fitted-curve comparison). Values are our choice where noted.
SWITCHES = {
    "tis": {"rl.rc_token_tis_cap": 2.0},            # token TIS, cap 2 (verl's default threshold)
    "token_band": {"rl.rc_token_mask_low": 0.5,     # IcePop's band [α, β] = [0.5, 5]
                   "rl.rc_token_mask_high": 5.0},   # (Ring-1T, arXiv 2510.18855)
    "seq_band": {"rl.rc_seq_mask_low": 0.9,         # geometric-mean sequence mask: our choice
                 "rl.rc_seq_mask_high": 1.1},       # (±10 % per-token average ratio)
    "seq_tis": {"rl.rc_seq_tis_cap": 2.0},          # sequence TIS, cap 2: our choice
    "fresh": {"rollout.max_ahead": 1},              # freshness bound: 1 batch ahead (lag <= 1)
    "r3": {"rl.routing_replay": True},              # MoE routing replay on
    "no_r3": {"rl.routing_replay": False,           # ... and off (MoE configs where it defaults
              "rl.routing_replay_auto": False},     # on: the auto switch would turn it back on)
}


def recipe_overrides(name: str) -> dict:
  """The overrides of `name` = RECIPE or RECIPE+SWITCH+...: the recipe's, then each switch's in
  order (ConfigError for an unknown part)."""
  base, *switches = name.split("+")
  if base not in RECIPES:
    raise ConfigError(f"unknown recipe {base!r}; choose one of {sorted(RECIPES)} "
                      f"(optionally +SWITCH, one of {sorted(SWITCHES)})")
  out = dict(RECIPES[base])
  for sw in switches:
    if sw not in SWITCHES:
      raise ConfigError(f"unknown switch {sw!r} in recipe {name!r}; choose from {sorted(SWITCHES)}")
    out.update(SWITCHES[sw])
  return out
