"""One training job, as a library call: `run(config, workdir)` (used by main, compare, benches).

SFT warm start (cached) -> buffer server process -> trainer (learner + evaluator) + generator
processes -> Eq. 1 fit of the run into WORKDIR/fit/. Child processes never outlive the call.

Resume (docs/RELIABILITY.md): with `config.resume = "auto"` (default) a rerun of the same command
in the same workdir continues from the newest valid checkpoint (an invalid newest one is moved
aside and the previous one used); `"never"` starts over (previous outputs are moved, not deleted,
to WORKDIR/previous-<time>/). On resume, metrics.jsonl loses the lines logged after the checkpoint
step (they are redone), the buffer rewinds to that step from its WAL, and the compute ledger books
the whole wall time since the checkpoint was saved (work lost + downtime + restart).
"""
import json
import logging
import os
import secrets
import sys
import time
import uuid
from typing import Any

import jax
from jax._src import distributed as jd

from scalerl_jax import processes
from scalerl_jax.models import sections as model_sections
from analysis.errors import TooFewPointsError
from analysis.fit import PER_TASK, fit_runs, metric_slug
from analysis.forecast import forecast_runs
from analysis.lag import write_lag_summary
from analysis.metrics import read_run, task_metric_keys
from scalerl_jax import config as common
from scalerl_jax.training import checkpoint
from scalerl_jax import rewards
from scalerl_jax import storage
from scalerl_jax.buffer.replay import write_learner_state
from scalerl_jax.data import build_dataset
from scalerl_jax.data.export import write_prompts
from scalerl_jax.processes import ProcessGroup
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.protocol.rpc import TLS
from scalerl_jax.rl import PassRateHistory
from scalerl_jax.training.sft import warm_start
from scalerl_jax.training.trainer import Trainer

TRAINED_IDS = "trained_ids.jsonl"
_RUN_OUTPUTS = (TRAINED_IDS, "metrics.jsonl", "tb", "checkpoints", "buffer_wal", "batches", "fit", "logs",
                "npr_history.json", "learner_state.json", "resumes.jsonl", "checkpoints_invalid")
log = logging.getLogger("scalerl.job")


def _set_aside_previous_run(workdir: str, local: str | None = None) -> bool:
  """A fresh start in a used workdir moves the previous run's outputs (never deletes them) to
  WORKDIR/previous-<time>/ (and those in the run's local dir, e.g. the buffer WAL, to
  LOCAL/previous-<time>/ when the workdir is gs://). The SFT base policy is kept and reused.
  Returns whether there was a previous run (anything moved)."""
  stamp = f"previous-{time.strftime('%Y%m%d-%H%M%S')}"
  moved = False
  for root in dict.fromkeys([workdir, local or workdir]):
    old = [n for n in _RUN_OUTPUTS if storage.exists(storage.join(root, n))]
    if not old:
      continue
    moved = True
    dest = storage.join(root, stamp)
    storage.makedirs(dest)
    for n in old:
      storage.move(storage.join(root, n), storage.join(dest, n))
    logging.warning("%s held a previous run without a usable checkpoint (or resume=never); "
                    "moved its outputs to %s and starting over", root, dest)
  return moved


def truncate_metrics(workdir: str, step: int, name: str = "metrics.jsonl") -> dict:
  """Drops the metrics.jsonl (or `name`) lines logged after checkpoint `step` (and torn lines),
  atomically. Returns {"dropped_lines", "last_step", "last_time"} of the crashed run's tail."""
  path = storage.join(workdir, name)
  keep, dropped, last_step, last_time = [], 0, step, None
  if storage.exists(path):
    for line in storage.read_text(path).splitlines(keepends=True):
      try:
        rec = json.loads(line)
      except ValueError:
        dropped += 1
        continue
      last_step = max(last_step, int(rec.get("step", 0)))
      last_time = rec.get("time", last_time)
      if int(rec.get("step", 0)) <= step:
        keep.append(line if line.endswith("\n") else line + "\n")
      else:
        dropped += 1
    storage.write_text(path, "".join(keep))   # atomic (local: fsync'd temporary + rename)
  return dict(dropped_lines=dropped, last_step=last_step, last_time=last_time)


def prepare_resume(config: common.RunConfig, workdir: str) -> dict | None:
  """Finds the checkpoint to resume from (None: start over) and makes the workdir consistent
  with it: metrics truncated to its step, a resume record in WORKDIR/resumes.jsonl, and the
  learner-state file that tells the buffer to rewind (buffer/replay.py).

  Starting over after a previous run (none of its checkpoints finished, or resume=never) is a
  resume from step 0: the learner-state file carries a resume request for step 0 (with a fresh
  NPR history), so a buffer that kept running with the previous run's versions and deliveries
  restarts and rewinds to step 0 from its WAL instead of refusing version 0 (a fresh buffer has
  nothing to rewind). A first run in an empty workdir writes no request. `config`: the typed
  run config (its resume and checkpoint.verify values are checked there)."""
  mode, vmode = config.resume, config.checkpoint.verify
  found = checkpoint.find_valid(workdir, full=vmode == "full") if mode == "auto" else None
  ls_path = storage.join(workdir, "learner_state.json")
  if found is None:
    previous = _set_aside_previous_run(workdir,
                                       storage.local_dir(workdir, config.local_dir))
    start_over = None
    if previous:
      npr = PassRateHistory(threshold=config.rl.npr_threshold).to_dict()
      start_over = dict(id=uuid.uuid4().hex, step=0, npr=npr, start_over=True)
      log.warning("no valid checkpoint: starting over from step 0 (start-over request %s: a "
                  "running buffer rewinds to step 0)", start_over["id"])
    write_learner_state(ls_path, 0, 0, start_over)
    return None
  step, meta, skipped = found
  tail = truncate_metrics(workdir, step)
  truncate_metrics(workdir, step, TRAINED_IDS)   # audit trail (config.audit.trained_ids)
  now, last = time.time(), tail["last_time"]
  info = dict(t=now, checkpoint_step=step, skipped_checkpoints=skipped,
              redo_steps=tail["last_step"] - step, dropped_metric_lines=tail["dropped_lines"],
              saved_at=meta["saved_at_unix_s"],
              lost_work_s=max(0.0, last - meta["saved_at_unix_s"]) if last else None,
              downtime_s=(now - last) if last else None, resume_id=uuid.uuid4().hex)
  oldest = min(s for s, _ in checkpoint.step_dirs(workdir))
  write_learner_state(ls_path, step, oldest, dict(id=info["resume_id"], step=step,
                                                   npr=meta["npr"]))
  log.warning("resuming from checkpoint %d%s: %d metric lines after it dropped (redoing %d steps)",
              step, f" (invalid newer: {[s['step'] for s in skipped]})" if skipped else "",
              tail["dropped_lines"], info["redo_steps"])
  return info


_WAIT_MS = 6 * 3600 * 1000   # followers wait this long for process 0 (SFT, buffer start, the fit)


def _kv():
  """jax.distributed's coordination key-value store: waits there never hit a collective timeout
  (a gloo collective gives up after ~30 s while process 0 is still busy)."""
  client = jd.global_state.client
  assert client is not None, "jax.distributed.initialize has not run"
  return client


def _share(values: dict | None, key: str = "scalerl/shared") -> dict:
  """Process 0 posts small JSON values (buffer address, token, resume step); others wait for them."""
  if values is not None:
    _kv().key_value_set(key, json.dumps(values))
    return values
  return json.loads(_kv().blocking_key_value_get(key, _WAIT_MS))


def _run_follower(run_cfg: common.RunConfig, workdir: str) -> dict:
  """Processes 1.. of a multi-host learner: same learner loop, no buffer / generators / logs.

  Process 0 shares the buffer address, auth token and resume step; the SFT base policy is read
  from WORKDIR/base_policy once process 0 wrote it (a shared filesystem, as for checkpoints); a
  start checkpoint (model.hf_checkpoint) is read at once, each process its own slices."""
  dataset = build_dataset(run_cfg.data, run_cfg.rollout.max_prompt_len)
  model_cfg = model_sections.model_config(run_cfg)
  if run_cfg.model.hf_checkpoint:   # each process reads its own slices, in parallel
    params, _ = warm_start(run_cfg, model_cfg, dataset, workdir, progress=False)
  shared = _share(None)     # posted once process 0's base policy is written and the buffer is up
  if not run_cfg.model.hf_checkpoint:
    params, _ = warm_start(run_cfg, model_cfg, dataset, workdir, progress=False)
  trainer = Trainer(run_cfg, workdir, dataset, model_cfg, params,
                    BufferClient(shared["address"], shared["token"], tls=TLS.from_config(run_cfg)),
                    token=shared["token"],
                    gen_devices=0,
                    progress=False, resume_step=shared["resume_step"])
  trainer.run()
  # Wait for process 0's fit here, not in jax's shutdown barrier (which times out).
  _share(None, "scalerl/fit_done")
  return {}


def write_run_config(config, workdir: str, local: str) -> str:
  """Writes WORKDIR/config.json (the run config with the command line in `_meta`) and, for a
  remote workdir, its local copy; returns the path the generator processes read."""
  config_text = json.dumps({**config.to_dict(), "_meta": {"argv": sys.argv}}, indent=1, default=str)
  storage.write_text(storage.join(workdir, "config.json"), config_text)
  config_path = os.path.join(local, "config.json")   # the copy the generator processes read
  if config_path != storage.join(workdir, "config.json"):
    storage.write_text(config_path, config_text)
  return config_path


def run(config, workdir: str, progress: bool = True) -> dict:
  """Runs the job described by `config` in `workdir`; returns the final fit summary.

  Multi-host (after `distributed.initialize`): every process calls this; process 0 runs the
  buffer, generators, evaluation and logs, the others only the learner (`_run_follower`)."""
  run_cfg = common.RunConfig.from_config(config)   # the typed run config, built once
  multi = jax.process_count() > 1
  if multi and jax.process_index() != 0:
    return _run_follower(run_cfg, workdir)
  processes.pin_to_device_cpus(run_cfg, "learner")   # before JAX starts its thread pools
  external = bool(run_cfg.buffer.external)   # token checked by recipes.validate
  os.environ.setdefault(run_cfg.buffer.auth_token_env, secrets.token_hex(16))
  token = os.environ[run_cfg.buffer.auth_token_env]
  # gs:// workdirs: what must be on a local disk (WAL, child logs, the files children read) goes to
  # `local` (docs/STORAGE.md); for a local workdir local == workdir.
  local = storage.local_dir(workdir, run_cfg.local_dir)
  os.makedirs(local, exist_ok=True)
  resume = prepare_resume(run_cfg, workdir)
  ls_path = storage.join(workdir, "learner_state.json")
  dataset = build_dataset(run_cfg.data, run_cfg.rollout.max_prompt_len)
  if dataset.needs_sandbox:   # no run without a working sandbox (docs/SANDBOX.md)
    rewards.prepare_code_rewards(run_cfg)
  model_cfg = model_sections.model_config(run_cfg)
  config_path = write_run_config(config, workdir, local)
  params, sft_info = warm_start(run_cfg, model_cfg, dataset, workdir, progress=progress)
  prompts_path = os.path.join(local, "train_prompts.jsonl")
  write_prompts(dataset.train, prompts_path)   # the buffer serves only the train split
  procs = ProcessGroup(local)
  try:
    # The buffer keeps acknowledged rollouts in a write-ahead log; a crashed buffer is restarted
    # from it by the supervisor, and dead generators are restarted (docs/RELIABILITY.md).
    if external:   # buffer and generator fleet are their own jobs (launch/): connect only
      address = run_cfg.buffer.address
      if resume is not None:
        log.warning("resuming with an external buffer: it does not read %s; restart it with "
                    "--learner-state pointing at that file so it rewinds", ls_path)
    else:
      address = procs.start_buffer(
          prompts_path, run_cfg, config_path, learner_state=ls_path,
          wal_dir=run_cfg.buffer.wal_dir or os.path.join(local, "buffer_wal"))
    client = BufferClient(address, token, tls=TLS.from_config(run_cfg))
    if multi:   # the other learner processes join: buffer address, token, resume step
      _share(dict(address=address, token=token,
                  resume_step=resume["checkpoint_step"] if resume else None))
    trainer = Trainer(run_cfg, workdir, dataset, model_cfg, params, client, token=token,
                      gen_devices=int(run_cfg.generator.num_workers), progress=progress,
                      resume_step=resume["checkpoint_step"] if resume else None,
                      learner_state_path=ls_path,
                      watchdog=None if external else procs.check)
    if resume is not None:
      assert trainer.resume_info is not None   # the trainer restored the checkpoint it names
      resume.update(buffer=None if external else procs.buffer_info.get("wal", {}).get("resume"),
                    gap_booked_s=trainer.resume_info["gap_booked_s"])
      storage.append_text(storage.join(workdir, "resumes.jsonl"), json.dumps(resume) + "\n")
    if not external:
      procs.start_workers(int(run_cfg.generator.num_workers), config_path,
                          run_cfg.buffer.generator_address or address,
                          run_cfg.generator.backend)
      procs.start_supervisor(interval_s=1.0)
    last = trainer.run()
    assert last is not None           # process 0 evaluates (R0 or the restored record at least)
  finally:
    procs.close()
    if storage.is_remote(workdir):   # the children's logs (local files) into WORKDIR/logs
      try:
        storage.copy_tree(procs.logdir, storage.join(workdir, "logs"))
      except Exception as e:  # noqa: BLE001 - never hide the run's own error behind this one
        log.warning("could not upload %s to %s/logs: %s", procs.logdir, workdir, e)
  if trainer.preempted:     # SIGTERM: no fit of a cut-off run; the same command resumes it
    logging.warning("SIGTERM: the run stopped before step %d; the same command resumes it",
                    int(run_cfg.total_steps))
    return {}
  logging.info("final held-out pass rate %.3f (%s)", last["val_pass_rate"], sft_info)
  return _fit_and_log(trainer, workdir, int(run_cfg.total_steps), progress, multi)


def _fit_and_log(trainer, workdir: str, total_steps: int, progress: bool, multi: bool) -> dict:
  """The finished run's fit (`fit`), its plots logged to the tracker; the other learner processes
  are told the fit is done. Returns the fit."""
  result = fit(workdir, progress)
  out = storage.join(workdir, "fit")
  trainer.metrics.log_images({"fit/curves": storage.join(out, "curves.png"),
                              "fit/forecast": storage.join(out, "forecast.png"),
                              "fit/lag": storage.join(out, "lag.png")}, step=total_steps)
  trainer.metrics.finish()
  if multi:
    _share({"done": True}, "scalerl/fit_done")
  return result


def fit(workdir: str, progress: bool) -> dict:
  """Fits Eq. 1 to this run (and extrapolates from its first half) into WORKDIR/fit/; a task
  mixture's run also gets one fit per task (`val_pass_rate/<task>`), side by side in curves.png.
  Returns the overall fit, with `per_task` = {task: fit} for a mixture."""
  run = read_run(workdir)
  out = storage.join(workdir, "fit")
  lag = write_lag_summary(workdir, out)   # the staleness summary: fit/lag.json + lag.png
  print(f"lag histogram of trained tokens (lag: count): "
        f"{ {i: c for i, c in enumerate(lag['lag_hist']) if c} } mean {lag['mean_lag']:.2f}; "
        f"max kl_k3 {lag['max_kl_k3']:.3g} -> {out}/lag.png")
  kw: dict[str, Any] = dict(fit_until=float(run.compute[-1]) / 2, n_boot=200, progress=progress)
  per_task = bool(task_metric_keys(workdir))
  try:
    try:
      try:
        results = fit_runs([workdir], out, metrics=PER_TASK if per_task else None, **kw)
      except TooFewPointsError as e:   # a short run: fit all points, without the half-budget check
        logging.warning("half-budget extrapolation skipped (%s); fitting all points", e)
        kw["fit_until"] = None
        results = fit_runs([workdir], out, metrics=PER_TASK if per_task else None, **kw)
    except ValueError as e:
      if not per_task:
        raise
      logging.warning("per-task Eq. 1 fits skipped (%s); fitting the overall pass rate only", e)
      results = fit_runs([workdir], out, **kw)
  except ValueError as e:   # e.g. too few evaluation points for a fit
    logging.warning("Eq. 1 fit skipped: %s", e)
    return {}
  for r in results:
    tag = "" if r["metric"] == "val_pass_rate" else f" [{metric_slug(r['metric'])}]"
    print(f"Eq. 1 fit{tag}: A={r['A']:.3f} B={r['B']:.2f} C_mid={r['C_mid']:.3g} "
          f"R2={r['r2']:.3f}")
  print(f"-> {out}/fit.json, {out}/curves.png")
  res = dict(results[0], lag_hist=lag["lag_hist"], mean_lag=lag["mean_lag"],
             max_kl_k3=lag["max_kl_k3"])
  if len(results) > 1:
    res["per_task"] = {metric_slug(r["metric"]): r for r in results[1:]}
  # what the first half would have forecast
  try:
    fc = forecast_runs([workdir], float(run.compute[-1]), None, out, until=float(run.compute[-1]) / 2)[0]
    print(f"forecast from the first half: {fc['pred']:.3f} [{fc['lo']:.3f}, {fc['hi']:.3f}] at "
          f"{fc['budget']:.3g} h ({fc['verdict']}); measured {run.value[-1]:.3f} -> {out}/forecast.png")
  except ValueError as e:
    logging.warning("forecast skipped: %s", e)
  return res
