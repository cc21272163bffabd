"""Learner stall during a checkpoint save: synchronous vs asynchronous saves (issue #18).

    python -m bench.checkpoint [--d_model 512 --layers 8 --steps 40 --every 8]

One jitted learner (our Learner, CISPO + AdamW, a synthetic rollout batch) trains `--steps` steps and
saves a whole-run checkpoint (`checkpoint.RunCheckpointer`: orbax + sha256 manifest) every
`--every` steps, once with `async_save=False` (what main did before: wait for orbax, hash every
file) and once with `async_save=True` (manifest on a background thread). Per step it times the
train step plus the save call made after it (the learner's critical path; a step is synchronised
with `float(loss)`). Reported per mode: the median step time of the steps without a save, the
steps "during a save" (the one that issued it and the ones that ran while its background part was
still writing), and their worst ratio to the median. The last stdout line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time


def _args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--d_model", type=int, default=512)
  p.add_argument("--layers", type=int, default=8)
  p.add_argument("--vocab", type=int, default=8192)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--every", type=int, default=8)
  p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
  return p.parse_args(argv)


def run_mode(async_save: bool, learner, dev_batch, steps: int, every: int, root: str) -> dict:
  from scalerl_jax.checkpoint import RunCheckpointer
  wd = os.path.join(root, "async" if async_save else "sync")
  shutil.rmtree(wd, ignore_errors=True)
  ck = RunCheckpointer(wd, keep=2, async_save=async_save)
  times, during = [], []
  for s in range(steps):
    in_save = ck.saving_step is not None     # a background save still writing as this step starts
    t0 = time.perf_counter()
    learner.state, m = learner._step(learner.state, dev_batch)
    float(m["loss"])
    saved = (s + 1) % every == 0
    if saved:
      ck.save(s + 1, learner.state, {"step": s + 1})
    dt = time.perf_counter() - t0
    times.append(dt)
    during.append(saved or in_save)
  ck.close()
  plain = [t for t, d in zip(times, during) if not d]
  dur = [t for t, d in zip(times, during) if d]
  med = statistics.median(plain)
  return dict(median_step_s=round(med, 4), saves=len(ck.timings),
              during_save_steps=len(dur), during_save_max_s=round(max(dur), 4),
              during_save_median_s=round(statistics.median(dur), 4),
              worst_ratio=round(max(dur) / med, 3),
              save_blocking_s=[round(t["blocking_s"], 3) for t in ck.timings],
              save_total_s=[round(t["total_s"], 3) for t in ck.timings],
              checkpoint_mb=round(sum(os.path.getsize(os.path.join(r, f))
                                      for r, _, fs in os.walk(os.path.join(wd, "checkpoints"))
                                      for f in fs) / 2 / 1e6, 1))


def main(argv=None):
  a = _args(argv)
  import jax
  import jax.numpy as jnp
  from configs import tiny
  from scalerl_jax import models
  from scalerl_jax.learner import Learner
  from bench.learner import make_batch
  cfg = models.get_preset("tiny_llama3", d_model=a.d_model, num_layers=a.layers,
                          num_heads=max(a.d_model // 64, 1), num_kv_heads=max(a.d_model // 128, 1),
                          head_dim=64, ffn_dim=3 * a.d_model, vocab_size=a.vocab,
                          dtype="float32", param_dtype="float32", scan_layers=False, remat="none")
  config = tiny.get_config()
  config.optim.lr, config.optim.warmup_steps, config.optim.microbatches = 1e-6, 1, 1
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  n = sum(int(x.size) for x in jax.tree.leaves(params))
  batch = make_batch(cfg, a.batch, a.seq)
  root = a.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
  out = {}
  for mode in (False, True):
    learner = Learner(lambda p, tok, pos: models.forward_hidden(p, cfg, tok, pos),
                      jax.tree.map(jnp.array, params), config, with_entropy=False)
    dev = learner.device_batch(batch)
    for _ in range(2):                                  # compile + warm up
      learner.state, m = learner._step(learner.state, dev)
      float(m["loss"])
    out["async" if mode else "sync"] = run_mode(mode, learner, dev, a.steps, a.every, root)
    print(("async" if mode else "sync"), json.dumps(out["async" if mode else "sync"]),
          file=sys.stderr, flush=True)
  if not a.dir:
    shutil.rmtree(root, ignore_errors=True)
  res = dict(ours=out["async"]["worst_ratio"], peer=out["sync"]["worst_ratio"],
             unit="worst step time during a save / median step time",
             ratio=round(out["sync"]["worst_ratio"] / out["async"]["worst_ratio"], 2),
             params=n, target_max=1.2, **out)
  print(json.dumps(res))


if __name__ == "__main__":
  main()
