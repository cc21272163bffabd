"""Pure functions of config values every process computes the same way: sequence lengths (the
learner's padding, the buffer's completion limit, the vLLM engine's max_model_len), the weight
wire dtype, the sampling seed of a lease, and the knob line each pod logs. No JAX, no
ml_collections: the buffer and the vLLM venv call them too."""
from __future__ import annotations

import hashlib
import json

from scalerl_jax.config._base import WIRE_DTYPES, Section, is_node

# Completion tokens reserved for the injected interruption text (its tokenization under any of the
# supported tokenizers is shorter): the generators' bound is think_budget_max + this + answer_budget.
INTERRUPTION_ALLOWANCE = 64


def max_completion_len(rollout) -> int:
  """Longest completion a generator can produce under the rollout section (interruption
  included): the one formula the learner's padding, the buffer's completion limit and the KV
  budgets share."""
  return int(rollout.think_budget_max + INTERRUPTION_ALLOWANCE + rollout.answer_budget)


def generation_seed(seed: int, version: int, prompt_ids) -> int:
  """Sampling seed of one lease batch, a pure function of (run seed, policy version, prompt ids):
  a resumed run (or a restarted generator) draws the same completions for the same leases, unlike
  a per-process random stream. Equal inputs twice in one run give equal seeds (correlated samples),
  which only happens when a prompt is leased twice at the same version."""
  h = hashlib.sha256(json.dumps([int(seed), int(version), [int(p) for p in prompt_ids]]).encode())
  return int.from_bytes(h.digest()[:4], "little") >> 1


def padded_length(length: int, multiple: int, max_len: int) -> int:
  """The token-axis length a learner batch whose longest row has `length` tokens is padded to:
  rounded up to a multiple of `multiple` (`learner.pad_multiple`; few distinct shapes compile),
  clamped to `max_len` (the longest sequence the config allows, `max_sequence_len`): never above
  it. Pure; the preflight calls it too. Raises ValueError for a row longer than `max_len` or a
  multiple < 1."""
  length, multiple, max_len = int(length), int(multiple), int(max_len)
  if multiple < 1:
    raise ValueError(f"learner.pad_multiple={multiple}: must be >= 1")
  if length > max_len:
    raise ValueError(f"a sequence of {length} tokens exceeds the longest the config allows "
                     f"({max_len} = rollout.max_prompt_len + think_budget_max + injected + "
                     f"answer_budget)")
  return min(-(-max(length, 1) // multiple) * multiple, max_len)


def max_sequence_len(rollout) -> int:
  """Longest learner row the rollout section allows: max prompt + the longest completion
  (thinking budget, the injected interruption tokens (cap 64), answer budget). The plan tool's
  memory plan must cover it (tools/plan.py sizes prompt + think + answer; a longer sum is a
  config error)."""
  return int(rollout.max_prompt_len) + max_completion_len(rollout)


def train_seq_len(config) -> int:
  """The token length of the learner's padded batch when a row reaches `max_sequence_len`
  (`padded_length` with `learner.pad_multiple`, as trainer.pad_time pads): the longest sequence
  the train step compiles for, the length its memory plan must be made at (tools.plan's default,
  launch.preflight's check)."""
  longest = max_sequence_len(config.rollout)
  return padded_length(longest, int(config.learner.pad_multiple), longest)


def vllm_max_model_len(rollout) -> int:
  """`max_model_len` a vLLM generator engine is started with (prompt + completion + 16)."""
  return max_sequence_len(rollout) + 16


# The knobs each pod logs at start (`knob_line`): one resolved run config reaches every pod iff
# these read the same in every pod's log (launch.rehearse --real-shape checks it).
KEY_KNOBS = ("rollout.max_lag", "rollout.prompts_per_step", "rollout.generations_per_prompt",
             "rollout.mode", "rl.npr_threshold", "layout", "mesh.shape", "optim.microbatches",
             "model.hf_checkpoint", "data.path", "data.tokenizer_path")


def knob_line(config, role: str) -> str:
  """One line `run config (ROLE): k=v ...` of KEY_KNOBS (those the config has), for pod logs.
  `config`: a ConfigDict or the typed RunConfig (read as its to_dict: the same keys)."""
  if isinstance(config, Section):
    config = config.to_dict()
  out = []
  for k in KEY_KNOBS:
    node = config
    for part in k.split("."):
      node = node.get(part, None) if is_node(node) else None
      if node is None:
        break
    if node is not None:
      out.append(f"{k}={node}")
  return f"run config ({role}): " + " ".join(out)


def delta_on(weights) -> bool:
  """Whether weight versions go out as exact deltas too (weights.delta, bfloat16 wire only)."""
  return bool(weights.delta) and wire_dtype(weights) == "bfloat16"


def wire_dtype(weights) -> str | None:
  """The dtype float32 params are pushed to generators in (the weights section's `wire_dtype`):
  "bfloat16", or None for float32 (no cast). Every weight push (StreamPublisher, the vLLM load)
  uses it."""
  name = weights.wire_dtype
  if name not in WIRE_DTYPES:
    raise ValueError(f"weights.wire_dtype={name!r}; expected one of {WIRE_DTYPES}")
  return None if name == "float32" else name
