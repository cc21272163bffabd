"""The learner loop of a run: pull complete groups from the buffer, train, publish, evaluate, log.

Each step s:
  1. `PullBatch(s)` blocks until the buffer has `prompts_per_step` complete groups whose oldest token
     is at most k versions old (PipelineRL-k admission lives in the buffer);
  2. one optimizer step (CISPO & co. in float32; zero-variance groups dropped in the step);
  3. the new params are published as version s+1 (generators swap them in flight);
  4. every `eval.every_steps` steps, mean@N pass rate on the held-out split, logged with
     `compute_hours` (docs/METRICS.md) — the points Eq. 1 is fitted to;
  5. every `checkpoint.every_steps` steps, the whole run state (`save`, docs/RELIABILITY.md).

`Trainer(..., resume_step=c)` restores checkpoint c (learner state, ledger with the crash gap
booked, NPR history, consumption offsets) and continues at step c.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from typing import Any

import grpc
import jax
import numpy as np

from scalerl_jax.generation import interruption
from scalerl_jax import config as common
from scalerl_jax import distributed
from scalerl_jax import models
from scalerl_jax.models import hf_export
from scalerl_jax import sharding
from scalerl_jax import storage
from scalerl_jax.progress import Beacon
from scalerl_jax.buffer.replay import read_learner_state
from scalerl_jax.buffer.replay import write_learner_state
from scalerl_jax.training.checkpoint import RunCheckpointer
from scalerl_jax.data import stats_metrics
from scalerl_jax.generation import backends
from scalerl_jax.training.evaluation import EVALUATIONS, EvalContext
from scalerl_jax.training.hooks import (BeforeView, CheckpointHook, HealthHook, HookOut, Hooks,
                                        ParityGate, Progress, StepView)
from scalerl_jax.training.fleet_eval import eval_prompts
from scalerl_jax.learner import Learner
from scalerl_jax.learner.batch import length_sorted_order
from scalerl_jax.learner.logprobs import token_logprobs
from scalerl_jax.protocol import codec
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.training.health import (HealthMonitor, LiveForecast, NoRewardSignal, RunUnhealthy,
                                         step0_reward_check)
from scalerl_jax.training.ledger import ComputeLedger, StepTokens
from scalerl_jax.training.preemption import Preemption
from scalerl_jax.protocol.client import batch_to_arrays
from scalerl_jax.protocol.rpc import TLS
from scalerl_jax.protocol.wire import tune_malloc
from scalerl_jax.rewards import isolation
from scalerl_jax.rewards.isolation import FAULTS as GRADE_FAULTS
from scalerl_jax.rl import PassRateHistory
from scalerl_jax.tools.describe import count_params
from scalerl_jax.training.tracking import MetricsLog, NoTracker
from scalerl_jax.weights.delta import DeltaEncoder
from scalerl_jax.weights.source import WeightSource
from scalerl_jax.weights.stream import StreamPublisher

log = logging.getLogger("scalerl.trainer")


def learner_token_logprobs(model_cfg, params, tokens, temperature: float = 1.0,
                           routes=None) -> np.ndarray:
  """logp[b, t] = log pi_learner(tokens[b, t] | tokens[b, <t]) at `temperature`, float32 (0 at t=0):
  the learner's side of the IS ratio, for the parity gate. `routes` int [B,T,R,K]: the generator's
  expert choices (MoE routing replay), as the learner's step uses them."""
  tokens = np.asarray(tokens, np.int32)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32)[None], tokens.shape)
  fn = _LOGP_FNS.get(model_cfg)
  if fn is None:
    def logp(p, tok, pos, t, routes) -> jax.Array:
      logits = models.forward(p, model_cfg, tok, pos, routes=routes)
      return token_logprobs(logits.astype(jax.numpy.float32) / t, tok, with_entropy=False)[0]
    fn = _LOGP_FNS[model_cfg] = jax.jit(logp)
  if routes is not None:
    routes = np.asarray(routes, np.int32)
  return np.asarray(fn(params, tokens, positions, np.float32(temperature), routes))


_LOGP_FNS: dict = {}   # ModelConfig (frozen, hashable) -> its jitted log-prob function


def pad_time(arrays: dict, multiple: int, max_len: int) -> dict:
  """Right-pads the token axis (batch_to_arrays: the longest row's length) to
  `common.padded_length`: a multiple of `learner.pad_multiple`, never above `max_len`."""
  T = arrays["tokens"].shape[1]
  T2 = common.padded_length(T, multiple, max_len)
  if T2 == T:
    return arrays
  out = dict(arrays)
  for k in ("tokens", "gen_logprobs", "loss_mask", "versions", "routes", "gen_routes"):
    if k in arrays:
      out[k] = np.pad(arrays[k], ((0, 0), (0, T2 - T)) + ((0, 0),) * (arrays[k].ndim - 2))
  return out


def make_learner(config: common.RunConfig, model_cfg, params) -> Learner:
  """The learner of a run (`config`: the typed run config). One device: a plain `Learner`. Several devices (a GPU host, a TPU
  slice, or several JAX processes): `distributed.MultiHostLearner` over the mesh of
  `config.mesh.shape` with the rules table's parameter shardings; `params` (host numpy, the same
  on every process) are placed shard by shard, never gathered on one device."""
  if config.rl.routing_replay and not model_cfg.is_moe:
    raise ValueError("rl.routing_replay=True needs an MoE model")
  # (hidden, head kernel): the learner computes log-probs over sequence chunks (logits_chunk);
  # capacity-mode MoE adds aux {'moe_dropped'} (dropped token-expert copies, a metric).
  # MoE with recorded routes: aux {'own_routes'} (the router_disagree metric).
  recorded = config.rl.routing_replay or config.rl.record_routes
  aux = model_cfg.is_moe and (recorded or (model_cfg.moe_impl == "dispatch"
                                           and model_cfg.moe_capacity_factor > 0))
  apply_fn = lambda p, tokens, positions, routes=None: models.forward_hidden(
      p, model_cfg, tokens, positions, routes=routes, return_aux=aux)
  route_shape = None
  if recorded and model_cfg.is_moe:
    route_shape = (models.num_moe_layers(model_cfg), model_cfg.num_experts_per_tok,
                   model_cfg.num_experts)
  if jax.device_count() == 1:
    return Learner.for_run(apply_fn, jax.tree.map(np.array, params), config,
                           vocab_size=model_cfg.vocab_size, route_shape=route_shape)
  mesh = sharding.make_mesh(config.mesh.shape)
  shardings = sharding.param_shardings(model_cfg, mesh, config.mesh.rules)
  placed = sharding.shard_params(params, model_cfg, mesh, config.mesh.rules)
  return distributed.MultiHostLearner.for_run(apply_fn, placed, config, mesh=mesh,
                                              params_sharding=shardings,
                                              vocab_size=model_cfg.vocab_size,
                                              route_shape=route_shape)


def generator_metrics(stats) -> dict:
  """The generators' heartbeat counters (BatchSummary.generator_stats, cumulative over the run,
  all generators) as metrics: gen_occupancy = sequences in flight / slots over every decode step
  so far; gen_idle_s / gen_grade_s / gen_decode_s: seconds waiting for leases or weights with
  empty slots, grading, decoding; gen_graded and gen_grade_{timeout,oom,error,guard}: grades done
  and those scored 0 by a grading fault (rewards/isolation.py), with gen_grade_fail_frac their
  fraction. {} before the first heartbeat with counters arrives."""
  stats = dict(stats)
  # Weight sync: failed updates (cumulative) and generators behind (a gauge, buffer-side).
  sync = {f"gen_{k}": stats[k] for k in ("weight_failures", "delta_fallbacks", "generators_behind")
          if k in stats}
  if not stats.get("slot_steps"):
    return sync
  live = stats.get("live_row_steps", 0.0)
  compute = ({"gen_compute_occupancy": live / stats["row_steps"]} if stats.get("row_steps")
             else {})
  grading = {}
  if "graded" in stats:   # generators that count their grades (issue 46)
    faults = {f"gen_{k}": stats.get(k, 0.0) for k in GRADE_FAULTS}
    graded = stats["graded"]
    grading = {"gen_graded": graded, **faults,
               "gen_grade_fail_frac": sum(faults.values()) / graded if graded else 0.0}
  return {"gen_occupancy": live / stats["slot_steps"], **compute, **sync,
          **{f"gen_{k}": stats.get(k, 0.0) for k in ("idle_s", "grade_s", "decode_s")}, **grading}


class Trainer:
  """Owns the Learner, the buffer client (learner side), the ledger and the logs.

  Multi-host (several JAX processes): every process builds a Trainer and runs the same loop.
  Process 0 pulls each batch from the buffer and hands it to the others
  (`distributed.broadcast_from_main`); each process feeds its own rows to the sharded step; every
  process streams its own parameter shards to the buffer (no gather); evaluation gathers the params
  and runs on process 0, which alone writes metrics, the checkpoint manifest and the learner-state
  file. Orbax saves and restores the sharded state collectively.
  """
  preempted = False    # `run` stopped on SIGTERM (training/preemption.py): the run is not finished

  def __init__(self, config: common.RunConfig, workdir, dataset, model_cfg, params, client, *,
               token: str,
               gen_devices: int,
               progress: bool = True, resume_step: int | None = None,
               learner_state_path: str | None = None, watchdog=None):
    self.config, self.workdir, self.dataset, self.model_cfg = config, workdir, dataset, model_cfg
    self.main, self.multi = jax.process_index() == 0, jax.process_count() > 1
    self.client = client
    self.token = token       # the buffer's bearer token, also required by this process's weight source
    self.learner = make_learner(config, model_cfg, params)
    n_active = _params_active(model_cfg)
    self.ledger = ComputeLedger(train_devices=jax.device_count(), gen_devices=gen_devices,
                                params_active=n_active)
    self.npr = PassRateHistory(threshold=config.rl.npr_threshold)
    self.eval_spec = interruption.sampling_spec(config, dataset, seed=12345,
                                           temperature=float(config.eval.temperature),
                                           top_p=float(config.eval.top_p))
    self.last_eval: dict | None = None   # R0 / the restored checkpoint's on, the newest eval record
    # Evaluation (docs/ROLLOUT.md "Evaluation through the fleet"): eval.num_prompts held-out
    # prompts, either sampled here (mode "local") or by the generators through the buffer's
    # evaluation lane (mode "fleet": process 0 submits and collects rewards; nothing collective).
    self.eval_set = eval_prompts(dataset.heldout, int(config.eval.num_prompts), int(config.seed))
    # A callable raising when a child process died (job.py: ProcessGroup.check), or None.
    self.watchdog = watchdog
    self.ckpt = RunCheckpointer.for_section(workdir, config.checkpoint)
    self.audit_ids = bool(config.audit.trained_ids) and self.main
    self.learner_state_path = learner_state_path
    self.source, self.sources = self._start_weight_source()
    self._delta: DeltaEncoder | None = None     # weights/delta.py, created at the first publish
    self.delta_frac: float | None = None        # the last version's delta / full bytes (bf16 wire)
    self.start_step = 0
    # Consumption offsets: what the learner trained, as counts and a chained sha256 over the ids.
    self.consumed: dict[str, Any] = dict(step=0, groups=0, rollouts=0, ids_sha256="", recent={})
    self.resume_info = None
    if resume_step is not None:
      self._restore(resume_step)
    self.metrics = (MetricsLog(workdir, purge_step=self.start_step + 1 if self.start_step else None,
                               wandb_cfg=config.wandb, run_config=config.to_dict(),
                               local_dir=storage.local_dir(workdir, config.local_dir))
                    if self.main else NoTracker())
    self.health = HealthMonitor(config.health)
    isolation.configure(config.rewards)   # local evaluation and the step-0 check grade here too
    # liveness from progress (learner.progress_file): touched at every publish, i.e. every step
    self.beacon = Beacon(config.learner.progress_file)
    self.beacon.tick()
    fc = config.forecast
    self.forecast = (LiveForecast(workdir, self.metrics.write, n_draws=int(fc.n_draws),
                                  lock=self.metrics.lock, axis=fc.axis, references=fc.references,
                                  family=fc.family, config=config)
                     if self.main and fc.enabled else None)
    self.evaluation = EVALUATIONS[config.eval.mode](self._eval_context(), config.eval,
                                                    config.generator.eval_hold_versions)
    self.hooks = Hooks()
    self.checkpoints = CheckpointHook(self.save, self.ckpt.latest_step())
    self._register_hooks(progress)

  def _eval_context(self) -> EvalContext:
    """The run as the evaluation sees it (evaluation.EvalContext)."""
    return EvalContext(main=self.main, ledger=self.ledger, params=self.eval_params,
                       model_cfg=self.model_cfg, dataset=self.dataset, spec=self.eval_spec,
                       prompts=self.eval_set, client=self.client, watchdog=self.watchdog,
                       record=self.record_eval, log=self.log_eval)

  def _register_hooks(self, progress: bool) -> None:
    """The hooks of this process (training/hooks.py): every process runs the step-0 check, the
    parity gate (both collective), evaluation and checkpoints; process 0 also collects fleet
    evaluations, checks health, tracks metrics, draws the progress bar (`progress`) and writes
    the end-of-run summaries."""
    c, h = self.config, self.hooks
    h.add_before("step0_check", self._step0_check)
    if backends.parity_gate_on(c.health.parity_gate, c.generator.backend):
      h.add_before("parity", ParityGate(c.health, self.health, self.learner.token_logprobs,
                                        bool(c.rl.routing_replay), self.main))
    if self.main:
      health = HealthHook(self.health)
      h.add("fleet_collect", lambda v: self.evaluation.collect())
      h.add("health", health.check)
      h.add("tracking", lambda v: self.metrics.write(v.record))
      h.add("health_abort", health.raise_pending)
    h.add("evaluation", lambda v: self.evaluation.run(v.step), every=int(c.eval.every_steps))
    bar = Progress(self.start_step, int(c.total_steps), lambda: self.last_eval)
    if self.main and progress:
      h.add("progress", bar)
    h.add("checkpoint", self.checkpoints, every=int(c.checkpoint.every_steps))
    if self.main:
      h.add_finish("grading_summary", self._grading_summary)
      h.add_finish("npr_history", self._npr_history)
      h.add_finish("progress_close", bar.close)

  def _restore(self, step: int) -> None:
    """Loads checkpoint `step`: learner state, ledger (the wall time since the save is booked:
    crash, lost work and restart held the devices), NPR history, consumption offsets."""
    state, meta = self.ckpt.restore(self.learner.state, step)
    self.learner.state = state
    self.ledger = ComputeLedger.resume(meta["ledger"], saved_at=meta["saved_at_unix_s"],
                                       count_gap=True)
    self.npr = PassRateHistory.from_dict(meta["npr"])
    self.last_eval = meta["last_eval"]
    self.consumed = dict(meta["consumed"], recent={})
    self.start_step = int(meta["step"])
    self.resume_info = dict(step=self.start_step,
                            gap_booked_s=time.time() - meta["saved_at_unix_s"])
    log.info("resumed from checkpoint %d (%d groups / %d rollouts trained so far); %.1f s since "
             "the save booked to the compute ledger", self.start_step, self.consumed["groups"],
             self.consumed["rollouts"], self.resume_info["gap_booked_s"])

  # ---- pieces ------------------------------------------------------------------------------------
  def _start_weight_source(self):
    """config.weights.serve_from="learner": this process's WeightSource and every process's
    source address (a collective when multi-host); else (None, None)."""
    w = self.config.weights
    if w.serve_from == "buffer":
      return None, None
    if w.serve_from != "learner":
      raise ValueError(f"weights.serve_from={w.serve_from!r}: expected 'learner' or 'buffer'")
    # Reachable from other hosts unless this is one process with its own local buffer and fleet.
    local = not self.multi and not self.config.buffer.external
    host = w.host or ("127.0.0.1" if local else "0.0.0.0")
    tune_malloc()    # staged multi-MB chunk copies reuse heap memory, not fresh mmaps (SCALE.md)
    src = WeightSource(self.token, host=host, port=int(w.port), advertise=w.advertise or None,
                       tls=TLS.from_config(self.config), bulk_port=int(w.bulk_port))
    log.info("weight source serving this process's shards at %s", src.address)
    if not self.multi:
      return src, [src.address]
    return src, distributed.allgather_strings(src.address)

  def publish(self, version: int) -> float:
    """Publishes the params as `version` (weights/stream.py: this process's shards, chunk by chunk,
    CRC-32C'd; with a learner weight source they are staged here and the buffer only announces
    the version, else they stream through the buffer, which shows the version once every
    process's chunks arrived). float32 params travel as `weights.wire_dtype` (bf16 by default:
    half the bytes; the learner keeps its fp32 masters)."""
    self.evaluation.before_publish(version)
    t = time.time()
    w = self.config.weights
    if self._delta is None and self.source is not None and common.delta_on(w):
      self._delta = DeltaEncoder(int(w.delta_full_every))    # this process's base bits
    d0 = (self._delta.delta_bytes, self._delta.full_bytes) if self._delta else (0, 0)
    StreamPublisher(self.client, version, self.learner.state.params, source=self.source,
                    sources=self.sources, wire_dtype=common.wire_dtype(w),
                    delta=self._delta).publish()
    if self._delta is not None:   # this version's delta bytes / its full bytes (1.0: sent full)
      sent, full = self._delta.delta_bytes - d0[0], self._delta.full_bytes - d0[1]
      self.delta_frac = sent / full if sent and full else 1.0
    self.beacon.tick()   # a step's update and its publish (collectives included) finished
    return time.time() - t

  def eval_params(self) -> Any:
    """Params for evaluation: the learner's own (one process) or gathered (collective)."""
    if not self.multi:
      return self.learner.state.params
    return distributed.gather_to_host(self.learner.state.params)

  def record_eval(self, step: int, fields: dict) -> None:
    """Logs evaluation `fields` (pass rates, lengths...) of version `step`, closing the ledger's
    evaluation span; step 0 is R0: the base policy at compute 0, and the compute axis starts now."""
    if step == 0:
      self.ledger.reset()
      self._write_r0({**self.ledger.snapshot(), **fields})
      return
    self.ledger.end_eval()
    self.log_eval({"step": step, "kind": "eval", **self.ledger.snapshot(), **fields})

  def log_eval(self, rec: dict) -> None:
    """Writes an evaluation record; a complete one becomes `last_eval` and feeds the forecast."""
    self.metrics.write(rec)
    if "val_pass_rate" not in rec:     # a fleet evaluation that timed out
      return
    self.last_eval = rec
    if self.forecast is not None:   # refit on a background thread: off the learner's critical path
      self.forecast.submit(rec["step"], rec["compute_hours"], int(self.config.total_steps))

  def _pull(self, step: int):
    """PullBatch(step), polling the watchdog (dead child processes) while it waits."""
    deadline = time.time() + float(self.config.pull_timeout_s)
    while True:
      try:
        return self.client.pull_batch(step, timeout_s=10.0)
      except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
          raise
      if self.watchdog is not None:
        self.watchdog()
      if time.time() > deadline:
        raise TimeoutError(f"no batch for step {step} after {self.config.pull_timeout_s} s")

  def _book(self, step: int, batch) -> None:
    """No-Positive-Resampling history and consumption offsets of a pulled batch (process 0)."""
    for g in batch.groups:   # No-Positive-Resampling history (per prompt id)
      self.npr.update(int(g.prompt_id), [r.rewards[0] for r in g.rollouts])
    ids = [r.rollout_id for g in batch.groups for r in g.rollouts]
    c = self.consumed
    c["ids_sha256"] = hashlib.sha256(json.dumps([c["ids_sha256"], step, ids]).encode()).hexdigest()
    c["step"], c["groups"], c["rollouts"] = step + 1, c["groups"] + len(batch.groups), \
        c["rollouts"] + len(ids)
    c["recent"][str(step)] = ids
    if self.audit_ids:   # audit trail: this step's rollout ids (job.prepare_resume truncates it)
      storage.append_text(storage.join(self.workdir, "trained_ids.jsonl"),
                          json.dumps({"step": step + 1, "ids": ids}) + "\n")

  def train_step(self, step: int) -> dict:
    t0 = time.time()
    batch = arrays = versions = None
    if self.main:
      batch = self._pull(step)
      lc = self.config.learner
      full = pad_time(batch_to_arrays(batch, pad_id=0), int(lc.pad_multiple),
                      common.max_sequence_len(self.config.rollout))
      self._book(step, batch)
      keys = ("tokens", "gen_logprobs", "loss_mask", "rewards", "prompt_ids")
      if self.config.rl.routing_replay:
        if "routes" not in full:
          raise ValueError("rl.routing_replay=True but the batch's rollouts carry no routes "
                           "(generator without record_routes?)")
        keys += ("routes",)
      elif self.config.rl.record_routes and "routes" in full:   # compared, not replayed
        full["gen_routes"] = full["routes"]
        keys += ("gen_routes",)
      arrays = {k: full[k] for k in keys}
      versions = full["versions"]
      arrays["lags"] = (step - versions).astype(np.int32)   # lag-0 / lag>0 statistics
      m = self.learner.microbatches
      if bool(lc.sort_rows) and m > 1 and len(arrays["tokens"]) % m == 0:
        perm = length_sorted_order(arrays["loss_mask"], m)
        arrays = {k: v[perm] for k, v in arrays.items()}   # loss unchanged; see train_step
        versions = versions[perm]
    if self.multi:                        # process 0's batch to every process
      arrays = distributed.broadcast_from_main(arrays)
    assert arrays is not None             # process 0 pulled it; the others got it by broadcast
    t_wait = time.time() - t0
    before = self.hooks.run_before(BeforeView(step, step == self.start_step, arrays,
                                              versions if self.main else None, batch))
    t1 = time.time()
    rows = self.learner.local_rows(arrays["tokens"].shape[0])
    m = self.learner.step({k: v[rows] for k, v in arrays.items()})
    t_train = time.time() - t1
    if self.main:   # process 0 books the global batch (its ledger is the one logged and saved)
      self.ledger.add_step(StepTokens.from_arrays(full, loss=int(m["tokens"]),
                                                  rescored=before.rescored))
    t_pub = self.publish(step + 1)
    if not self.main:
      return {"step": step + 1, "kind": "train", **m}
    assert batch is not None              # process 0 pulled it
    lag = list(batch.summary.lag.counts)
    dump_every = int(self.config.debug_dump_every)
    if dump_every and step % dump_every == 0:   # for tests and debugging: the exact batch trained
      storage.makedirs(storage.join(self.workdir, "batches"))
      reasons = [r.finish_reason for g in batch.groups for r in g.rollouts]
      with storage.open(storage.join(self.workdir, "batches", f"step_{step:06d}.npz"), "wb") as f:
        np.savez(f, finish_reason=np.asarray(reasons, np.int32), **full)
    reasons = [r.finish_reason for g in batch.groups for r in g.rollouts]
    rec = {"step": step + 1, "kind": "train", **self.ledger.snapshot(), **m,
           "length_cut_frac": float(np.mean([f == pb.FINISH_LENGTH for f in reasons])) if reasons else 0.0,
           "interrupted_frac": float(np.mean([f == pb.FINISH_INTERRUPTED for f in reasons])) if reasons else 0.0,
           "max_lag": int(batch.summary.lag.max_lag), "lag_hist": lag,
           "mean_reward": float(arrays["rewards"].mean()), **self._task_rewards(batch),
           "wait_s": t_wait, "train_s": t_train,
           "publish_s": t_pub, "npr_retired": self.npr.num_retired,
           **({"weights_delta_frac": self.delta_frac} if self.delta_frac is not None else {}),
           "policy_tokens": int(arrays["loss_mask"].sum()), "time": time.time(),
           **generator_metrics(batch.summary.generator_stats), **before.metrics}
    self._grading = {"step": step + 1, **{k: v for k, v in rec.items()
                                          if k == "gen_graded" or k.startswith("gen_grade_")}}
    return rec

  def _step0_check(self, view: BeforeView) -> HookOut:
    """The step-0 reward check (health.step0_reward_check) on a fresh run's first batch, before
    any update: every process decides from the broadcast rewards; process 0 also reads the
    completions to say why. Raises health.NoRewardSignal (after a `health_abort` metrics line)."""
    h, step, batch = self.config.health, view.step, view.batch
    if step != 0:
      return HookOut()
    samples = None
    if batch is not None:
      tok, samples = self.dataset.tokenizer, []
      for g in batch.groups:
        task = self.dataset.task_of(g.prompt_id)
        for r in g.rollouts:
          c = codec.rollout_to_completion(r)
          samples.append((tok.decode(c.tokens), c.finish_reason, task))
    templates = {t: self.dataset.template(t) for t in self.dataset.tasks}
    try:
      return HookOut(step0_reward_check(view.arrays["rewards"], h, samples, templates,
                                        self.dataset.task_rewards))
    except NoRewardSignal as e:
      log.error("%s", e)
      self.metrics.write({"step": 0, "kind": "health_abort", "reason": str(e)})
      raise

  def _task_rewards(self, batch) -> dict:
    """A mixture's `mean_reward/<task>` and `prompts/<task>` of a pulled batch (task by prompt id)."""
    if not self.dataset.is_mixture:
      return {}
    by, groups = {}, {}
    for g in batch.groups:
      task = self.dataset.task_of(g.prompt_id)
      by.setdefault(task, []).extend(r.rewards[0] for r in g.rollouts)
      groups[task] = groups.get(task, 0) + 1
    out = {}
    for name in self.dataset.tasks:
      out[f"prompts/{name}"] = groups.get(name, 0)
      if name in by:
        out[f"mean_reward/{name}"] = float(np.mean(by[name]))
    return out

  def save(self, step: int) -> None:
    """Checkpoints the whole run state: learner state (params, optimizer, step) through orbax;
    as JSON the ledger, the NPR history, the consumption offsets (steps/groups/rollouts trained,
    chained sha256 of the trained rollout ids, the ids of the steps since the last checkpoint),
    the seeds (generation is seeded per lease from (seed, version, prompts); evaluation from
    `eval_seed`), the data sampler's reference (its position lives in the buffer's WAL and is
    rewound from `consumed.step` on resume). Then tells the buffer the new checkpoint step.
    Open fleet evaluations are collected first (a checkpoint's metrics include them)."""
    self.evaluation.collect(block=True)
    self.ckpt.save(step, self.learner.state, {
        "ledger": self.ledger.state_dict(), "npr": self.npr.to_dict(),
        "last_eval": self.last_eval, "consumed": self.consumed,
        "rng": {"seed": int(self.config.seed), "eval_seed": int(self.eval_spec.seed),
                "generation": "common.generation_seed(seed, version, prompt_ids)"},
        "data_sampler": {"shuffle_seed": int(self.config.seed), "next_step": step,
                         "state": "buffer WAL (QUEUE/EPOCH/LEASE records), rewound to next_step"}},
        on_done=self._saved if self.learner_state_path and self.main else None)
    self.consumed["recent"] = {}

  def _saved(self, step: int) -> None:
    """Checkpoint `step` has its manifest (possibly on the saver's background thread): the buffer
    may now rewind to it and keep delivered groups from the oldest kept step on."""
    assert self.learner_state_path is not None   # `save` passes this callback only then
    old = read_learner_state(self.learner_state_path) or {}
    steps = self.ckpt.all_steps()
    write_learner_state(self.learner_state_path, step, min(steps) if steps else step,
                        old.get("resume"))

  def export_policy(self) -> str:
    """Writes the current policy as an HF checkpoint (config.json + safetensors in the params'
    dtype, so it equals the last checkpoint's params bit for bit) to WORKDIR/final_policy.
    Every process calls it and writes the tensors it owns from its own shards (no full gather:
    models/hf_export.py); process 0 writes config.json and the index."""
    path = storage.join(self.workdir, "final_policy")
    st = hf_export.save_hf_sharded(self.model_cfg, self.learner.state.params, path)
    log.info("final policy: process %d wrote %d tensors (%.3g GB) to %s; received %.3g GB, "
             "peak %.3g GB held", jax.process_index(), st.tensors, st.written_bytes / 1e9,
             path, st.gathered_bytes / 1e9, st.peak_bytes / 1e9)
    return path

  def _write_r0(self, rec: dict) -> None:
    """The step-0 line: R0 at compute 0, with the dataset stats (data/...: sizes, shares, skips)."""
    zero = {k: 0.0 for k in ("compute_hours", "train_hours", "gen_hours", "eval_hours",
                             "eval_gen_hours", "compute_hours_with_eval")}
    self.last_eval = {**rec, "step": 0, "kind": "eval", **zero,
                      "train_flops": 0.0, "gen_flops": 0.0, "train_loss_flops": 0.0,
                      "train_pad_flops": 0.0}
    self.metrics.write({**self.last_eval, **stats_metrics(self.dataset)})

  def run(self) -> dict | None:
    """Trains up to `config.total_steps` steps (evaluating on schedule), from `start_step` when
    resumed; returns the last eval record (None on a follower process of a multi-host learner:
    process 0 evaluates). A health abort (health.abort_on) saves a checkpoint,
    logs the reason and re-raises; both ends go through `_finish`."""
    start = self.start_step
    self.publish(start)
    if start == 0:
      self.evaluation.run(0)           # R0
    total = int(self.config.total_steps)
    preempt = Preemption(float(self.config.checkpoint.termination_grace_s)).install()
    ckpt = self.checkpoints
    for s in range(start, total):
      if preempt.requested:      # SIGTERM: a final checkpoint if the grace period allows, exit 0
        preempt.final_checkpoint(functools.partial(self.save, s), ckpt.last_save_s,
                                 ckpt.last_saved)
        self.preempted = True
        self.ckpt.close()
        self.metrics.close()
        return self.last_eval
      try:
        self.ckpt.check()          # a failed background checkpoint save stops the run here
        self.hooks.run(StepView(s + 1, total, self.train_step(s)))
      except RunUnhealthy as e:   # stop cleanly: a loadable checkpoint, the reason, then non-zero exit
        log.error("stopping the run: %s", e.reason)
        self._finish(abort=(s + 1, e.reason))
        raise
    self._finish()
    return self.last_eval

  def _finish(self, abort: tuple[int, str] | None = None) -> None:
    """The one shutdown path. A finished run collects its open evaluations and exports the final
    policy; an aborted one (`abort` = (step, reason)) saves checkpoint `step` and logs the reason.
    Both wait for the forecast, close the checkpointer and the logs and stop the weight source
    (generators still fetching the last version finish first)."""
    if abort is None:
      self.evaluation.collect(block=True)
      self.export_policy()
    if self.forecast is not None:
      self.forecast.wait()
    if abort is not None:
      self.save(abort[0])
      self.metrics.write({"step": abort[0], "kind": "health_abort", "reason": abort[1]})
    self.hooks.run_finish(abort)
    self.ckpt.close()
    self.metrics.close()
    if abort is not None:
      self.metrics.finish()
    if self.source is not None:
      self.source.stop()

  def _grading_summary(self, abort: tuple[int, str] | None) -> None:
    """The run summary of grading faults (rewards/isolation.py): logged and run_summary.json."""
    del abort
    grading = getattr(self, "_grading", None)
    if grading and len(grading) > 1:
      log.info("grading: %d grades, %d timed out, %d out of memory, %d errors, %d guarded",
               *(int(grading.get(f"gen_{k}", 0)) for k in ("graded",) + GRADE_FAULTS))
      storage.write_text(storage.join(self.workdir, "run_summary.json"),
                         json.dumps({"grading": grading}, indent=1))

  def _npr_history(self, abort: tuple[int, str] | None) -> None:
    """A finished run's No-Positive-Resampling history (npr_history.json)."""
    if abort is None:
      storage.write_text(storage.join(self.workdir, "npr_history.json"),
                         json.dumps(self.npr.to_dict()))


def _params_active(model_cfg) -> float:
  return float(count_params(model_cfg)["params_active"])
