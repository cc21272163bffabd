"""Supervised warm start: the base policy RL starts from (the paper starts from an SFT model).

`warm_start(config, model_cfg, dataset, workdir)` trains on the dataset's SFT traces with token-level
cross-entropy (loss only on `loss_mask` tokens: never on the prompt or injected interruption text),
writes the result as an HF safetensors directory `WORKDIR/base_policy/` and returns the params. A
later run with the same workdir loads that directory instead of training again.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from scalerl_jax import models

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


def train_sft(model_cfg, params, tokens: np.ndarray, mask: np.ndarray, *, steps: int,
              batch_size: int, lr: float, seed: int = 0, progress: bool = True):
  """Runs `steps` AdamW steps of masked next-token cross-entropy; returns (params, last losses)."""
  if tokens.shape != mask.shape or tokens.ndim != 2:
    raise ValueError(f"tokens {tokens.shape} and mask {mask.shape} must be equal 2-D shapes")
  if len(tokens) < batch_size:
    raise ValueError(f"{len(tokens)} SFT examples < batch size {batch_size}")
  opt = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, lr, max(1, steps // 10), steps,
                                                       lr * 0.1), weight_decay=0.0)
  params = jax.tree.map(jnp.asarray, params)
  opt_state = opt.init(params)
  rng = np.random.default_rng(seed)
  losses = []
  for _ in tqdm(range(steps), desc="SFT warm start", disable=not progress, leave=False):
    idx = rng.choice(len(tokens), batch_size, replace=False)
    params, opt_state, loss = _step(params, model_cfg, opt, opt_state, jnp.asarray(tokens[idx]),
                                    jnp.asarray(mask[idx]))
    losses.append(float(loss))
  return params, losses


def warm_start(config, model_cfg, dataset, workdir: str, progress: bool = True):
  """Loads WORKDIR/base_policy if present, else trains it (config.sft) and saves it there."""
  path = os.path.join(workdir, BASE_DIR)
  if os.path.exists(os.path.join(path, "config.json")):
    logging.info("SFT warm start: loading cached base policy from %s", path)
    _, params = models.load_hf(path, **_numerics(model_cfg))
    return params, {"sft_cached": True}
  if not hasattr(dataset, "sft_batch"):
    raise ValueError(f"dataset kind {config.data.kind!r} has no SFT traces; set "
                     "config.model.hf_checkpoint to an SFT checkpoint instead")
  tokens, mask = dataset.sft_batch(config.sft.num_examples, seed=config.seed)
  params = models.init_params(model_cfg, jax.random.PRNGKey(config.seed))
  t0 = time.time()
  params, losses = train_sft(model_cfg, params, tokens, mask, steps=config.sft.steps,
                             batch_size=config.sft.batch_size, lr=config.sft.lr,
                             seed=config.seed, progress=progress)
  info = {"sft_cached": False, "sft_steps": config.sft.steps, "sft_seconds": time.time() - t0,
          "sft_final_loss": float(np.mean(losses[-10:]))}
  tmp = path + ".tmp"
  models.save_hf(model_cfg, jax.device_get(params), tmp)
  with open(os.path.join(tmp, "sft_info.json"), "w") as f:
    json.dump(info, f)
  os.replace(tmp, path)
  logging.info("SFT warm start: %d steps in %.0f s, final loss %.3f -> %s", config.sft.steps,
               info["sft_seconds"], info["sft_final_loss"], path)
  return params, info


def _numerics(model_cfg) -> dict:
  return dict(param_dtype=model_cfg.param_dtype, dtype=model_cfg.dtype,
              fp32_lm_head=model_cfg.fp32_lm_head, scan_layers=model_cfg.scan_layers,
              remat=model_cfg.remat)
