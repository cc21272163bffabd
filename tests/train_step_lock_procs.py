"""The train step's behaviour lock (tests/learner/test_train_step_lock.py): one dumped batch per model, the
step's outputs (loss, gradients, metrics) under each loss family and the rollout-correction
switches the recipes use, for configs/tiny.py's dense model and configs/tiny_moe.py's MoE model.

    python tests/train_step_lock_procs.py --write    # (re)writes tests/data/train_step_lock.npz
    python tests/train_step_lock_procs.py --check    # exit 1 and the first differing output

Run in a subprocess with a fixed XLA_FLAGS (the test does), so that the test process's own flags
cannot change the compiled step. Gradients are read exactly: the step runs with an optax
transformation whose state IS the last gradient (`_grad_capture`), and the fixture keeps a sha256
of their bytes and their global norm; one case runs the real clipped AdamW (the sliced in-place
update) and keeps a sha256 of the new params and optimizer state. The fixture is ~60 KB.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "data", "train_step_lock.npz")

# (case name, model, rl overrides, microbatches, pad_multiple, route key, optimizer)
# The rl overrides are the recipes' objectives (scalerl_jax/recipes.py) and correction switches.
CASES = (
    ("dense_scalerl", "dense", {}, 1, 0, None, "capture"),
    ("dense_grpo_lags_m2", "dense", {"loss": "ppo", "aggregation": "sample", "adv_norm": "prompt"},
     2, 0, None, "capture"),
    ("dense_dapo_tis_band_buckets", "dense",
     {"loss": "dapo", "adv_norm": "prompt", "rc_token_tis_cap": 2.0, "rc_token_mask_low": 0.5,
      "rc_token_mask_high": 5.0}, 2, 8, None, "capture"),
    ("dense_gspo_seq_band_seq_tis", "dense",
     {"loss": "gspo", "aggregation": "sample", "rc_seq_mask_low": 0.9, "rc_seq_mask_high": 1.1,
      "rc_seq_tis_cap": 2.0}, 1, 0, None, "capture"),
    ("dense_reinforce_token_nofilter", "dense",
     {"loss": "reinforce", "aggregation": "token", "adv_norm": "none",
      "zero_variance_filter": False}, 2, 0, None, "capture"),
    ("dense_cispo_adamw_m2", "dense", {}, 2, 0, None, "adamw"),
    ("moe_cispo_r3_m2", "moe", {"rc_token_tis_cap": 2.0}, 2, 0, "routes", "capture"),
    ("moe_dapo_recorded_band", "moe",
     {"loss": "dapo", "rc_token_mask_low": 0.5, "rc_token_mask_high": 5.0}, 1, 0, "gen_routes",
     "capture"),
)


def model_config(kind: str):
  """configs/tiny.py's (dense) or configs/tiny_moe.py's (MoE) model: the preset with every
  config.model field that names a ModelConfig field (as the run builds it)."""
  from configs import tiny, tiny_moe
  from scalerl_jax import models
  m = (tiny if kind == "dense" else tiny_moe).get_config().model.to_dict()
  fields = {f.name for f in dataclasses.fields(models.ModelConfig)}
  return models.get_preset(m["preset"], **{k: v for k, v in m.items() if k in fields})


def make_batch(cfg, seed: int, routes: bool) -> dict[str, np.ndarray]:
  """12 rows (3 prompts x 4), T=24: ragged completions, one zero-variance group among 3, lags 0-2."""
  from scalerl_jax import models
  rng = np.random.default_rng(seed)
  B, T, G = 12, 24, 4
  prompt_len = 6
  tokens = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
  ends = rng.integers(prompt_len + 3, T + 1, B)
  mask = (np.arange(T)[None] >= prompt_len) & (np.arange(T)[None] < ends[:, None])
  rewards = rng.integers(0, 2, B).astype(np.float32)
  rewards[G:2 * G] = 1.0                                  # group 1: zero variance
  # The generator's log-probs: the model's own + noise, a few tokens 8x less likely (ratio 8:
  # CISPO's truncation, the TIS cap and the clips bite; the sequence band keeps some rows).
  logits = models.forward(models.init_params(cfg, jax.random.PRNGKey(0)), cfg, tokens,
                          np.broadcast_to(np.arange(T, dtype=np.int32)[None], (B, T)))
  logp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32)), np.float64)
  own = np.concatenate([np.zeros((B, 1)), np.take_along_axis(logp[:, :-1], tokens[:, 1:, None],
                                                             -1)[..., 0]], 1)
  gen = own + 0.1 * rng.standard_normal((B, T))
  gen = np.where(rng.random((B, T)) < 0.05, own - np.log(8.0), gen)
  gen = np.minimum(gen, -1e-6).astype(np.float32)
  out = dict(tokens=tokens, gen_logprobs=np.where(mask, gen, 0.0).astype(np.float32),
             loss_mask=mask, rewards=rewards,
             prompt_ids=np.repeat(np.arange(B // G), G).astype(np.int32),
             lags=rng.integers(0, 3, (B, T)).astype(np.int32))
  if routes:
    r, k, e = models.num_moe_layers(cfg), cfg.num_experts_per_tok, cfg.num_experts
    out["routes"] = rng.integers(0, e, (B, T, r, k)).astype(np.int32)
  return out


def _grad_capture() -> optax.GradientTransformation:
  """An optax transformation whose state after an update is exactly the gradient it was given."""
  return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p),
                                      lambda g, s, p=None: (g, g))


def _sha(tree) -> str:
  h = hashlib.sha256()
  for leaf in jax.tree.leaves(tree):
    h.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
  return h.hexdigest()


def run_case(case, cfg, params, batch) -> dict:
  """The step's outputs of one case: its metrics and a sha256 of its gradients (or, with the real
  optimizer, of the new params and optimizer state)."""
  from scalerl_jax import config as common
  from scalerl_jax import models
  from scalerl_jax.learner import LearnerState, RLSpec, make_optimizer, make_train_step
  name, kind, rl_over, mbs, pad, route_key, opt = case
  rl = dataclasses.replace(common.RL(), **rl_over)
  spec = RLSpec.from_config(rl)
  optimizer = make_optimizer(common.Optim()) if opt == "adamw" else _grad_capture()
  aux = kind == "moe"
  apply_fn = lambda p, tokens, positions, routes=None: models.forward_hidden(
      p, cfg, tokens, positions, routes=routes, return_aux=aux)
  step = jax.jit(make_train_step(apply_fn, optimizer, spec, mbs, pad_multiple=pad,
                                 logits_chunk=16))
  b = {k: v for k, v in batch.items() if k != "routes"}
  if route_key is not None:
    b[route_key] = batch["routes"]
  state = LearnerState.create(params, optimizer)
  new, metrics = step(state, jax.device_put(b))
  metrics = {k: np.asarray(v) for k, v in jax.device_get(metrics).items()}
  out = {f"{name}/m/{k}": v for k, v in metrics.items()}
  if opt == "adamw":
    out[f"{name}/sha_state"] = np.asarray(_sha((new.params, new.opt_state, new.step)))
  else:
    grads = new.opt_state
    out[f"{name}/sha_grads"] = np.asarray(_sha(grads))
    out[f"{name}/grad_global_norm"] = np.asarray(optax.tree.norm(grads))
  return out


def outputs() -> dict[str, np.ndarray]:
  """Every case's outputs, the batches and a sha256 of each model's initial params."""
  from scalerl_jax import models
  out: dict[str, np.ndarray] = {}
  ready = {}
  for i, kind in enumerate(("dense", "moe")):
    cfg = model_config(kind)
    params = models.init_params(cfg, jax.random.PRNGKey(0))
    batch = make_batch(cfg, 7 + i, routes=cfg.is_moe)
    ready[kind] = cfg, params, batch
    out[f"{kind}/sha_params"] = np.asarray(_sha(params))
    out.update({f"{kind}/batch/{k}": v for k, v in batch.items()})
  for case in CASES:
    cfg, params, batch = ready[case[1]]
    out.update(run_case(case, cfg, jax.tree.map(jnp.array, params), batch))
  return out


def compare(got: dict, want: dict) -> list[str]:
  """The differing keys, each with both values (bit-level: bytes of the arrays)."""
  diffs = [f"missing in the fixture: {k}" for k in sorted(set(got) - set(want))]
  diffs += [f"missing now: {k}" for k in sorted(set(want) - set(got))]
  for k in sorted(set(got) & set(want)):
    a, b = np.asarray(got[k]), np.asarray(want[k])
    if a.dtype != b.dtype or a.shape != b.shape or a.tobytes() != b.tobytes():
      diffs.append(f"{k}: now {a.tolist()!r} fixture {b.tolist()!r}")
  return diffs


def main(argv) -> int:
  got = outputs()
  if "--write" in argv:
    np.savez_compressed(FIXTURE, **got)
    print(json.dumps({"wrote": FIXTURE, "keys": len(got), "bytes": os.path.getsize(FIXTURE)}))
    return 0
  with np.load(FIXTURE) as f:
    want = {k: f[k] for k in f.files}
  diffs = compare(got, want)
  print(json.dumps({"keys": len(got), "differ": len(diffs), "first": diffs[:10]}))
  return 1 if diffs else 0


if __name__ == "__main__":
  sys.path.insert(0, ROOT)
  sys.exit(main(sys.argv[1:]))
