"""The "vllm" generator backend (generation/backends.py): a VLLMGenerator engine per worker
(generation/vllm/generator.py; the engine runs in its own venv) and `VLLMSlots`, one engine request
per sample, as its continuous decoder. Imported by the JAX-side generator worker only."""
from __future__ import annotations

import os
import tempfile
from typing import Any, cast

import ml_collections

from scalerl_jax import config as run_config
from scalerl_jax import models
from scalerl_jax import node_cache
from scalerl_jax import recipes
from scalerl_jax.generation.export_cache import cached_export, params_digest
from scalerl_jax.generation.generator import Engine
from scalerl_jax.generation.vllm.generator import VLLMGenerator, VLLMSlots


def vllm_start_dir(model, generator, version: int) -> str:
  """The directory a vLLM engine starts on without `generator.vllm_model_dir`: the run's start
  checkpoint (`model.hf_checkpoint`) when the generator starts at version 0 (which is that
  checkpoint), so nothing is exported; a gs:// checkpoint is copied once per node into
  `generator.ckpt_cache_dir` (node_cache.node_copy: a lock, parallel ranged reads, a manifest;
  vLLM loads from a local path). "" = export the fetched weights (no start checkpoint, or a later
  version). The parity gate checks the engine either way. `model`, `generator`: the sections."""
  ckpt = str(model.hf_checkpoint or "")
  if not ckpt or int(version) != 0:
    return ""
  root = str(generator.ckpt_cache_dir) or os.path.join(tempfile.gettempdir(), "scalerl-ckpt")
  return node_cache.node_copy(ckpt, root, workers=int(generator.ckpt_fetch_workers),
                              piece_bytes=int(generator.ckpt_fetch_piece_mb) << 20,
                              verify=bool(generator.ckpt_cache_verify))


def vllm_args(g) -> dict:
  """The engine's sizing from the generator section `g` (KV cache from gpu_memory_utilization
  unless kv_cache_bytes is set; decode_batch concurrent sequences), then its vllm_args, with
  generator.tensor_parallel as the engine's TP size."""
  extra: dict[str, Any] = dict(kv_cache_bytes=int(g.kv_cache_bytes) or None,
               gpu_memory_utilization=float(g.gpu_memory_utilization),
               max_num_seqs=int(g.decode_batch))
  extra.update({k: (v.to_dict() if isinstance(v, ml_collections.ConfigDict) else v)
                for k, v in dict(g.vllm_args).items()})
  tp = int(g.tensor_parallel or 1)
  if tp > 1:
    extra["engine_args"] = {"tensor_parallel_size": tp, **dict(extra.get("engine_args") or {})}
  return extra


def engine_log_path(workdir: str, generator_id: str) -> str:
  """WORKDIR/logs/vllm-GENERATOR_ID.log: where a generator's vLLM engine writes its stdout and
  stderr (created here; a restarted engine appends)."""
  os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
  return os.path.join(workdir, "logs", f"vllm-{generator_id}.log")


def route_layers(config, model_cfg) -> list[int] | None:
  """With rl.routing_replay or rl.record_routes: the model's MoE layers (the engine layers whose
  routed experts the worker keeps, in order: the routes' layer axis, models.moe_layer_index);
  else None."""
  if not (config.rl.routing_replay or config.rl.record_routes):
    return None
  return [i for i in range(model_cfg.num_layers) if model_cfg.layer_is_moe(i)]


class VLLMEngine(Engine):
  """One vLLM engine per worker, started from the learner's published version: at version 0 the
  run's start policy (model.hf_checkpoint, or the SFT base policy). It loads version 0 of a run
  with a start checkpoint from that checkpoint's directory (`vllm_start_dir`), a fleet's own copy
  (`generator.vllm_model_dir`), or an export of the fetched weights. An evaluation switches the
  engine to the pinned version."""

  def make(self, model_cfg, params, version, workdir, dataset) -> VLLMGenerator:
    config = self.config
    try:   # the fleet's own copy of the checkpoint (the learner's version must equal it), or ""
      model_dir = recipes.vllm_model_dir(config.generator)
    except recipes.ConfigError as e:
      raise SystemExit(f"error: {e}") from None
    engine_dtype = "float32" if model_cfg.dtype == "float32" else "bfloat16"
    if not model_dir:
      model_dir = vllm_start_dir(config.model, config.generator, version)
    if not model_dir:   # exported in the engine's dtype (a bf16 engine: half an fp32 export's bytes)
      # Reused across restarts while the fetched weights are the same (export_cache.py); one
      # per generator (the generators of a local run share its workdir).
      model_dir = os.path.join(workdir, f"vllm_export-{self.generator_id}")
      cached_export(model_dir, params_digest(params, f"{engine_dtype}|{model_cfg}"),
                    lambda d: models.save_hf(model_cfg, params, d, dtype=engine_dtype))
    kw = vllm_args(config.generator)
    # The engine's own stdout/stderr, appended across restarts in the kept workdir (generator
    # pods mount it as a volume that a container restart keeps; docs/RELIABILITY.md).
    kw.setdefault("log_path", engine_log_path(workdir, self.generator_id))
    return VLLMGenerator(
        model_dir, dtype=engine_dtype,
        head_dtype="float32" if model_cfg.fp32_lm_head else None,
        max_model_len=run_config.vllm_max_model_len(config.rollout),
        initial_version=version, seed=int(config.seed), route_layers=route_layers(config, model_cfg),
        **kw)

  def continuous(self, gen, spec, capacity=None) -> VLLMSlots:
    # `gen` is the VLLMGenerator this engine's `generator` built (Engine's contract).
    return VLLMSlots(cast(VLLMGenerator, gen), int(capacity or self.config.generator.decode_batch), spec)

  def devices(self) -> int:
    return int(self.config.generator.tensor_parallel or 1)
