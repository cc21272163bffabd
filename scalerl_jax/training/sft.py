"""The start policy of a run: `model.hf_checkpoint` when set, else a supervised warm start.

With `config.model.hf_checkpoint` (a save_pretrained directory, local or gs://) the checkpoint IS
the start policy: every learner process reads only the slices its devices hold, straight from the
safetensors files (models/hf_slices.py), into the run's mesh; no SFT runs and WORKDIR/base_policy
is neither read nor written (an existing one, from an earlier SFT run in this workdir, is ignored
with a warning). Without a checkpoint, a dataset that ships SFT traces gets the supervised warm
start below (the paper starts from an SFT model); one that ships none is an error.

`warm_start(config, model_cfg, dataset, workdir)` trains on the dataset's SFT traces with token-level
cross-entropy (loss only on `loss_mask` tokens: never on the prompt or injected interruption text):
first `config.sft.clean_steps` steps on noise-free traces (a tiny model learns the task's step
function quickly from clean data but plateaus for thousands of steps on noisy data alone), then
`config.sft.steps` steps on the noisy traces, which calibrate the policy to the intended
per-step error rate (held-out pass rate ~0.2 at temperature 1: room for RL to climb),
writes the result as an HF safetensors directory `WORKDIR/base_policy/` and returns the params. A
later run with the same workdir loads that directory instead of training again.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax import sharding
from scalerl_jax import storage
from scalerl_jax.models import hf_slices

BASE_DIR = "base_policy"


def _loss(params, cfg, tokens, mask):
  logits = models.forward(params, cfg, tokens)
  logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
  nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
  m = mask[:, 1:].astype(jnp.float32)
  return jnp.sum(nll * m) / jnp.maximum(jnp.sum(m), 1.0)


@functools.partial(jax.jit, static_argnums=(1, 2), donate_argnums=(0, 3))
def _step(params, cfg, opt, opt_state, tokens, mask):
  loss, grads = jax.value_and_grad(_loss)(params, cfg, tokens, mask)
  updates, opt_state = opt.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def train_sft(model_cfg, params, phases, *, batch_size: int, lr: float, seed: int = 0,
              progress: bool = True) -> tuple[Any, list[float]]:
  """AdamW on masked next-token cross-entropy over `phases` = [(tokens, mask, steps), ...] in
  order (one optimizer throughout); returns (params, losses)."""
  total = sum(n for _, _, n in phases)
  for tokens, mask, _ in phases:
    if tokens.shape != mask.shape or tokens.ndim != 2:
      raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be equal 2-D shapes")
    if len(tokens) < batch_size:
      raise ValueError(f"{len(tokens)} SFT examples < batch size {batch_size}")
  opt = optax.adamw(optax.warmup_constant_schedule(0.0, lr, min(50, max(1, total // 10))),
                    weight_decay=0.0)
  params = jax.tree.map(jnp.asarray, params)
  opt_state = opt.init(params)
  rng = np.random.default_rng(seed)
  losses = []
  bar = tqdm(total=total, desc="SFT warm start", disable=not progress, leave=False)
  schedule = [(tokens, mask) for tokens, mask, n in phases for _ in range(n)]
  for tokens, mask in schedule:
    bar.update()
    idx = rng.choice(len(tokens), batch_size, replace=False)
    params, opt_state, loss = _step(params, model_cfg, opt, opt_state, jnp.asarray(tokens[idx]),
                                    jnp.asarray(mask[idx]))
    losses.append(float(loss))
  bar.close()
  return params, losses


def start_from_checkpoint(config, model_cfg, path: str, workdir: str | None = None
                          ) -> tuple[Any, dict[str, Any]]:
  """Params of the start checkpoint `path`, already placed: sharded over the mesh of
  `config.mesh.shape` (rules table) when JAX has several devices (every process calls this and
  reads only its own slices), else on the one device. Returns (params, info)."""
  if workdir and storage.exists(storage.join(workdir, BASE_DIR, "config.json")):
    logging.warning("model.hf_checkpoint=%s is the start policy: ignoring %s (an earlier SFT "
                    "warm start in this workdir)", path, storage.join(workdir, BASE_DIR))
  if jax.device_count() > 1:
    mesh = sharding.make_mesh(config.mesh.shape)
    shardings = sharding.param_shardings(model_cfg, mesh, config.mesh.rules)
  else:
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree.map(lambda _: one, sharding.abstract_params(model_cfg))
  params, stats = hf_slices.load_sharded(path, model_cfg, shardings)
  logging.info("start policy: %s (%.0f MB read by this process in %d requests, %.1f s; its "
               "devices hold %.0f MB)", path, stats["bytes_read"] / 1e6, stats["requests"],
               stats["seconds"], stats["local_param_bytes"] / 1e6)
  return params, {"start": "hf_checkpoint", "hf_checkpoint": path, **stats}


def warm_start(config: common.RunConfig, model_cfg, dataset, workdir: str, progress: bool = True
               ) -> tuple[Any, dict[str, Any]]:
  """The start policy: `model.hf_checkpoint` when set (`start_from_checkpoint`); else
  WORKDIR/base_policy if present, else SFT on the dataset's traces (config.sft), saved there."""
  ckpt = str(config.model.hf_checkpoint or "")
  if ckpt:
    return start_from_checkpoint(config, model_cfg, ckpt, workdir)
  path = storage.join(workdir, BASE_DIR)
  if storage.exists(storage.join(path, "config.json")):   # written last: the copy is complete
    logging.info("SFT warm start: loading cached base policy from %s", path)
    with storage.local_copy(path) as local:                # gs://: fetched to a temporary dir
      _, params = models.load_hf(local, **_numerics(model_cfg))
    return params, {"sft_cached": True}
  if dataset.sft is None:
    raise ValueError(f"dataset kind {config.data.kind!r} has no SFT traces; set "
                     "config.model.hf_checkpoint to the start (SFT) checkpoint")
  cache = cache_entry(config)
  if cache and os.path.exists(os.path.join(cache, "config.json")):
    logging.info("SFT warm start: from the shared cache %s", cache)
    _, params = models.load_hf(cache, **_numerics(model_cfg))
    with open(os.path.join(cache, "sft_info.json")) as f:
      info = dict(json.load(f), sft_cache=cache)
  else:
    params, info = _run_sft(config, model_cfg, dataset, progress)
    if cache:
      _fill_cache(cache, model_cfg, params, info)
  if storage.is_remote(path):   # staged locally, uploaded with config.json last
    with storage.staged_dir(path) as tmp:
      _save_policy(tmp, model_cfg, params, info)
  else:
    tmp = path + ".tmp"
    _save_policy(tmp, model_cfg, params, info)
    os.replace(tmp, path)
  logging.info("SFT warm start: %d steps in %.0f s, final loss %.3f -> %s", config.sft.steps,
               info["sft_seconds"], info["sft_final_loss"], path)
  return params, info


def _run_sft(config, model_cfg, dataset, progress: bool):
  n = config.sft.num_examples
  phases = []
  if config.sft.clean_steps:
    phases.append((*dataset.sft_batch(n, seed=config.seed, step_noise=0.0), config.sft.clean_steps))
  phases.append((*dataset.sft_batch(n, seed=config.seed + 1), config.sft.steps))
  params = models.init_params(model_cfg, jax.random.PRNGKey(config.seed))
  t0 = time.time()
  params, losses = train_sft(model_cfg, params, phases, batch_size=config.sft.batch_size,
                             lr=config.sft.lr, seed=config.seed, progress=progress)
  return params, {"sft_cached": False, "sft_steps": config.sft.steps,
                  "sft_clean_steps": config.sft.clean_steps,
                  "sft_seconds": time.time() - t0, "sft_final_loss": float(np.mean(losses[-10:]))}


def cache_entry(config: common.RunConfig) -> str:
  """The shared warm-start cache directory for this config (`sft.cache_dir`, else
  $SCALERL_SFT_CACHE_DIR; "" = no cache): one subdirectory per sha256 of everything the warm
  start depends on (the model, sft, data sections and the seed), so a different config never
  reuses another's policy."""
  root = str(config.sft.cache_dir or os.environ.get("SCALERL_SFT_CACHE_DIR", ""))
  if not root:
    return ""
  if storage.is_remote(root):
    raise ValueError(f"sft.cache_dir={root!r}: must be a local directory")
  sft_cfg = {k: v for k, v in config.sft.to_dict().items() if k != "cache_dir"}
  key = json.dumps(dict(model=config.model.to_dict(), sft=sft_cfg, data=config.data.to_dict(),
                        seed=config.seed), sort_keys=True, default=str)
  return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:24])


def _fill_cache(entry: str, model_cfg, params, info: dict) -> None:
  """Writes the entry once (a temporary directory renamed into place: two runs finishing the
  same warm start at once leave one complete copy)."""
  if os.path.exists(entry):
    return
  tmp = f"{entry}.tmp-{os.getpid()}"
  _save_policy(tmp, model_cfg, params, info)
  try:
    os.rename(tmp, entry)
  except OSError:          # another run put it there first
    shutil.rmtree(tmp, ignore_errors=True)


def _save_policy(directory: str, model_cfg, params, info: dict) -> None:
  """A warm start as written everywhere: HF safetensors + config.json, and sft_info.json."""
  models.save_hf(model_cfg, jax.device_get(params), directory)
  with open(os.path.join(directory, "sft_info.json"), "w") as f:
    json.dump(info, f)


def _numerics(model_cfg) -> dict:
  return dict(param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype,
              fp32_lm_head=model_cfg.fp32_lm_head, scan_layers=model_cfg.scan_layers,
              remat=model_cfg.remat)
