"""Ahead-of-time memory plan of the REAL-size train step (and generator layout) on a named topology.

Run from the repo root (no accelerator needed; nothing is allocated):
  python -m scalerl_jax.tools.plan --config=configs/8b.py --topology=h100_16
  python -m scalerl_jax.tools.plan --config=configs/scout.py --topology=gb200_16 --seq_len=16384

The tool re-executes itself with XLA_FLAGS=--xla_force_host_platform_device_count=N (N = the
topology's device count) and JAX_PLATFORMS=cpu, builds the production mesh from `config.layouts`
and `config.mesh.rules`, and compiles

  learner: the learner's jitted, donated train step (scalerl_jax.learner.make_train_step +
           jit_train_step, the Learner's own shardings) via jax.jit(...).lower(abstract_state,
           abstract_batch).compile() on ShapeDtypeStructs carrying their NamedShardings;
  generator: a KV-cache decode step with bf16 params laid out for a tensor-parallel generator
           (`config.generator.tensor_parallel` devices; weights sharded over `tensor` only).

and prints ONE JSON line with per-device bytes (params, optimizer state, batch, XLA temp =
activations + gradients + workspace, from `compiled.memory_analysis()`), the peak total, `fits`
against the topology's usable memory, compile times, mesh, micro-batches and tokens per micro-batch.

`compute` (with --flops): XLA's cost analysis counts a while-loop body once (the micro-batch scan
and the scanned layers), so the step's FLOPs come from a probe: forward + backward of one
micro-batch (token log-probs, the learner's objective minus elementwise loss terms) on the same
mesh and rules, layers unscanned and without remat, compiled at p and 2p layers (p = the scanned
block) and extrapolated linearly to all layers; x micro-batches = compiled FLOPs per step (the
optimizer's elementwise update, ~1e-5 of it, is left out). Compared per token with 6 N_active +
12 L N_heads H T (dense [T,T] attention as the einsum path computes it), and turned into a step
time and device-hours at the topology's peak bf16 FLOP/s and a stated MFU (--mfu). Full remat
adds one forward (≈ +1/3) of hardware FLOPs that MFU does not count.

Caveat: the numbers come from the XLA:CPU compiler's buffer assignment. TPU/GPU compilers fuse and
schedule differently; treat temp bytes as an estimate (docs/SCALE.md).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
from absl import app
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from ml_collections import config_flags

from scalerl_jax import config as run_config
from scalerl_jax.models import sections as model_sections
from scalerl_jax import models
from scalerl_jax import sharding
from scalerl_jax import topologies
from scalerl_jax import xla_env
from scalerl_jax.learner import jit_train_step
from scalerl_jax.learner import LearnerState
from scalerl_jax.learner import make_optimizer
from scalerl_jax.learner import make_train_step
from scalerl_jax.learner import RLSpec
from scalerl_jax.learner import state_shardings
from scalerl_jax.learner import warmup_constant_schedule
from scalerl_jax.learner.learner import batch_axes
from scalerl_jax.tools.describe import count_params

_DEVICE_FLAG = xla_env.DEVICE_COUNT_FLAG


def _bytes_per_device(abstract_tree, shardings) -> int:
  """Σ over leaves of the bytes of one device's shard (even shardings: all devices equal)."""
  total = 0
  for a, s in zip(jax.tree.leaves(abstract_tree), jax.tree.leaves(shardings)):
    total += math.prod(s.shard_shape(a.shape)) * a.dtype.itemsize
  return int(total)


def _with_sharding(abstract_tree, shardings):
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                      abstract_tree, shardings)


def _memory(compiled) -> dict:
  ma = compiled.memory_analysis()
  out = dict(argument_bytes=int(ma.argument_size_in_bytes), output_bytes=int(ma.output_size_in_bytes),
             alias_bytes=int(ma.alias_size_in_bytes), temp_bytes=int(ma.temp_size_in_bytes))
  # Peak = inputs + scratch + outputs that do not reuse (donated) input buffers.
  out["peak_bytes"] = (out["argument_bytes"] + out["temp_bytes"] + out["output_bytes"]
                       - out["alias_bytes"])
  return out


def abstract_batch(batch_rows: int, seq_len: int, batch_sharding) -> dict:
  """The rollout-batch contract as ShapeDtypeStructs (docs/ARCHITECTURE.md "Rollout batch")."""
  tok = lambda dt: jax.ShapeDtypeStruct((batch_rows, seq_len), dt, sharding=batch_sharding)
  row = lambda dt: jax.ShapeDtypeStruct((batch_rows,), dt, sharding=batch_sharding)
  return dict(tokens=tok(jnp.int32), gen_logprobs=tok(jnp.float32), loss_mask=tok(jnp.bool_),
              positions=tok(jnp.int32), rewards=row(jnp.float32), prompt_ids=row(jnp.int32))


def compile_learner(config, model_cfg, mesh, batch_rows: int, seq_len: int) -> tuple[Any, dict[str, Any]]:
  """Lowers + compiles the learner's sharded train step on abstract inputs.

  Returns (compiled, info) where info holds the abstract state/batch, their shardings and timings.
  """

  rules = tuple(config.mesh.rules)
  microbatches = int(config.optim.microbatches)
  if batch_rows % microbatches:
    raise ValueError(f"batch {batch_rows} not divisible by microbatches {microbatches}")
  optimizer = make_optimizer(config.optim)
  params = sharding.abstract_params(model_cfg)
  p_sh = sharding.param_shardings(model_cfg, mesh, rules)
  state_sh = state_shardings(optimizer, params, p_sh, mesh)
  abstract_state = _with_sharding(
      jax.eval_shape(lambda p: LearnerState.create(p, optimizer), params), state_sh)
  partition = P(batch_axes(rules))
  batch_sh = NamedSharding(mesh, partition)
  batch = abstract_batch(batch_rows, seq_len, batch_sh)
  apply_fn = lambda p, tok, pos: models.forward_hidden(p, model_cfg, tok, pos)
  step_fn = make_train_step(apply_fn, optimizer, RLSpec.from_config(config.rl), microbatches,
                            lr_schedule=warmup_constant_schedule(config.optim.lr,
                                                                 config.optim.warmup_steps),
                            batch_partition=partition, mesh=mesh,
                            logits_chunk=int(config.model.logits_chunk),
                            head_precision=model_cfg.head_precision)
  jitted = jit_train_step(step_fn, mesh=mesh, state_sharding=state_sh, batch_sharding=batch_sh)
  t0 = time.perf_counter()
  with sharding.use_mesh(mesh, rules):
    lowered = jitted.lower(abstract_state, batch)
  t1 = time.perf_counter()
  compiled = lowered.compile()
  t2 = time.perf_counter()
  info = dict(abstract_state=abstract_state, state_shardings=state_sh, batch=batch,
              batch_sharding=batch_sh, lower_s=t1 - t0, compile_s=t2 - t1)
  return compiled, info


def probe_flops(config, model_cfg, mesh, rows: int, seq_len: int, num_layers: int,
                remat: str = "none") -> float:
  """Compiled FLOPs (all devices) of forward + backward of one micro-batch of `rows` x `seq_len`
  tokens through `num_layers` unscanned layers, with `remat` (default none: the model's FLOPs;
  the config's policy: the hardware FLOPs, recomputation included), on `mesh` with the config's
  rules."""

  cfg = model_cfg.replace(num_layers=num_layers, scan_layers=False, remat=remat)
  rules = tuple(config.mesh.rules)
  params = sharding.abstract_params(cfg)
  p_sh = sharding.param_shardings(cfg, mesh, rules)
  tok_sh = NamedSharding(mesh, P(batch_axes(rules)))
  tokens = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=tok_sh)

  def objective(p, tok) -> jax.Array:
    logits = models.forward(p, cfg, tok)
    return jnp.sum(jnp.take_along_axis(jax.nn.log_softmax(logits), tok[..., None], -1))

  with sharding.use_mesh(mesh, rules):
    compiled = jax.jit(jax.grad(objective)).lower(_with_sharding(params, p_sh), tokens).compile()
  cost = compiled.cost_analysis()
  assert cost is not None, "XLA gave no cost analysis for the compiled step"
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return float(cost["flops"]) * mesh.size    # the SPMD module's numbers are per device


def compute_report(config, model_cfg, mesh, topo, batch_rows: int, seq_len: int, mfu: float) -> dict:
  """Compiled FLOPs per step / token vs 6 N_active + attention, step time and device-hours."""
  m = int(config.optim.microbatches)
  rows = batch_rows // m
  p = model_cfg.scan_period
  t0 = time.perf_counter()
  layers = lambda a, b: a + (model_cfg.num_layers / p - 1) * (b - a)
  f1 = probe_flops(config, model_cfg, mesh, rows, seq_len, p)
  f2 = probe_flops(config, model_cfg, mesh, rows, seq_len, 2 * p)
  per_mb = layers(f1, f2)
  remat_mb = per_mb
  if model_cfg.remat != "none":   # what the remat policy costs: its recomputation, compiled
    remat_mb = layers(*(probe_flops(config, model_cfg, mesh, rows, seq_len, n, model_cfg.remat)
                        for n in (p, 2 * p)))
  tokens_mb = rows * seq_len
  per_token = per_mb / tokens_mb
  n_active = count_params(model_cfg)["params_active"]
  six_n = 6.0 * n_active
  attn = 12.0 * model_cfg.num_layers * model_cfg.num_heads * model_cfg.head_dim * seq_len
  step_flops = per_mb * m
  step_s = step_flops / (topo.num_devices * topo.peak_flops * mfu) if topo.peak_flops else None
  return dict(
      flops_per_step=step_flops, flops_per_token=per_token, params_active=n_active,
      six_n_active_per_token=six_n, attention_flops_per_token=attn,
      flops_per_token_vs_6n_plus_attention=round(per_token / (six_n + attn), 4),
      remat=model_cfg.remat, hardware_flops_per_step=remat_mb * m,
      remat_flops_overhead=round(remat_mb / per_mb - 1.0, 4),
      peak_flops_per_device=topo.peak_flops, mfu=mfu,
      step_seconds=None if step_s is None else round(step_s, 2),
      device_hours_per_step=None if step_s is None else round(step_s * topo.num_devices / 3600, 4),
      probe_layers=[p, 2 * p], probe_s=round(time.perf_counter() - t0, 2))


def generator_rules(rules) -> tuple[tuple[str, Any], ...]:
  """The learner rules with FSDP removed: a generator keeps full weights along `embed`, shards
  heads / mlp / vocab over `tensor` (and experts over `expert`), and its cache batch over `data`."""
  over = {"embed": None, "batch": "data", "cache_batch": "data"}
  return tuple((k, over.get(k, v)) for k, v in rules)


def compile_generator(config, model_cfg, devices, tensor_parallel: int, decode_batch: int,
                      max_len: int) -> dict:
  """Compiles one bf16 decode step (KV cache of `decode_batch` x `max_len`) on `tensor_parallel`
  devices; returns per-device bytes and compile time."""

  # Generators decode with unscanned layers (the model's in-place cache-update decode path).
  gen_cfg = model_cfg.replace(param_dtype="bfloat16", dtype="bfloat16", remat="none",
                              scan_layers=False)
  mesh = sharding.make_mesh((("data", 1), ("fsdp", 1), ("tensor", tensor_parallel), ("expert", 1)),
                            devices[:tensor_parallel])
  rules = generator_rules(tuple(config.mesh.rules))
  params = sharding.abstract_params(gen_cfg)
  p_sh = sharding.param_shardings(gen_cfg, mesh, rules)
  cache = jax.eval_shape(lambda: models.init_cache(gen_cfg, decode_batch, max_len))
  c_sh = sharding.cache_shardings(cache, mesh, rules)
  tok_sh = NamedSharding(mesh, P())
  tokens = jax.ShapeDtypeStruct((decode_batch,), jnp.int32, sharding=tok_sh)
  step = jax.jit(models.decode_step, static_argnums=1, donate_argnums=3,
                 in_shardings=(p_sh, tok_sh, c_sh), out_shardings=(tok_sh, c_sh))
  t0 = time.perf_counter()
  with sharding.use_mesh(mesh, rules):
    compiled = step.lower(_with_sharding(params, p_sh), gen_cfg, tokens,
                          _with_sharding(cache, c_sh)).compile()
  out = dict(mesh=dict(tensor=tensor_parallel), param_dtype="bfloat16",
             decode_batch=decode_batch, max_len=max_len,
             param_bytes=_bytes_per_device(params, p_sh),
             kv_cache_bytes=_bytes_per_device(cache, c_sh),
             compile_s=round(time.perf_counter() - t0, 2))
  out.update(_memory(compiled))
  return out


def default_seq_len(config) -> int:
  """The sequence length a plan is made at unless --seq_len says otherwise: the token length the
  learner's train step really compiles for when a batch holds a longest sequence
  (run_config.train_seq_len: prompt + completion budgets, padded as trainer.pad_time pads).
  launch.preflight checks that the plan it uses was made at this length (or a longer one)."""
  return run_config.train_seq_len(config)


REMAT_ORDER = ("none", "dots", "full")   # cheapest first: the recomputation each policy costs


def plan(config, seq_len: int | None = None, with_generator: bool = True, with_flops: bool = True,
         mfu: float = 0.4, choose_remat: bool = False) -> dict:
  """The plan JSON of `config` on `config.topology` (needs that many jax devices).

  choose_remat: compile the learner with each policy of REMAT_ORDER in turn and keep the first
  whose plan fits (`remat_choice` lists every try: peak GB and fits); the rest of the plan is
  made with that policy. None fitting: the last (full) is reported, with fits False."""

  topo = topologies.get_topology(config.topology)
  devices = jax.devices()
  if len(devices) < topo.num_devices:
    raise RuntimeError(f"topology {topo.name} needs {topo.num_devices} devices, jax has "
                       f"{len(devices)}; run as `python -m scalerl_jax.tools.plan` (it sets "
                       f"XLA_FLAGS={_DEVICE_FLAG}=N itself)")
  model_cfg = model_sections.model_config(config)
  r = config.rollout
  batch_rows = int(r.batch_size or r.prompts_per_step * r.generations_per_prompt)
  seq_len = int(seq_len or default_seq_len(config))
  mesh = sharding.make_mesh(config.mesh.shape, devices[:topo.num_devices])
  tried = []
  for policy in (REMAT_ORDER if choose_remat else (model_cfg.remat,)):
    model_cfg = model_cfg.replace(remat=policy)
    compiled, info = compile_learner(config, model_cfg, mesh, batch_rows, seq_len)
    peak = _memory(compiled)["peak_bytes"]
    tried.append(dict(remat=policy, peak_gb=round(peak / 1e9, 2),
                      fits=bool(peak <= topo.usable_bytes)))
    if tried[-1]["fits"]:
      break
  st, st_sh = info["abstract_state"], info["state_shardings"]
  mem = _memory(compiled)
  m = int(config.optim.microbatches)
  rules = dict(config.mesh.rules)
  batch_split = topologies.batch_split(config)
  seq_axes = rules.get("seq")
  seq_axes = () if seq_axes is None else (seq_axes if isinstance(seq_axes, tuple) else (seq_axes,))
  seq_split = math.prod(mesh.shape[a] for a in seq_axes)
  rows_mb = batch_rows // m
  out: dict[str, Any] = dict(
      model=config.model.preset, topology=topo.name, layout=config.get("layout", topo.name),
      devices=topo.num_devices,
      mesh={k: int(v) for k, v in mesh.shape.items()},
      param_dtype=model_cfg.param_dtype, compute_dtype=model_cfg.dtype, remat=model_cfg.remat,
      scan_layers=model_cfg.scan_layers, batch_rows=batch_rows, seq_len=seq_len,
      microbatches=m, rows_per_microbatch=rows_mb, tokens_per_microbatch=rows_mb * seq_len,
      rows_per_device_per_microbatch=rows_mb / batch_split,
      sequence_parallel=seq_split > 1,
      tokens_per_device_per_microbatch=rows_mb * seq_len // (batch_split * seq_split),
      param_bytes=_bytes_per_device(st.params, st_sh.params),
      opt_state_bytes=_bytes_per_device(st.opt_state, st_sh.opt_state),
      batch_bytes=_bytes_per_device(info["batch"], {k: info["batch_sharding"] for k in info["batch"]}),
      **mem,
      lower_s=round(info["lower_s"], 2), compile_s=round(info["compile_s"], 2),
      hbm_bytes=topo.hbm_bytes, usable_bytes=topo.usable_bytes)
  out["activation_temp_bytes"] = out["temp_bytes"]
  out["total_bytes"] = out["peak_bytes"]
  out["fits"] = bool(out["total_bytes"] <= topo.usable_bytes)
  out["total_gb"] = round(out["total_bytes"] / 1e9, 2)
  if choose_remat:
    out["remat_choice"] = dict(chosen=model_cfg.remat, tried=tried,
                               configured=model_sections.model_config(config).remat)
  out["moe"] = (dict(impl=model_cfg.moe_impl, capacity_factor=model_cfg.moe_capacity_factor)
                if model_cfg.is_moe else None)
  if with_flops:
    out["compute"] = compute_report(config, model_cfg, mesh, topo, batch_rows, seq_len, mfu)
  if with_generator:
    g = config.generator
    out["generator"] = compile_generator(
        config, model_cfg, devices, int(g.tensor_parallel),
        int(g.decode_batch), seq_len)
    gen = out["generator"]
    # vLLM (the production generator) holds weights + KV cache + a small workspace; the XLA:CPU
    # decode peak below also counts whole-cache copies the CPU backend makes, so it is reported
    # separately and `fits` uses weights + cache.
    gen["weights_plus_kv_bytes"] = gen["param_bytes"] + gen["kv_cache_bytes"]
    gen["fits"] = bool(gen["weights_plus_kv_bytes"] <= topo.usable_bytes)
  return out


def _ensure_devices(n: int) -> None:
  """Re-executes this program with N fake CPU devices unless XLA_FLAGS already provides them."""
  want = f"{_DEVICE_FLAG}={n}"
  if want in os.environ.get("XLA_FLAGS", "").split() and os.environ.get("JAX_PLATFORMS") == "cpu":
    return
  if os.environ.get("_SCALERL_PLAN_REEXEC"):
    raise RuntimeError(f"re-exec did not provide {n} devices (XLA_FLAGS={os.environ.get('XLA_FLAGS')})")
  env = dict(os.environ, XLA_FLAGS=xla_env.with_device_count(os.environ.get("XLA_FLAGS"), n),
             JAX_PLATFORMS="cpu",
             _SCALERL_PLAN_REEXEC="1")
  sys.stdout.flush()
  os.execve(sys.executable, [sys.executable, "-m", "scalerl_jax.tools.plan", *sys.argv[1:]], env)


def main(argv) -> None:
  del argv
  config = _CONFIG.value
  if config is None:
    raise app.UsageError("--config=configs/NAME.py is required")
  if _TOPOLOGY.value:
    topologies.apply_layout(config, _TOPOLOGY.value)
  elif "layouts" in config:
    topologies.apply_layout(config)   # honours --config.topology=NAME
  else:
    raise app.UsageError("config has no `layouts`; use configs/8b.py or configs/scout.py")
  if _MICROBATCHES.value:
    config.optim.microbatches = _MICROBATCHES.value
  _ensure_devices(topologies.get_topology(config.topology).num_devices)
  print(json.dumps(plan(config, _SEQ_LEN.value or None, with_generator=_GENERATOR.value,
                        with_flops=_FLOPS.value, mfu=_MFU.value,
                        choose_remat=_CHOOSE_REMAT.value)))


if __name__ == "__main__":
  _CONFIG = config_flags.DEFINE_config_file("config", None, "Path to configs/8b.py or scout.py.")
  _TOPOLOGY = flags.DEFINE_string("topology", "", "Topology name (scalerl_jax.topologies); "
                                  "default: config.topology.")
  _SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "Tokens per sequence (default: the learner's pad "
                                  "length, run_config.train_seq_len).")
  _MICROBATCHES = flags.DEFINE_integer("microbatches", 0, "Override config.optim.microbatches.")
  _GENERATOR = flags.DEFINE_boolean("generator", True, "Also compile the generator decode step.")
  _FLOPS = flags.DEFINE_boolean("flops", True, "Also compile the FLOPs probe (compute report).")
  _CHOOSE_REMAT = flags.DEFINE_boolean(
      "choose_remat", False, "Try remat none, dots, full in turn; plan with the first that fits "
      "(reported as remat_choice; the layout's config should name it).")
  _MFU = flags.DEFINE_float("mfu", 0.4, "Model FLOPs utilisation assumed for the step-time "
                            "estimate (bench.learner measured 0.327 on one H200, docs/LEARNER.md).")
  app.run(main)
