"""Learner stall during a checkpoint save: synchronous vs asynchronous saves (issue #18).

    python -m bench.checkpoint [--d_model 256 --layers 4 --steps 40 --every 4]

One jitted learner (our Learner, CISPO + AdamW, a synthetic rollout batch) trains `--steps` steps and
saves a whole-run checkpoint (`checkpoint.RunCheckpointer`: orbax + sha256 manifest) every
`--every` steps, with `async_save=False` (what main did before: wait for orbax, hash every file)
and with `async_save=True` (manifest on a background thread): two learners that step in turn, so
the load of a shared machine hits both alike. Per step it times the train step plus the save call
made after it (the learner's critical path; a step is synchronised with `float(loss)`). Reported
per mode: the median step time of the steps without a save, the steps "during a save" (the one
that issued it and the ones that ran while its background part was still writing): their median
and worst time and both ratios to the median, and the save call's own seconds. The last stdout
line is one JSON object (ours = async median ratio, peer = sync).
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
  p.add_argument("--d_model", type=int, default=256)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--vocab", type=int, default=4096)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=128)
  p.add_argument("--steps", type=int, default=40)
  p.add_argument("--every", type=int, default=4)
  p.add_argument("--dir", default=None, help="where checkpoints go (default: a temp dir)")
  return p.parse_args(argv)


def run_modes(learners: dict, dev_batch, steps: int, every: int, root: str) -> dict:
  """Both modes step in turn (same load on a shared machine); returns per-mode timings."""
  from scalerl_jax.training.checkpoint import RunCheckpointer
  cks, times, during = {}, {}, {}
  for mode in learners:
    wd = os.path.join(root, mode)
    shutil.rmtree(wd, ignore_errors=True)
    cks[mode] = RunCheckpointer(wd, keep=2, async_save=mode == "async")
    times[mode], during[mode] = [], []
  for s in range(steps):
    for mode, learner in learners.items():
      ck = cks[mode]
      in_save = ck.saving_step is not None     # a background save still writing as this step starts
      t0 = time.perf_counter()
      learner.state, m = learner._step(learner.state, dev_batch)
      float(m["loss"])
      saved = (s + 1) % every == 0
      if saved:
        ck.save(s + 1, learner.state, {"step": s + 1})
      times[mode].append(time.perf_counter() - t0)
      during[mode].append(saved or in_save)
  out = {}
  for mode, ck in cks.items():
    ck.close()
    plain = [t for t, d in zip(times[mode], during[mode]) if not d]
    dur = [t for t, d in zip(times[mode], during[mode]) if d]
    med = statistics.median(plain)
    wd = os.path.join(root, mode, "checkpoints")
    out[mode] = dict(
        median_step_s=round(med, 4), saves=len(ck.timings), during_save_steps=len(dur),
        during_save_median_s=round(statistics.median(dur), 4),
        during_save_max_s=round(max(dur), 4),
        median_ratio=round(statistics.median(dur) / med, 3), worst_ratio=round(max(dur) / med, 3),
        save_call_s=[round(t["blocking_s"] if mode == "async" else t["total_s"], 3)
                     for t in ck.timings],
        save_background_s=[round(t["total_s"], 3) for t in ck.timings] if mode == "async" else None,
        checkpoint_mb=round(sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(wd)
                                for f in fs) / 2 / 1e6, 1))
  return out


def main(argv=None):
  a = _args(argv)
  import jax
  import jax.numpy as jnp
  from scalerl_jax import config as common
  from scalerl_jax import models
  from scalerl_jax.learner import Learner
  from bench.learner import make_batch
  cfg = models.get_preset("tiny_llama3", d_model=a.d_model, num_layers=a.layers,
                          num_heads=max(a.d_model // 64, 1), num_kv_heads=max(a.d_model // 128, 1),
                          head_dim=64, ffn_dim=3 * a.d_model, vocab_size=a.vocab,
                          dtype="float32", param_dtype="float32", scan_layers=False, remat="none")
  run = common.resolve("configs/tiny.py", ["--config.optim.lr=1e-6", "--config.optim.warmup_steps=1",
                                           "--config.optim.microbatches=1"])
  params = models.init_params(cfg, jax.random.PRNGKey(0))
  n = sum(int(x.size) for x in jax.tree.leaves(params))
  batch = make_batch(cfg, a.batch, a.seq)
  root = a.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
  learners = {}
  for mode in ("sync", "async"):
    learner = Learner.for_run(lambda p, tok, pos: models.forward_hidden(p, cfg, tok, pos),
                              jax.tree.map(jnp.array, params), run,
                              with_entropy=False)
    dev = learner.device_batch(batch)
    for _ in range(2):                                  # compile + warm up
      learner.state, m = learner._step(learner.state, dev)
      float(m["loss"])
    learners[mode] = learner
  out = run_modes(learners, dev, a.steps, a.every, root)
  for mode in out:
    print(mode, json.dumps(out[mode]), file=sys.stderr, flush=True)
  if not a.dir:
    shutil.rmtree(root, ignore_errors=True)
  res = dict(ours=out["async"]["median_ratio"], peer=out["sync"]["median_ratio"],
             unit="median step time during a save / median step time (async vs sync)",
             ratio=round(out["sync"]["median_ratio"] / out["async"]["median_ratio"], 2),
             params=n, target_max=1.2, **out)
  print(json.dumps(res))


if __name__ == "__main__":
  main()
