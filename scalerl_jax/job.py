"""One training job, as a library call: `run(config, workdir)` (used by main, compare, benches).

SFT warm start (cached) -> buffer server process -> trainer (learner + evaluator) + generator
processes -> Eq. 1 fit of the run into WORKDIR/fit/. Child processes never outlive the call.
"""
import json
import logging
import os
import secrets
import sys

from scalerl_jax import runtime


_RUN_OUTPUTS = ("metrics.jsonl", "tb", "checkpoints", "buffer_wal", "batches", "fit", "logs",
                "npr_history.json")


def _set_aside_previous_run(workdir: str) -> None:
  """Learner resume from a checkpoint is not wired yet (NOTES.md): a second run in the same
  workdir starts over, and the previous run's outputs are moved (never deleted) to
  WORKDIR/previous-<time>/. The SFT base policy is kept and reused."""
  import time
  old = [n for n in _RUN_OUTPUTS if os.path.exists(os.path.join(workdir, n))]
  if not old:
    return
  dest = os.path.join(workdir, f"previous-{time.strftime('%Y%m%d-%H%M%S')}")
  os.makedirs(dest)
  for n in old:
    os.replace(os.path.join(workdir, n), os.path.join(dest, n))
  logging.warning("workdir %s held a previous run; moved its outputs to %s and starting over "
                  "(resume from checkpoints is not implemented yet)", workdir, dest)


def run(config, workdir: str, progress: bool = True) -> dict:
  """Runs the job described by `config` in `workdir`; returns the final fit summary."""
  from scalerl_jax.data import build_dataset
  from scalerl_jax.processes import ProcessGroup
  from scalerl_jax.rollout.client import BufferClient
  from scalerl_jax.data.export import write_prompts
  from scalerl_jax.sft import warm_start
  from scalerl_jax.trainer import Trainer
  runtime.pin_to_device_cpus(config, "learner")   # before JAX starts its thread pools
  os.environ.setdefault(config.buffer.auth_token_env, secrets.token_hex(16))
  token = os.environ[config.buffer.auth_token_env]
  _set_aside_previous_run(workdir)
  dataset = build_dataset(config.data, config.rollout.max_prompt_len)
  model_cfg = runtime.model_config(config)
  config_path = os.path.join(workdir, "config.json")
  with open(config_path, "w") as f:
    json.dump({**config.to_dict(), "_meta": {"argv": sys.argv}}, f, indent=1, default=str)
  params, sft_info = warm_start(config, model_cfg, dataset, workdir, progress=progress)
  prompts_path = os.path.join(workdir, "train_prompts.jsonl")
  write_prompts(dataset.train, prompts_path)   # the buffer serves only the train split
  procs = ProcessGroup(workdir)
  try:
    # The buffer keeps acknowledged rollouts in a write-ahead log; a crashed buffer is restarted
    # from it by the supervisor, and dead generators are restarted (docs/RELIABILITY.md).
    address = procs.start_buffer(prompts_path, config,
                                 wal_dir=config.buffer.get("wal_dir") or os.path.join(workdir,
                                                                                      "buffer_wal"))
    client = BufferClient(address, token)
    trainer = Trainer(config, workdir, dataset, model_cfg, params, client,
                      gen_devices=int(config.generator.num_workers), progress=progress)
    procs.start_workers(int(config.generator.num_workers), config_path, address,
                        config.generator.backend)
    procs.start_supervisor(interval_s=1.0)
    trainer.watchdog = procs.check
    last = trainer.run()
  finally:
    procs.close()
  logging.info("final held-out pass rate %.3f (%s)", last["val_pass_rate"], sft_info)
  return fit(workdir, progress)


def fit(workdir: str, progress: bool) -> dict:
  """Fits Eq. 1 to this run (and extrapolates from its first half) into WORKDIR/fit/."""
  from analysis.fit import fit_runs
  from analysis.metrics import read_run
  run = read_run(workdir)
  out = os.path.join(workdir, "fit")
  try:
    res = fit_runs([workdir], out, fit_until=float(run.compute[-1]) / 2, n_boot=200,
                   progress=progress)[0]
  except ValueError as e:   # e.g. too few evaluation points for a fit
    logging.warning("Eq. 1 fit skipped: %s", e)
    return {}
  print(f"Eq. 1 fit: A={res['A']:.3f} B={res['B']:.2f} C_mid={res['C_mid']:.3g} "
        f"R2={res['r2']:.3f} -> {out}/fit.json, {out}/curves.png")
  return res


