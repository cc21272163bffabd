"""Generator worker process: lease prompts from the buffer, generate groups, score, push rollouts.

    python -m scalerl_jax.generation.worker --run_config=WORKDIR/config.json --buffer=HOST:PORT \
        --generator_id=gen-0 [--backend=jax|vllm|scripted]

The auth token comes from the environment variable named by `config.buffer.auth_token_env`.
Weights arrive through the buffer (FetchWeights); a watcher thread fetches every newly published
version and hands it to the generator, which swaps it in while sequences are in flight
(PipelineRL). Rewards are computed here, on the generator side, each completion with its task's
verifier (the task follows from the prompt id: data/mixture.py); the length-penalty alternative
(`rl.length_control=penalty`) is applied to them here as well. With `rewards.log` (default) every
grade is appended to WORKDIR/logs/rewards-<generator_id>.jsonl: one JSON object per completion,
{"t", "gen", "version", "prompt_id", "task", "reward" (before the length penalty), "reason",
"sandboxed", "cached"} (docs/METRICS.md "Reward log").

Evaluation lane (docs/ROLLOUT.md "Evaluation through the fleet"): the worker keeps the params of
the last `generator.eval_hold_versions` fetched versions, plus any version an open evaluation pins
(LeaseResponse.eval_versions), and lists them in every lease; the buffer then hands it evaluation
groups pinned to one of them ahead of training groups. It samples those with exactly that version
(the JAX backend in a second sampler on the retained params, so training generation keeps its
state; other backends load the version, sample, and load the newest back), grades them with the
prompt's task verifier (no length penalty) and pushes per-group rewards (PushEvalResults), with the
device-seconds spent, which the learner's ledger books as evaluation.

Faults (docs/RELIABILITY.md): a heartbeat thread keeps this worker's leases alive while it generates
(`generator.heartbeat_s`, default 10 s, well under the buffer's lease TTL); the client retries for
`generator.retry_budget_s` (default 60 s) when the buffer is down, so a buffer restart from its WAL
is ridden out. A restarted worker starts by fetching the newest published weights (constructor).
"""
from __future__ import annotations

import collections
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

import grpc

from scalerl_jax import processes
from scalerl_jax.models import sections as model_sections
from scalerl_jax import config as common
from scalerl_jax import rewards
from scalerl_jax.data import build_dataset
from scalerl_jax.generation import backends
from scalerl_jax.generation import interruption
from scalerl_jax.generation.continuous_loop import ContinuousLoop
from scalerl_jax.generation.eval_lane import EvalLane
from scalerl_jax.generation.generator import Engine
from scalerl_jax.generation.slots import DecodeStats
from scalerl_jax.generation.worker_cli import build_parser
from scalerl_jax.protocol import codec
from scalerl_jax.protocol.client import assignment_prompt
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.protocol.rpc import TLS
from scalerl_jax.protocol.wire import tune_malloc
from scalerl_jax.weights.relay import start_relay
from scalerl_jax.weights.stream import FetchedWeights, StreamFetcher
from scalerl_jax.types import WeightUpdateError, one_line
from scalerl_jax.weights.update import backoff_s, check_like

# Exit status of a worker that stopped because the buffer rewound (its pod / supervisor restarts it).
RESTART_EXIT = 75
# Exit status of a worker whose weight updates kept failing (weights.update_retries in a row).
UPDATE_FAILED_EXIT = 3
log = logging.getLogger("scalerl.worker")


class Worker(EvalLane, ContinuousLoop):
  """One generator process's loop (see module docstring); its evaluation lane is `EvalLane`
  (generation/eval_lane.py), its continuous-batching loop `ContinuousLoop`
  (generation/continuous_loop.py)."""

  def __init__(self, config: common.RunConfig, address: str, generator_id: str, backend: str,
               workdir: str, engine: Engine | None = None):
    self.config, self.id = config, generator_id
    # The backend's engine (generation/backends.py); main builds it first (prepare_process).
    self.engine = engine or backends.engine_class(backend)(config)
    self.engine.generator_id = generator_id
    # Leases and heartbeats use a per-process identity: a restarted worker must not keep its dead
    # predecessor's half-done groups alive with its heartbeats (they expire and are re-leased).
    # A push that fails abandons its groups: the id then changes too (`_abandon`), so heartbeats
    # stop extending them and the buffer re-leases them after the TTL instead of stalling the learner.
    self._incarnation = 0
    self.terminated = False    # SIGTERM: leases given back (`terminate`), grades not waited for
    self._released: list = []  # the lease ids `terminate` gave back
    self.lease_id = f"{generator_id}@{os.getpid()}"
    token = os.environ.get(config.buffer.auth_token_env, "")
    if not token:
      raise SystemExit(f"error: env var {config.buffer.auth_token_env} (buffer token) is unset")
    self.client = BufferClient(address, token, tls=TLS.from_config(config),
                               retry_budget_s=float(config.generator.retry_budget_s))
    self.dataset = build_dataset(config.data, config.rollout.max_prompt_len)
    if self.dataset.needs_sandbox:   # this process grades model programs: its sandbox must work
      rewards.prepare_code_rewards(config)
    # Rewards that parse model output (math) grade in worker processes with a deadline; they
    # start now, before this worker takes work (rewards/isolation.py).
    rewards.isolation.configure(config.rewards)
    if any(rewards.registry.isolation_of(r)[0] for r in self.dataset.task_rewards.values()):
      rewards.isolation.pool()
    self._count_lock = threading.Lock()
    self.reward_log = None
    if config.rewards.log:
      os.makedirs(os.path.join(workdir, "logs"), exist_ok=True)
      self.reward_log = open(os.path.join(workdir, "logs", f"rewards-{generator_id}.jsonl"), "a")
    self.model_cfg = model_sections.model_config(config)
    self.fetcher = StreamFetcher(self.client, delta=common.delta_on(config.weights))
    self.relay = self._start_relay(token, address, config)
    got = None
    while got is None:   # the learner publishes version 0 before training starts
      got = self._fetch(-1, 60)
    version = got.version
    self.backend = backend
    # Evaluation lane: retained params by version, and the versions open evaluations pin.
    self._held: collections.OrderedDict = collections.OrderedDict()
    self._pins: set = set()
    self._held_lock = threading.Lock()
    self._swap_lock = threading.Lock()     # non-JAX backends: eval swaps vs the weight watcher
    self.hold_n = int(config.generator.eval_hold_versions)
    self._remember(version, got.params)
    params = got.params if self.engine.needs_params else None
    self.gen = self.engine.make(self.model_cfg, params, version, workdir, self.dataset)
    self._stop = threading.Event()
    self.rewound = False
    self.fatal = ""       # set when weight updates kept failing: the one line `main` exits with
    # Occupancy, idle and grading seconds of either loop (sent with every heartbeat).
    self.decode_stats = DecodeStats()
    threading.Thread(target=self._watch_weights, daemon=True).start()
    # The training groups this worker is generating (leased, not yet pushed): the heartbeats
    # extend only these (a lease whose response was lost in a buffer crash then expires).
    self._working: frozenset = frozenset()
    self.heartbeat_s = float(config.generator.heartbeat_s)
    if self.heartbeat_s > 0:
      threading.Thread(target=self._heartbeat, daemon=True).start()

  def _start_relay(self, token: str, buffer_address: str, config):
    """This generator's weight relay (weights/relay.py; weights.relay_fanout 0: none): it serves
    on what the fetcher receives; the parents come back with every heartbeat."""
    w = config.weights
    if w.relay_fanout < 1:
      return None
    local = buffer_address.startswith(("127.", "localhost", "[::1]"))
    relay = start_relay(token, host="127.0.0.1" if local else "0.0.0.0", port=int(w.relay_port),
                        advertise=w.relay_advertise or None, tls=TLS.from_config(config),
                        bulk_port=int(w.relay_bulk_port))
    self._relay_parents: list[str] = []
    self.fetcher.relay = relay
    self.fetcher.parents = lambda: list(self._relay_parents)
    log.info("%s: weight relay at %s (fan-out %d)", self.id, relay.address, w.relay_fanout)
    return relay

  alive_file = None   # set by main (--alive_file): touched at every heartbeat (a liveness probe)

  def touch_alive(self) -> None:
    """Marks this process alive: `alive_file`'s mtime is now (launch/gke: the pod's probe)."""
    if self.alive_file:
      os.makedirs(os.path.dirname(os.path.abspath(self.alive_file)), exist_ok=True)
      with open(self.alive_file, "a"):
        os.utime(self.alive_file)

  def _heartbeat(self):
    """Extends this worker's leases every `heartbeat_s` (a silent worker loses them after the TTL)."""
    while not self._stop.wait(self.heartbeat_s):
      self.touch_alive()
      try:
        relay = getattr(self, "relay", None)
        r = self.client.heartbeat(self.lease_id, self.gen.version, group_ids=sorted(self._working),
                                  held_versions=self.held_versions(),
                                  stats=self.decode_stats.heartbeat_stats(),
                                  relay_address=relay.address if relay else "",
                                  relay_fanout=int(self.config.weights.relay_fanout))
        if relay is not None:
          self._relay_parents = list(r.relay_parents)
      except grpc.RpcError as e:
        log.warning("%s: heartbeat failed (%s)", self.id, e.code())
        continue
      if r.current_version < self.gen.version:
        # The buffer rewound to a learner checkpoint (the learner resumed): this policy belongs to
        # a lost timeline. Stop; `main` exits with RESTART_EXIT and the pod restarts, fetching
        # the version the learner republishes.
        log.warning("%s: the buffer is at version %d, this generator at %d (the learner resumed "
                    "from a checkpoint): restarting", self.id, r.current_version, self.gen.version)
        self.rewound = True
        self.stop()

  def _fetch(self, have: int, wait_timeout_s: float) -> FetchedWeights | None:
    """The newest version above `have` (`FetchedWeights`: params in our layout, assembled in
    place; a broken fetch resumes), or None when none arrived in time."""
    return self.fetcher.fetch(have, wait_timeout_s=wait_timeout_s)

  def _watch_weights(self):
    """Fetches each newly published version and installs it (applied between decode chunks).
    Streamed versions arrive while the learner still publishes them (pipelined through the buffer);
    a broken fetch resumes from the chunks it lacks. A version that fails (checksum, shape, name,
    engine load: types.WeightUpdateError or the engine's error) is never installed: the
    generator keeps its version, counts the failure (heartbeat stat `weight_failures`), backs off
    and fetches again; after `weights.update_retries` failures in a row it stops (`main` exits
    with UPDATE_FAILED_EXIT and `self.fatal`, one line). Transport errors only back off."""
    have, failures, transport = self.gen.version, 0, 0
    wcfg = self.config.weights
    while not self._stop.is_set():
      try:
        got = self._fetch(have, wait_timeout_s=30)
        f = getattr(self, "fetcher", None)
        if f is not None:    # counted full fetches after a delta that did not check
          self.decode_stats.delta_fallbacks = f.delta_fallbacks
        if got is None:
          continue
        self._install(got)
        have, failures, transport = got.version, 0, 0
      except WeightUpdateError as err:   # this version is bad: counted, retried, then fatal
        if self._stop.is_set():
          return
        failures += 1
        self.decode_stats.weight_failures += 1
        if failures > wcfg.update_retries:
          self.fatal = f"{self.id}: {err.line()} ({failures} failures in a row; giving up)"
          log.error("%s", self.fatal)
          self.stop()
          return
        log.warning("%s: %s (failure %d of %d; keeping version %d)", self.id, err.line(),
                    failures, wcfg.update_retries + 1, self.gen.version)
        self._stop.wait(backoff_s(failures, wcfg.update_backoff_s))
      except (grpc.RpcError, IOError) as e:   # the transport (a broken or short stream): resumes
        if self._stop.is_set():
          return
        transport += 1
        log.warning("%s: weight fetch failed (%s); retrying", self.id, getattr(e, "code", e))
        self._stop.wait(backoff_s(transport, min(wcfg.update_backoff_s, 1.0), cap_s=10.0))

  def _install(self, got: FetchedWeights) -> None:
    """Checks a fetched version against the newest held one, loads it, then retains it."""
    with self._held_lock:
      ref = self._held[max(self._held)] if self._held else None
    check_like(got.version, ref, got.params)
    with self._swap_lock:
      try:
        self.gen.load_params(got.params, got.version, self.model_cfg)   # swapped in between chunks
      except WeightUpdateError:
        raise
      except Exception as e:   # noqa: BLE001 -- the engine's own error, as one line
        raise WeightUpdateError(got.version, getattr(e, "weight_name", ""), one_line(e)) from e
      self._remember(got.version, got.params)

  def _wait_for_version(self, min_version: int):
    while self.gen.version < min_version and not self._stop.is_set():
      self.gen.apply_pending()
      time.sleep(0.01)

  def rewards(self, completion, answer: str, prompt_id: int | None = None,
              log: list | None = None) -> float:
    """The reward of one completion: graded with the task of `prompt_id`; the Grade is appended
    to `log` (reward-log lines) when given."""
    task = self.dataset.task_of(prompt_id) if prompt_id is not None else ""
    g = self.dataset.grade(completion.tokens, answer, task)
    if g.reason == "sandbox_error":   # raises (this worker exits) when the sandbox broke mid-run
      rewards.sandbox_still_works(g.detail)
    with self._count_lock:
      self.decode_stats.count_grade(g.reason)
    r = g.reward
    if log is not None:
      line = {"t": round(time.time(), 3), "gen": self.id, "version": int(self.gen.version),
              "prompt_id": int(prompt_id) if prompt_id is not None else -1, "task": task,
              "reward": float(r), "reason": g.reason, "sandboxed": bool(g.sandboxed),
              "cached": bool(g.cached)}
      if g.detail and g.reason not in ("pass", "wrong_answer"):
        line["detail"] = g.detail[:200]
      log.append(line)
    if self.config.rl.length_control == "penalty":
      r = float(interruption.apply_length_penalty(
          r, len(completion.tokens), g.reason == "pass", self.config.rl.length_penalty_max,
          self.config.rl.length_penalty_cache))
    return float(r)

  def run(self, max_groups: int = 0) -> int:
    """Serves until stopped (or `max_groups` groups pushed, for tests). Returns groups pushed
    (training groups; evaluation groups are counted in `self.eval_groups`)."""
    done = 0
    self.eval_groups = 0
    n_lease = int(self.config.generator.groups_per_lease)
    n_eval = int(self.config.generator.eval_groups_per_lease)
    while not self._stop.is_set() and (not max_groups or done < max_groups):
      try:
        resp = self.client.lease_response(self.lease_id, max_groups=n_lease, wait_timeout_s=2.0,
                                          held_versions=self.held_versions(),
                                          max_eval_groups=n_eval)
      except grpc.RpcError as e:
        log.warning("%s: lease failed (%s)", self.id, e.code())
        time.sleep(1.0)
        continue
      self._set_pins(resp.eval_versions)
      assignments = list(resp.assignments)
      if not assignments:
        continue
      if assignments[0].eval_id:   # the evaluation lane (never mixed with training groups)
        self.eval_groups += self.serve_eval(assignments)
        continue
      # The version cap of these leases (PPO-off-policy rounds pin one version) is set before
      # waiting for their minimum version, so a pending newer version can be swapped in.
      self._working = frozenset(a.group_id for a in assignments)
      caps = [a.max_version for a in assignments if a.max_version >= 0]
      self.gen.max_version = min(caps) if caps else None
      self._wait_for_version(max(a.min_version for a in assignments))
      prompts = [assignment_prompt(a) for a in assignments]
      # Seeded per (version, prompts): a resumed run regenerates the same rollouts (RELIABILITY.md).
      spec = interruption.sampling_spec(self.config, self.dataset, seed=common.generation_seed(
          self.config.seed, max(a.min_version for a in assignments),
          [a.prompt_id for a in assignments]))
      t0 = time.time()
      groups = self.gen.generate(prompts, int(assignments[0].group_size), spec)
      self._book_drain(groups, time.time() - t0)
      t1 = time.perf_counter()
      rollouts, graded = [], []
      for a, p, group in zip(assignments, prompts, groups):
        for i, c in enumerate(group):
          rollouts.append(codec.completion_to_rollout(
              c, group_id=a.group_id, sample_index=i, prompt_tokens=p.tokens,
              generator_id=self.id, rewards=(self.rewards(c, a.answer, a.prompt_id, graded),),
              start_unix_s=t0))
      self._log_grades(graded)
      self.decode_stats.grade_s += time.perf_counter() - t1
      try:
        self.client.push(rollouts)
      except grpc.RpcError as e:   # e.g. a lease expired: the buffer re-assigns the group
        log.warning("%s: push rejected (%s: %s)", self.id, e.code(), e.details())
        self._abandon()
        continue
      finally:                     # pushed or given up: no longer this worker's to extend
        self._working = frozenset()
      done += len(assignments)
    return done

  def _book_drain(self, groups, seconds: float) -> None:
    """Occupancy of one drained batch: its tokens vs its rows x the decode steps its longest
    sample took (chunks of generator.chunk_steps on the JAX backend)."""
    lengths = [len(c.tokens) for g in groups for c in g]
    if not lengths:
      return
    chunk = self.engine.drain_chunk()
    st = self.decode_stats
    st.slot_steps += len(lengths) * -(-max(lengths) // chunk) * chunk
    st.row_steps += len(lengths) * -(-max(lengths) // chunk) * chunk
    st.live_row_steps += sum(lengths)
    st.tokens += sum(lengths)
    st.completions += len(lengths)
    st.decode_s += seconds

  def _log_grades(self, lines: list) -> None:
    """Appends one reward-log line per graded completion (flushed per lease batch)."""
    if self.reward_log is None or not lines:
      return
    self.reward_log.write("".join(json.dumps(l) + "\n" for l in lines))
    self.reward_log.flush()

  def _abandon(self):
    self._incarnation += 1
    self.lease_id = f"{self.id}@{os.getpid()}.{self._incarnation}"

  def stop(self) -> None:
    self._stop.set()

  def terminate(self, timeout_s: float = 3.0) -> int:
    """SIGTERM (preemption, scale-down): stops taking work, then gives every incomplete group of
    this incarnation back to the buffer at once (not after lease_ttl_s) and takes a fresh lease
    id (a heartbeat already on its way extends nothing). Returns how many groups went back.
    `main` calls it again once the loop has stopped: a lease that was on its way when the signal
    came is given back then."""
    self.stop()
    self.terminated = True
    self._released.append(self.lease_id)   # again each call: a lease on its way may land late
    self._abandon()
    try:
      n = sum(self.client.release(i, timeout_s=timeout_s) for i in self._released)
    except grpc.RpcError as e:
      log.warning("%s: SIGTERM: releasing the leases failed (%s); they return after the lease "
                  "TTL", self.id, e.code())
      return 0
    log.info("%s: SIGTERM: released %d group(s) to the buffer; exiting", self.id, n)
    return n

  def close(self) -> None:
    self.stop()
    relay = getattr(self, "relay", None)
    if relay is not None:
      relay.stop()
    self.gen.close()
    self.client.close()
    rewards.isolation.shutdown()
    if self.reward_log is not None:
      self.reward_log.close()


def main(argv=None) -> None:
  ap = build_parser()
  rest, overrides = common.split_overrides(sys.argv[1:] if argv is None else argv)
  a = ap.parse_args(rest)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
  tune_malloc()    # multi-MB weight chunks / rollout buffers reuse heap memory, not fresh mmaps
  for name in ("cert", "key", "ca", "server_name"):   # a fleet pod's mounted certificates
    if getattr(a, f"tls_{name}") is not None:
      overrides.append(f"--config.tls.{name}={getattr(a, f'tls_{name}')}")
  if a.tensor_parallel:
    overrides.append(f"--config.generator.tensor_parallel={a.tensor_parallel}")
  if a.backend:                          # the pod's engine: checked with the rest of the run config
    overrides.append(f"--config.generator.backend={a.backend}")
  try:                                   # the run file main wrote (or a preset), as main resolves it
    run = common.resolve(a.run_config, overrides)
  except common.ConfigError as e:
    sys.exit(f"config error: {e}")
  # The pod name: Kubernetes sets $HOSTNAME in every container (launch.rehearse does too).
  a.generator_id = a.generator_id or os.environ.get("HOSTNAME") or socket.gethostname()
  print(common.knob_line(run, "generator"), file=sys.stderr, flush=True)
  index = int(a.generator_id.rsplit("-", 1)[-1]) if a.generator_id.rsplit("-", 1)[-1].isdigit() else 0
  pinned = processes.pin_to_device_cpus(run, "generator", index)
  backend = run.generator.backend
  engine = backends.engine_class(backend)(run)
  engine.prepare_process(pinned)     # before JAX starts (e.g. the XLA:CPU device count)
  w = Worker(run, a.buffer, a.generator_id, backend,
             a.workdir or os.path.dirname(os.path.abspath(a.run_config)), engine=engine)
  w.alive_file = a.alive_file
  w.touch_alive()
  def on_term(*_) -> None:
    # SIGTERM also comes from PDEATHSIG when the learner died: a client call may be retrying a
    # dead buffer for its whole retry budget, so exit for sure after a short grace period.
    # Leases first: the buffer re-queues this worker's groups now (preemption loses no TTL).
    threading.Timer(5.0, os._exit, (0,)).start()
    w.terminate()
  signal.signal(signal.SIGTERM, on_term)
  try:
    why = w.continuous_ok()
    log.info("%s: %s", a.generator_id, f"drain-per-lease loop ({why})" if why else
             f"continuous batching, {w.config.generator.decode_batch} slots")
    if why:
      w.run()
    else:
      w.run_continuous()
  finally:
    if w.terminated:     # leases taken while the signal was handled go back too
      w.terminate()
    w.close()
  if w.rewound:
    sys.exit(RESTART_EXIT)
  if w.fatal:
    print(w.fatal, file=sys.stderr, flush=True)
    sys.exit(UPDATE_FAILED_EXIT)


if __name__ == "__main__":
  main()
