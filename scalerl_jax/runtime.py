"""Glue from a run config to the objects every process builds the same way.

One place for: the ModelConfig of a run (`model_config`), the sampling settings generators use
(`sampling_spec`); a run config is loaded by the resolver (`scalerl_jax.config.resolve`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import ml_collections

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax import recipes
from scalerl_jax.generation import backends
from scalerl_jax import storage
from scalerl_jax.models import moe
from scalerl_jax.generation import interruption
from scalerl_jax.types import SamplingSpec

_NOT_MODEL_FIELDS = ("preset", "hf_checkpoint", "logits_chunk")


def model_config(config) -> models.ModelConfig:
  """ModelConfig from `config.model`: the preset, then every field that names a ModelConfig field.

  With `config.model.hf_checkpoint` set (local or gs://), the architecture comes from that
  checkpoint's config.json and only the numerics fields (dtypes, fp32 head, scan, remat) apply.
  """
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  m = config.model.to_dict()
  unknown = [k for k in m if k not in fields and k not in _NOT_MODEL_FIELDS]
  if unknown:
    raise ValueError(f"config.model has unknown fields {unknown}; ModelConfig fields are "
                     f"{sorted(fields)}")
  overrides = {k: v for k, v in m.items() if k in fields}
  if config.model.hf_checkpoint:
    cfg_path = storage.join(m["hf_checkpoint"], "config.json")   # local or gs://
    if not storage.exists(cfg_path):
      raise FileNotFoundError(f"config.model.hf_checkpoint={m['hf_checkpoint']!r}: no "
                              "config.json there (expected a save_pretrained directory)")
    numerics = {k: overrides[k] for k in ("param_dtype", "dtype", "fp32_lm_head", "scan_layers",
                                          "remat", "attention_impl", "attention_block",
                                          "attention_q_block", "head_precision",
                                          "moe_impl", "moe_capacity_factor")
                if k in overrides}
    cfg = models.from_hf_config(json.loads(storage.read_text(cfg_path)), **numerics)
  else:
    cfg = models.get_preset(m["preset"], **overrides)
  mesh = getattr(config, "mesh", None)   # a ConfigDict or a typed RunConfig (may lack it)
  if cfg.is_moe and mesh is not None and cfg.moe_impl == "dispatch":
    shape = {a: int(s) for a, s in mesh.shape if int(s) > 0}   # -1 (rest): checked at trace
    moe.expert_shards(cfg.num_experts, shape, tuple(mesh.rules))
  return cfg


def sampling_spec(config, dataset, seed: int, temperature: float | None = None,
                  top_p: float | None = None) -> SamplingSpec:
  """Generation settings: budgets, interruption tokens, stop tokens (config.rollout/generator);
  `temperature` / `top_p` override the generator's (evaluation: config.eval)."""
  r, g = config.rollout, config.generator
  interrupt = config.rl.length_control == "interrupt"
  # Text mode of the end-of-thinking rule when the tokenizer exposes its vocabulary's texts (HF
  # tokenizers: "</think>" may be several tokens); else the exact id sequence (interruption.py).
  texts = getattr(dataset.tokenizer, "vocab_texts", None)
  end_text = getattr(dataset.tokenizer, "think_end_text", "") if texts else ""
  return SamplingSpec(
      temperature=float(g.temperature if temperature is None else temperature),
      top_p=float(g.top_p if top_p is None else top_p), stop_tokens=tuple(dataset.stop_tokens),
      think_budget_min=int(r.think_budget_min), think_budget_max=int(r.think_budget_max),
      answer_budget=int(r.answer_budget), think_end_tokens=tuple(dataset.think_end_tokens),
      think_end_text=end_text,
      think_end_vocab=interruption.think_end_vocab(texts, end_text) if texts and end_text else (),
      interruption_tokens=(tuple(dataset.interruption_tokens(r.interruption_text))
                           if interrupt else ()),
      seed=int(seed))


def generation_seed(seed: int, version: int, prompt_ids) -> int:
  """Sampling seed of one lease batch, a pure function of (run seed, policy version, prompt ids):
  a resumed run (or a restarted generator) draws the same completions for the same leases, unlike
  a per-process random stream. Equal inputs twice in one run give equal seeds (correlated samples),
  which only happens when a prompt is leased twice at the same version."""
  h = hashlib.sha256(json.dumps([int(seed), int(version), [int(p) for p in prompt_ids]]).encode())
  return int.from_bytes(h.digest()[:4], "little") >> 1


def pin_to_device_cpus(config, role: str, index: int = 0) -> list[int] | None:
  """With `config.pin_cpus`, pins this process to its own CPU(s), modelling one accelerator per
  role on a CPU host: the learner takes CPU 0, generator i takes CPU 1 + i (mod the CPU count).
  Must run before JAX initializes its thread pools. Returns the CPUs, or None when not pinning."""
  if not config.pin_cpus or not sys.platform.startswith("linux"):   # sched_setaffinity: Linux
    return None
  cpus = sorted(os.sched_getaffinity(0))
  if len(cpus) < 2:
    return None
  cpu = cpus[0] if role == "learner" else cpus[(1 + index) % len(cpus)]
  os.sched_setaffinity(0, {cpu})
  if role == "generator":   # one CPU: XLA's intra-op pool only adds contention to the small
    # decode ops (bench.sampler --xla-threads 1: 1.17-1.19x vLLM vs 0.94-0.95x with the pool)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               " --xla_cpu_multi_thread_eigen=false").strip()
  return [cpu]


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


def delta_on(weights) -> bool:
  """Whether weight versions go out as exact deltas too (weights.delta, bfloat16 wire only)."""
  return bool(weights.delta) and wire_dtype(weights) == "bfloat16"


def wire_dtype(weights) -> str | None:
  """The dtype float32 params are pushed to generators in (the weights section's `wire_dtype`):
  "bfloat16", or None for float32 (no cast). Every weight push (StreamPublisher, the vLLM load)
  uses it."""
  name = weights.wire_dtype
  if name not in recipes.WIRE_DTYPES:
    raise ValueError(f"weights.wire_dtype={name!r}; expected one of {recipes.WIRE_DTYPES}")
  return None if name == "float32" else name


def max_completion_len(rollout) -> int:
  """Longest completion a generator can produce under the rollout section (incl. interruption;
  generation.interruption.max_completion_len)."""
  return interruption.max_completion_len(rollout)


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
  if isinstance(config, common.Section):
    config = config.to_dict()
  out = []
  for k in KEY_KNOBS:
    node = config
    for part in k.split("."):
      node = node.get(part, None) if isinstance(node, (dict, ml_collections.ConfigDict)) else None
      if node is None:
        break
    if node is not None:
      out.append(f"{k}={node}")
  return f"run config ({role}): " + " ".join(out)


def resolve_routing_replay(config: ml_collections.ConfigDict, run: common.RunConfig
                           ) -> common.RunConfig:
  """R3 at the start of a run whose generators run here (main and compare call it after
  recipes.validate): refused (one line) where they cannot record routes; on by default
  (rl.routing_replay_auto) for an MoE model where they can. Sets
  `config.rl.routing_replay` in place (the generators read it from config.json). A fleet (launch
  renders, buffer.external) keeps R3 as configured; its vLLM workers refuse at start where their
  engine cannot return routes."""
  if run.buffer.external:
    return run
  rl = run.rl
  auto = rl.routing_replay_auto and not rl.routing_replay
  if not (rl.routing_replay or auto):
    return run
  if auto and not model_config(run).is_moe:
    return run
  ok, why = backends.records_routes(run.generator.backend)
  if rl.routing_replay and not ok:
    raise recipes.ConfigError(f"rl.routing_replay=True but the {run.generator.backend} generators "
                              f"cannot record routed experts: {why} (docs/VLLM.md 'Routing replay')")
  if auto and ok:
    config.rl.routing_replay = True
    return common.RunConfig.from_config(config)
  return run
