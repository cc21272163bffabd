"""gRPC rollout buffer: one `RolloutBuffer` service (scalerl.rollout.v1) over `state.BufferState`.

In-process:  srv = BufferServer(prompts, token="...", prompts_per_step=B, group_size=G, max_lag=k)
             srv.start(); srv.port; ...; srv.stop()
As a process, reading the run's resolved run file (the WORKDIR/config.json main wrote, or launch's
rendered run config; none: the declared defaults) plus `--config.a.b=value` overrides, as every
process of a run reads it (scalerl_jax.config.resolve), and only process-local flags besides
(where it listens, its prompts file, WAL directory, learner-state file, TLS files):
  python -m scalerl_jax.buffer.server --run-config WORKDIR/config.json --port 0 \
      --prompts prompts.jsonl [--config.rollout.max_lag=4]
  (prints one JSON line {"port": ...} once serving; prompts.jsonl: {"prompt_id", "tokens", "answer"};
  the auth token is in the environment variable the run config's buffer.auth_token_env names).

Security: every RPC needs `authorization: Bearer <token>` (checked by a server interceptor before any
handler runs); with `--tls-cert/--tls-key` (`config.tls`) it is served over TLS only (rpc.TLS). Requests are parsed by our own deserializers so garbage bytes become INVALID_ARGUMENT,
and every field is validated (validation.py). Rollout payloads are stored as the bytes received and
spliced unchanged into the learner's batches (no re-encoding; the fast path is in wire.py). The
weight RPCs (PublishWeights, FetchWeights, WatchVersion) live in weight_store.py. This module must
not import jax.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, NoReturn, Optional, Sequence

import grpc
import numpy as np

from scalerl_jax import config
from scalerl_jax.progress import Beacon
from scalerl_jax.buffer.state import BufferState
from scalerl_jax.protocol import rollout_pb2 as pb
from scalerl_jax.protocol import validation as val
from scalerl_jax.buffer import wal as walmod
from scalerl_jax.buffer import replay
from scalerl_jax.buffer import weight_store
from scalerl_jax.protocol.weight_chunks import parse_weight_message
from scalerl_jax.types import PromptSpec
from scalerl_jax.protocol.rpc import SERVICE, TLS, AuthInterceptor, add_port, channel_options
from scalerl_jax.protocol.wire import Malformed, abort, parse_push, parser, serialize, tune_malloc

log = logging.getLogger("scalerl.buffer")
# Exit status of a buffer that stopped to be restarted (a learner resumed while it kept running).
RESTART_EXIT = 75


class BufferServer:
  """The rollout buffer service; see the module docstring."""

  def __init__(self, prompts: Sequence[PromptSpec], *, token: str, prompts_per_step: int,
               group_size: int, max_lag: int, mode: str = config.Rollout.mode,
               host: str = "127.0.0.1", port: int = 0,
               max_message_bytes: int = config.Buffer.max_message_bytes,
               max_weight_bytes: int = 64 << 30,
               lease_ttl_s: float = config.Buffer.lease_ttl_s, limits: val.Limits = val.Limits(),
               verifier: Optional[val.Verifier] = None, max_workers: int = 256,
               shuffle_seed: Optional[int] = None, npr_threshold: Optional[float] = None,
               wal_dir: Optional[str] = None, wal_fsync: str = config.Buffer.wal_fsync,
               wal_fsync_interval_s: float = 1.0, learner_state: Optional[dict] = None,
               wal_archive: bool = config.Audit.wal_archive,
               tls: Optional[TLS] = None, max_ahead: int = config.Rollout.max_ahead):
    """`tls` (rpc.TLS): serve over TLS (server certificate; client certificates with mutual)."""
    if not token:
      raise ValueError("an auth token is required")
    self.state = BufferState(
        prompts, prompts_per_step=prompts_per_step, group_size=group_size, max_lag=max_lag,
        mode=mode, lease_ttl_s=lease_ttl_s, limits=limits, verifier=verifier,
        shuffle_seed=shuffle_seed, npr_threshold=npr_threshold, max_ahead=max_ahead)
    self.limits, self.max_weight_bytes = limits, max_weight_bytes
    self.learner_state_path = ""            # set by main: where a learner resume is announced
    self.restart_requested = threading.Event()
    self.weights = weight_store.WeightStore(self)
    self.wal: Optional[walmod.WAL] = None
    self.wal_report: dict = {}
    if wal_dir:
      self._open_wal(wal_dir, wal_fsync, wal_fsync_interval_s, learner_state, wal_archive)
    elif learner_state is not None:   # no weights survive a WAL-less restart: the learner
      self.wal_report = {"resume": self.state.apply_learner_state(learner_state)}   # republishes
    self._rejected: collections.Counter = collections.Counter()
    self._bytes_in = self._bytes_out = 0
    self._mlock = threading.Lock()
    self._server = grpc.server(
        concurrent.futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="buffer"),
        interceptors=[AuthInterceptor(token, self._count_reject)],
        options=channel_options(max_message_bytes), maximum_concurrent_rpcs=max_workers)
    self._server.add_generic_rpc_handlers([self._handlers()])
    self.tls = tls or TLS()
    self.port = add_port(self._server, f"{host}:{port}", self.tls)
    if self.port == 0:
      raise RuntimeError(f"could not bind {host}:{port}")
    self.address = f"{host}:{self.port}"

  @classmethod
  def from_sections(cls, rollout, buffer, tls, prompts: Sequence[PromptSpec],
                    token: Optional[str] = None, **overrides) -> "BufferServer":
    """Builds the server from a run's `rollout`, `buffer` and `tls` sections (scalerl_jax/config/,
    typed or ConfigDict).

    The token defaults to the env var named by `buffer.auth_token_env`."""
    if token is None:
      token = os.environ.get(buffer.auth_token_env, "")
      if not token:
        raise ValueError(f"auth token env var {buffer.auth_token_env} is empty or unset")
    host, _, port = buffer.address.rpartition(":")
    r = rollout
    kw: dict[str, Any] = dict(token=token, prompts_per_step=r.prompts_per_step,
              group_size=r.generations_per_prompt, max_lag=r.max_lag, mode=r.mode,
              max_ahead=r.max_ahead, host=host or "127.0.0.1", port=int(port or 0),
              max_message_bytes=buffer.max_message_bytes, tls=TLS.from_section(tls))
    kw.update(overrides)
    return cls(prompts, **kw)

  def _open_wal(self, wal_dir: str, fsync: str, interval_s: float,
                learner_state: Optional[dict] = None, archive: bool = False) -> None:
    """Replays `wal_dir` (truncating a torn tail), reloads the latest weights, applies the
    learner's resume state (replay.py), compacts the state into a fresh segment and logs every
    later change (docs/RELIABILITY.md)."""
    os.makedirs(wal_dir, exist_ok=True)
    self._wal_lock = walmod.lock_dir(wal_dir)
    t0 = time.time()
    records, report = walmod.read_all(wal_dir, truncate=True)
    report["restored"] = self.state.restore(records)
    got = walmod.load_weights(wal_dir)
    if got is not None:
      head, payload = got
      self.weights.restore(head, payload)
      if head["version"] > self.state.version:   # crash between weights.bin and its VERSION record
        self.state.version = head["version"]
        self.state.weights_meta = dict(head)
      report["weights_version"] = head["version"]
    report["resume"] = self.state.apply_learner_state(learner_state)
    if self.weights.version != self.state.version:    # rewound: those weights are of a lost step
      self.weights = weight_store.WeightStore(self)     # (the learner republishes its checkpoint)
      if os.path.exists(os.path.join(wal_dir, walmod.WEIGHTS_FILE)):
        os.remove(os.path.join(wal_dir, walmod.WEIGHTS_FILE))
    self.wal = walmod.WAL(wal_dir, fsync=fsync, fsync_interval_s=interval_s, archive=archive)
    report["segment"] = self.state.attach_wal(self.wal)
    report["replay_s"] = round(time.time() - t0, 3)
    self.wal_report = report
    log.info("WAL %s: replayed %s -> %s", wal_dir, report["records"], report["restored"])

  # ---- lifecycle ---------------------------------------------------------------------------------
  def start(self) -> "BufferServer":
    self._server.start()
    return self

  def stop(self, grace: float = 0.5) -> None:
    self._server.stop(grace).wait()
    if self.wal is not None:
      self.wal.close()

  def wait(self, timeout: Optional[float] = None) -> bool:
    """Blocks until the server has stopped (True) or `timeout` seconds passed (False)."""
    return not self._server.wait_for_termination(timeout)

  # ---- plumbing ----------------------------------------------------------------------------------
  def _handlers(self):
    h = {
        "LeasePrompts": grpc.unary_unary_rpc_method_handler(
            self._lease, parser(pb.LeaseRequest), serialize),
        "PushRollouts": grpc.stream_stream_rpc_method_handler(
            self._push, parse_push, serialize),
        "PullBatch": grpc.unary_stream_rpc_method_handler(
            self._pull, parser(pb.PullRequest), serialize),
        "PublishWeights": grpc.stream_unary_rpc_method_handler(
            self.weights.publish, parse_weight_message, serialize),
        "FetchWeights": grpc.unary_stream_rpc_method_handler(
            self.weights.fetch, parser(pb.FetchWeightsRequest), serialize),
        "WatchVersion": grpc.unary_stream_rpc_method_handler(
            self.weights.watch, parser(pb.WatchRequest), serialize),
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            self._status, parser(pb.StatusRequest), serialize),
        "Heartbeat": grpc.unary_unary_rpc_method_handler(
            self._heartbeat, parser(pb.HeartbeatRequest), serialize),
        "SubmitEval": grpc.unary_unary_rpc_method_handler(
            self._submit_eval, parser(pb.EvalRequest), serialize),
        "PushEvalResults": grpc.unary_unary_rpc_method_handler(
            self._push_eval, parser(pb.EvalPushRequest), serialize),
        "CollectEval": grpc.unary_unary_rpc_method_handler(
            self._collect_eval, parser(pb.EvalCollectRequest), serialize),
    }
    return grpc.method_handlers_generic_handler(SERVICE, h)

  def _count_reject(self, code: grpc.StatusCode) -> None:
    with self._mlock:
      self._rejected[code.name] += 1

  def _abort(self, context, code: grpc.StatusCode, message: str) -> NoReturn:
    self._count_reject(code)
    abort(context, code, message)

  def _req(self, request, context):
    if isinstance(request, Malformed):
      self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, request.err)
    return request

  def _call(self, context, fn, *args):
    try:
      return fn(*args)
    except val.RejectError as e:
      self._abort(context, e.code, e.message)

  # ---- handlers ----------------------------------------------------------------------------------
  def _lease(self, request, context):
    r = self._req(request, context)
    got = self._call(context, self.state.lease, r.generator_id, r.max_groups, r.wait_timeout_s,
                     context.is_active, r.held_versions, r.max_eval_groups)
    return pb.LeaseResponse(assignments=got, current_version=self.state.version,
                            eval_versions=self.state.eval_versions())

  def _push(self, request_iterator, context):
    for item in request_iterator:
      items = self._req(item, context)
      acks = self._call(context, self.state.add_rollouts, items)
      new = sum(len(raw) for (_, raw), a in zip(items, acks) if not a.duplicate)
      with self._mlock:
        self._bytes_in += new
      yield pb.PushResponse(acks=acks)

  def _pull(self, request, context):
    r = self._req(request, context)
    if r.learner_id:
      self._call(context, val.check_id, r.learner_id, "learner_id", self.limits)
    if r.step not in self.state.next_step() and self.learner_resumed():
      self.abort_for_restart(context)
    batch = self._call(context, self.state.pull, r.step, r.timeout_s, context.is_active)
    yield from batch.groups          # pre-serialized BatchItem{group} messages
    with self._mlock:
      self._bytes_out += batch.num_bytes
    yield pb.BatchItem(summary=batch.summary)

  def learner_resumed(self) -> bool:
    """Whether the learner resumed from a checkpoint (a resume request in the learner-state file
    that this buffer has not applied) while this buffer kept running. The rewind is applied at
    start-up only (replay.py), so this asks for a restart (`restart_requested`; `main` then exits
    with RESTART_EXIT and the Deployment / supervisor restarts it from its WAL). Called only for a
    request that does not fit the buffer's state (a pull for an earlier step, an older published
    version): the file is read then, not per request."""
    if self.restart_requested.is_set():
      return True
    if not self.learner_state_path:
      return False
    try:
      res = (replay.read_learner_state(self.learner_state_path) or {}).get("resume")
    except (OSError, ValueError) as e:
      log.warning("cannot read the learner-state file %s: %s", self.learner_state_path, e)
      return False
    if not res or res["id"] in self.state.resumes:
      return False
    log.warning("the learner %s (resume %s) while this buffer ran: stopping, so that the "
                "restart replays the WAL and rewinds to it",
                "started over from step 0" if res.get("start_over") else
                f"resumed from checkpoint {res.get('step')}", res["id"])
    self.restart_requested.set()
    threading.Thread(target=self.stop, args=(0.5,), daemon=True).start()
    return True

  def abort_for_restart(self, context) -> None:
    self._abort(context, grpc.StatusCode.UNAVAILABLE, "the buffer restarts to rewind to the "
                "learner's checkpoint (its write-ahead log is replayed); retry")

  def _status(self, request, context):
    self._req(request, context)
    with self._mlock:
      rejected, bi, bo = dict(self._rejected), self._bytes_in, self._bytes_out
    return pb.Status(contents=self.state.contents(), rejected=rejected, bytes_in=bi, bytes_out=bo,
                     **self.state.status_fields())

  def _submit_eval(self, request, context):
    return self._call(context, self.state.submit_eval, self._req(request, context))

  def _push_eval(self, request, context):
    r = self._req(request, context)
    return self._call(context, self.state.add_eval_results, r.results)

  def _collect_eval(self, request, context):
    r = self._req(request, context)
    return self._call(context, self.state.collect_eval, r.eval_id, r.timeout_s, r.cancel,
                      context.is_active)

  def _heartbeat(self, request, context):
    r = self._req(request, context)
    if r.release:    # the generator is leaving: its groups go back to the queue now
      n = self._call(context, self.state.release, r.generator_id,
                     list(r.group_ids) if r.lists_groups else None)
      return pb.HeartbeatResponse(current_version=self.state.version, leases_extended=n,
                                  server_time_unix_s=time.time())
    n = self._call(context, self.state.heartbeat, r.generator_id,
                   list(r.group_ids) if r.lists_groups else None,
                   list(r.held_versions) if r.lists_held else None, dict(r.stats) or None,
                   int(r.version), r.relay_address)
    parents = (self.state.relay_parents(r.generator_id, int(r.relay_fanout))
               if r.relay_address and r.relay_fanout else [])
    return pb.HeartbeatResponse(current_version=self.state.version, leases_extended=n,
                                server_time_unix_s=time.time(), relay_parents=parents)


def load_prompts(path: str) -> list[PromptSpec]:
  """Reads a JSONL file of {"prompt_id": int, "tokens": [int...], "answer": str}."""
  out = []
  with open(path) as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        d = json.loads(line)
        out.append(PromptSpec(int(d["prompt_id"]), np.asarray(d["tokens"], np.int32),
                              str(d.get("answer", ""))))
      except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}:{n}: bad prompt line ({e})") from None
  return out


def _route_limits(spec: str) -> dict:
  """--route-shape 'R,K,E' -> Limits(route_layers, route_k, num_experts) fields."""
  if not spec:
    return {}
  r, k, e = (int(x) for x in spec.split(","))
  if min(r, k, e) <= 0:
    raise SystemExit(f"error: --route-shape needs three positive integers R,K,E; got {spec!r}")
  return dict(route_layers=r, route_k=k, num_experts=e)


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags of this entry point (launch tests parse the pod commands with it):
  the run file and the process-local flags only; every knob comes from the run file (and
  `--config.a.b=value` overrides, which `main` splits off before this parser)."""
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("--run-config", default="",
                  help="the run's resolved run file (WORKDIR/config.json) or a preset "
                       "configs/X.py[:ARG]; empty: the declared defaults")
  ap.add_argument("--host", default="127.0.0.1")
  ap.add_argument("--port", type=int, default=0)
  ap.add_argument("--prompts", required=True, help="JSONL: prompt_id, tokens, answer")
  ap.add_argument("--route-shape", default="",
                  help="MoE routing replay: 'R,K,E' (MoE layers, experts per token, experts) of the "
                       "run's model, which the starting process computes (this one runs without "
                       "JAX); rollouts' routes are validated against it (empty: routes refused)")
  ap.add_argument("--wal-dir", default=None,
                  help="write-ahead log directory: acked rollouts, leases, deliveries and the latest "
                       "weights survive a crash; a restart with the same dir replays it "
                       "(buffer.wal_fsync, audit.wal_archive: from the run file)")
  ap.add_argument("--wal-fsync-interval-s", type=float, default=1.0,
                  help="buffer.wal_fsync=interval: at most this often")
  ap.add_argument("--learner-state", default=None,
                  help="JSON file the learner keeps (checkpoint step, resume request); read at "
                       "startup to rewind after a learner resume (buffer/replay.py)")
  TLS.add_arguments(ap)
  ap.add_argument("--max-workers", type=int, default=256,
                  help="server threads = max concurrent RPCs (long-polls and streams hold one each)")
  ap.add_argument("--max-weight-bytes", type=int, default=64 << 30)
  ap.add_argument("--no-tune-malloc", action="store_true", help="leave glibc malloc defaults")
  ap.add_argument("--switch-interval-s", type=float, default=0.0,
                  help="sys.setswitchinterval for the server process (0: Python's default 5 ms)")
  return ap


def from_run(run: config.RunConfig, a: argparse.Namespace, token: str, tls: TLS) -> BufferServer:
  """The server a resolved run config and this process's flags describe: the batch shape,
  PipelineRL-k and its freshness bound, the limits, the data order seed, No-Positive-Resampling
  (the buffer retires the prompts; the learner only logs `npr_retired`), the WAL's fsync policy
  and archive, all from the run config."""
  r, b = run.rollout, run.buffer
  npr = run.rl.npr_threshold if run.rl.no_positive_resampling else None
  limits = val.Limits(max_completion_tokens=config.max_completion_len(r),
                      **_route_limits(a.route_shape))
  return BufferServer(
      load_prompts(a.prompts), token=token, prompts_per_step=r.prompts_per_step,
      group_size=r.generations_per_prompt, max_lag=r.max_lag, mode=r.mode, max_ahead=r.max_ahead,
      host=a.host, port=a.port, max_message_bytes=b.max_message_bytes, lease_ttl_s=b.lease_ttl_s,
      limits=limits, shuffle_seed=run.seed, max_workers=a.max_workers, npr_threshold=npr,
      wal_dir=a.wal_dir, wal_fsync=b.wal_fsync, wal_fsync_interval_s=a.wal_fsync_interval_s,
      wal_archive=run.audit.wal_archive, learner_state=replay.read_learner_state(a.learner_state),
      max_weight_bytes=a.max_weight_bytes, tls=tls)


def main(argv: Optional[Sequence[str]] = None) -> None:
  rest, overrides = config.split_overrides(sys.argv[1:] if argv is None else argv)
  a = build_parser().parse_args(rest)
  logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
  try:                                # the run file every process of the run reads, resolved alike
    run = config.resolve(a.run_config or None, overrides)
  except config.ConfigError as e:
    sys.exit(f"config error: {e}")
  if not a.no_tune_malloc:
    tune_malloc()
  if a.switch_interval_s > 0:
    sys.setswitchinterval(a.switch_interval_s)   # the gRPC poller thread gets the GIL sooner
  token = os.environ.get(run.buffer.auth_token_env, "")
  if not token:
    sys.exit(f"error: environment variable {run.buffer.auth_token_env} (the auth token, "
             f"buffer.auth_token_env) is empty or unset")
  tls = TLS.from_args(a)
  try:
    tls.check(server=tls.enabled)
  except ValueError as e:
    sys.exit(f"error: {e}")
  try:
    srv = from_run(run, a, token, tls).start()
  except weight_store.UnsupportedWeightsFormat as e:   # a WAL written by the old blob protocol
    sys.exit(f"error: {e}")
  srv.learner_state_path = a.learner_state or ""
  # liveness from progress (scalerl_jax/progress.py): buffer.progress_file of the run file
  srv.state.progress = Beacon(run.buffer.progress_file)
  srv.state.progress.tick()
  print(config.knob_line(run, "buffer"), file=sys.stderr, flush=True)   # as the other pods log it
  out = {"port": srv.port, "address": srv.address}
  if srv.wal is not None or srv.wal_report:
    out["wal"] = srv.wal_report
  print(json.dumps(out), flush=True)
  # The handler only flags the request; this thread stops the server. grpc's stop() run inside the
  # handler (it interrupts grpc's own wait on this thread) once hung for good, SIGTERMs included:
  # an orphaned buffer found alive minutes after its run was killed.
  stopping = threading.Event()
  signal.signal(signal.SIGTERM, lambda *_: stopping.set())
  while not srv.wait(timeout=0.2):
    if stopping.is_set():
      srv.stop(0)
      break
  if srv.restart_requested.is_set():
    time.sleep(1.0)                   # stop() runs on its thread: let it close the WAL
    sys.exit(RESTART_EXIT)


if __name__ == "__main__":
  main()
