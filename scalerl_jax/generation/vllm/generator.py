"""`VLLMGenerator`: the project-side `Generator` backed by a real vLLM engine in another process.

The engine runs in the vLLM venv (`.venv-vllm`, see scripts/setup_vllm_venv.sh) as
`python -m scalerl_jax.generation.vllm.worker`; this class (JAX venv, no vllm/torch import) spawns it,
listens on a private Unix socket and talks `vllm/protocol.py` (JSON headers + raw little-endian array
bytes, never pickle). Thread-safe: `generate` may run in one thread while another thread calls
`load_weights` (that is the in-flight update: sequences being generated continue with the new
weights and their old KV cache; every token carries the version that produced it).

    gen = VLLMGenerator("/path/to/hf_checkpoint")            # bf16 model, fp32 LM head
    groups = gen.generate([PromptSpec(0, np.array([1, 5, 6], np.int32))], n=4, spec=SamplingSpec())
    gen.load_weights(hf_named_arrays, version=1)             # HF names; chunked over the socket
    gen.close()
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import signal
import socket
import subprocess
import tempfile
import threading
import time
from typing import Callable, Iterable, Literal, Mapping, Sequence, cast

import numpy as np

from scalerl_jax import config as common
from scalerl_jax import lazy
from scalerl_jax.generation.vllm import protocol as P
from scalerl_jax.generation.generator import Generator
from scalerl_jax.generation.slots import DecodeStats, drive
from scalerl_jax.processes import child_env, launcher_argv
from scalerl_jax.types import Completion, PromptSpec, SamplingSpec
from scalerl_jax.types import WeightUpdateError, one_line

# JAX stays out of this module's import (the vLLM venv imports it: parity): loaded at first use.
models = lazy.module("scalerl_jax.models")

REPO_ROOT = pathlib.Path(__file__).resolve().parents[3]   # scalerl_jax/generation/vllm/generator.py -> the repo
DEFAULT_VENV = REPO_ROOT / ".venv-vllm"


class VLLMWorkerError(RuntimeError):
  """The worker process failed, died, or reported an error (message includes its log tail)."""


ROUTES_ENV = "SCALERL_VLLM_RECORDS_ROUTES"   # "1" / "0": what the vLLM engines can do, unasked


def routes_capability(venv: str | None = None) -> tuple[bool, str]:
  """(can the vLLM engines return routed experts, why not), for `records_routes` at start-up:
  $SCALERL_VLLM_RECORDS_ROUTES=1/0 when set (a remote fleet's engines, which this machine cannot
  ask), else the vLLM venv's own answer (worker.routes_capability, in a subprocess: ~20 s of vllm
  import on 2 loaded cores; once per process)."""
  env = os.environ.get(ROUTES_ENV, "")
  if env in ("0", "1"):
    return env == "1", "" if env == "1" else f"${ROUTES_ENV}=0"
  return ask_vllm_venv(str(vllm_python(venv)))


@functools.lru_cache(maxsize=None)
def ask_vllm_venv(python: str) -> tuple[bool, str]:
  """worker.routes_capability() as the vLLM venv at interpreter `python` answers it."""
  py = pathlib.Path(python)
  if not py.exists():
    return False, f"no vLLM venv here to ask ({py}); set ${ROUTES_ENV}=1 for engines that can"
  code = ("import json; from scalerl_jax.generation.vllm.worker import routes_capability as f; "
          "print(json.dumps(f()))")
  env_ = dict(os.environ, PYTHONPATH=str(REPO_ROOT), VLLM_LOGGING_LEVEL="ERROR")
  try:
    res = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=300,
                         env=env_, cwd=str(REPO_ROOT))
    ok, why = json.loads(res.stdout.strip().splitlines()[-1])
  except (subprocess.SubprocessError, ValueError, IndexError, OSError) as e:
    return False, f"could not ask the vLLM venv ({type(e).__name__}: {e})"
  return bool(ok), str(why)


def vllm_python(venv: str | os.PathLike | None = None) -> pathlib.Path:
  """Path of the vLLM venv's interpreter (env SCALERL_VLLM_VENV overrides the default)."""
  venv = pathlib.Path(venv or os.environ.get("SCALERL_VLLM_VENV") or DEFAULT_VENV)
  return venv / "bin" / "python"


class _Pending:
  __slots__ = ("event", "header", "arrays", "error")

  def __init__(self):
    self.event = threading.Event()
    # The reply (header, arrays) or the error, set before `event` is.
    self.header: dict | None = None
    self.arrays: dict | None = None
    self.error: str | None = None


class VLLMGenerator(Generator):
  """Generator over a vLLM worker process. See docs/VLLM.md for the settings and their numbers.

  Args:
    model_dir: HF checkpoint directory (config.json + safetensors) the engine starts from.
    dtype: engine dtype ("bfloat16" default, or "float32").
    head_dtype: LM-head dtype ("float32" = FP32 head, the paper's setting; "model" = engine dtype).
    max_model_len: longest prompt + completion (incl. injected tokens).
    kv_cache_bytes: explicit KV-cache memory; None (default) = on GPU, vLLM sizes the cache from
      `gpu_memory_utilization` (what is left of that share of HBM after weights and activations);
      on CPU, CPU_KV_CACHE_BYTES of host RAM.
    gpu_memory_utilization: share of each GPU's memory the engine may use (GPU, kv_cache_bytes None).
    max_num_seqs: sequences the engine runs at once (the launch sets generator.decode_batch).
    enforce_eager: skip torch.compile (faster start, slower decode on CPU).
    omp_threads_bind: VLLM_CPU_OMP_THREADS_BIND for the CPU backend (e.g. "0-1"); None = vLLM's auto.
    initial_version: policy version of the checkpoint weights.
    startup_timeout: seconds to wait for the engine to come up.
    venv: the vLLM venv (default .venv-vllm at the repo root).
    log_path: where the worker's stdout/stderr go (default: a temp file; see `log_path`).
    engine_args: extra `AsyncEngineArgs` keyword arguments.
    report_progress: the engine streams cumulative outputs so that `progress()` can report each
      running request's tokens so far (monitoring and tests; O(length) of copying per step).
    route_layers: MoE routing replay (R3): the engine layers that are MoE, in order; every
      Completion then carries `routes` int32 [prompt + completion tokens, R, K] (the worker asks
      vLLM for routed experts and refuses to start where the engine cannot return them).
    engine_factory: tests only, "module:callable(cfg)" building a stand-in for vLLM's AsyncLLM.
  """

  def __init__(self, model_dir: str | os.PathLike, *, dtype: str = "bfloat16",
               head_dtype: str | None = "float32", max_model_len: int = 4096,
               kv_cache_bytes: int | None = None, gpu_memory_utilization: float = common.Generator.gpu_memory_utilization,
               enforce_eager: bool = False,
               enable_prefix_caching: bool = True, max_num_seqs: int = 256,
               max_num_batched_tokens: int | None = None, seed: int = 0,
               omp_threads_bind: str | None = None, initial_version: int = 0,
               startup_timeout: float = 900.0, venv: str | os.PathLike | None = None,
               log_path: str | os.PathLike | None = None, reset_prefix_cache_on_update: bool = True,
               engine_args: Mapping | None = None, report_progress: bool = False,
               route_layers: Sequence[int] | None = None, engine_factory: str = ""):
    py = vllm_python(venv)
    if not py.exists():
      raise VLLMWorkerError(f"vLLM venv interpreter {py} not found; run scripts/setup_vllm_venv.sh")
    self._dir = tempfile.mkdtemp(prefix="scalerl_vllm_")
    self._shm: P.ShmSlots | Literal[False] | None = None   # P.ShmSlots once a weight update uses shared memory (False: unusable)
    sock_path = os.path.join(self._dir, "worker.sock")
    self.log_path = str(log_path or os.path.join(self._dir, "worker.log"))
    cfg = dict(model=str(model_dir), dtype=dtype, head_dtype=head_dtype, max_model_len=max_model_len,
               kv_cache_bytes=None if kv_cache_bytes is None else int(kv_cache_bytes),
               gpu_memory_utilization=float(gpu_memory_utilization), enforce_eager=enforce_eager,
               enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, seed=seed,
               initial_version=initial_version,
               reset_prefix_cache_on_update=reset_prefix_cache_on_update,
               engine_args=dict(engine_args or {}), report_progress=bool(report_progress),
               return_routes=route_layers is not None,
               route_layers=None if route_layers is None else [int(i) for i in route_layers],
               engine_factory=engine_factory)
    self.record_routes = route_layers is not None
    self.max_model_len = max_model_len
    self.dtype = dtype
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("VLLM_DO_NOT_TRACK", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    for k in ("JAX_PLATFORMS", "XLA_FLAGS"):   # nothing jax-related leaks into the worker
      env.pop(k, None)
    if omp_threads_bind:
      env["VLLM_CPU_OMP_THREADS_BIND"] = omp_threads_bind
    self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    self._listener.bind(sock_path)
    self._listener.listen(1)
    self._log = open(self.log_path, "ab")
    self._log.write(f"--- vLLM engine start {time.strftime('%Y-%m-%dT%H:%M:%S')} by pid "
                    f"{os.getpid()}: {model_dir} (version {initial_version})\n".encode())
    self._log.flush()   # before the engine's own lines (a log kept across restarts)
    # Through the exec launcher: dies with this process (PDEATHSIG, then its reaper's SIGKILL of
    # the engine's process group after SCALERL_CHILD_GRACE_S), even inside a long engine step.
    # Its own process group (killpg), but this process's session: a new session is a new
    # scheduler autogroup on Linux (kernel.sched_autogroup_enabled=1), and the engine's group
    # then starved this process's threads for 8-24 s at a time on a loaded 2-core box (the
    # progress / weight-update RPCs stalled until the generation ended; docs/VLLM.md).
    self._proc = subprocess.Popen(
        launcher_argv([str(py), "-m", "scalerl_jax.generation.vllm.worker", "--socket", sock_path,
                       "--config", json.dumps(cfg)], python=str(py)),
        cwd=str(REPO_ROOT), env=child_env(env), stdout=self._log,
        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, process_group=0)
    self._sock: socket.socket | None = None
    self._pending: dict[int, _Pending] = {}
    self._lock = threading.Lock()          # pending map + request ids
    self._send_lock = threading.Lock()     # whole frames go out atomically
    self._update_lock = threading.Lock()   # one weight update at a time
    self._next_id = 1
    self._closed = False
    self._dead: str | None = None
    self.last_update_stats: dict | None = None
    # HF name -> shape of the start checkpoint: an update's tensor of another shape is refused
    # before any weight is touched (vLLM's layerwise reload does not check shapes).
    self._hf_shapes = P.checkpoint_shapes(model_dir)
    self.on_chunk: Callable[[int], None] | None = None   # test hook before each chunk; may raise
    self.name_map: dict[str, str] = {}     # the last update's pushed -> served HF names
    t0 = time.monotonic()
    try:
      self._accept(startup_timeout)
      header, _ = P.recv_msg(self._connected)
    except Exception as e:
      self.close()
      raise VLLMWorkerError(f"vLLM worker did not start: {e}\n--- worker log tail ---\n"
                            f"{self.log_tail()}") from e
    if header.get("op") != "ready":
      self.close()
      raise VLLMWorkerError(f"vLLM worker failed to start: {header.get('error', header)}\n"
                            f"--- worker log tail ---\n{self.log_tail()}")
    self.startup_s = time.monotonic() - t0
    self.info_at_start = {k: v for k, v in header.items() if k not in ("op", "id", "arrays")}
    self._version = int(header["version"])
    self._reader = threading.Thread(target=self._read_loop, name="vllm-reader", daemon=True)
    self._reader.start()

  # -- process / socket plumbing -------------------------------------------------------------------
  def _accept(self, timeout: float):
    deadline = time.monotonic() + timeout
    self._listener.settimeout(1.0)
    while True:
      try:
        self._sock, _ = self._listener.accept()
        self._sock.settimeout(None)
        break
      except socket.timeout:
        if self._proc.poll() is not None:
          raise VLLMWorkerError(f"worker exited with code {self._proc.returncode}") from None
        if time.monotonic() > deadline:
          raise VLLMWorkerError(f"no connection within {timeout:.0f} s") from None
    # The ready message comes after the engine start (tens of seconds); bound that wait too.
    self._sock.settimeout(max(1.0, deadline - time.monotonic()))

  def log_tail(self, lines: int = 40) -> str:
    """Last lines of the worker's log (for error messages)."""
    try:
      with open(self.log_path, "rb") as f:
        f.seek(0, 2)
        f.seek(max(0, f.tell() - 64_000))
        return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
      return "(no log)"

  @property
  def _connected(self) -> socket.socket:
    """The worker's connection (`_accept` sets it before anything is sent or read)."""
    assert self._sock is not None, "the vLLM worker has not connected"
    return self._sock

  def _read_loop(self):
    self._connected.settimeout(None)
    try:
      while True:
        header, arrays = P.recv_msg(self._connected)
        with self._lock:
          pend = self._pending.pop(header["id"], None) if "id" in header else None
        if pend is None:
          continue
        if header.get("op") == "error":
          pend.error = header.get("error", "unknown worker error")
        pend.header, pend.arrays = header, arrays
        pend.event.set()
    except Exception as e:   # EOF or broken pipe: fail everything outstanding
      self._dead = f"{type(e).__name__}: {e}"
      with self._lock:
        pending, self._pending = self._pending, {}
      for pend in pending.values():
        pend.error = f"worker connection lost ({self._dead})"
        pend.event.set()

  def _send(self, op: str, header: dict | None = None, arrays=(), dtypes=None) -> _Pending:
    if self._closed or self._dead:
      raise VLLMWorkerError(f"vLLM worker is not available ({self._dead or 'closed'})")
    pend = _Pending()
    with self._lock:
      rid = self._next_id
      self._next_id += 1
      self._pending[rid] = pend
    with self._send_lock:
      P.send_msg(self._connected, {"op": op, "id": rid, **(header or {})}, arrays, dtypes)
    return pend

  def _wait(self, pend: _Pending, timeout: float | None = None) -> tuple[dict, dict]:
    if not pend.event.wait(timeout):
      raise VLLMWorkerError(f"no reply from the vLLM worker within {timeout} s")
    if pend.error:
      tail = self.log_tail() if self._dead else ""
      raise VLLMWorkerError(f"vLLM worker error: {pend.error}" + (f"\n--- log ---\n{tail}" if tail else ""))
    assert pend.header is not None and pend.arrays is not None   # no error: the reply is set
    return pend.header, pend.arrays

  def _call(self, op, header=None, arrays=(), timeout=None, dtypes=None):
    return self._wait(self._send(op, header, arrays, dtypes), timeout)

  # -- Generator interface -------------------------------------------------------------------------
  @property
  def version(self) -> int:
    return self._version

  def generate(self, prompts: Sequence[PromptSpec], n: int,
               spec: SamplingSpec) -> list[list[Completion]]:
    """Samples `n` completions per prompt; blocks until all are done (safe to call from threads)."""
    pend = self.submit(prompts, n, spec)
    return self.collect(pend, prompts, n) if pend is not None else []

  def submit(self, prompts: Sequence[PromptSpec], n: int, spec: SamplingSpec,
             sample_offset: int = 0) -> _Pending | None:
    """Sends a `generate` op without waiting (the engine batches every op in flight); returns
    its handle for `collect` (None for no prompts). Samples sample_offset .. + n - 1 of each
    prompt: seeds and thinking budgets follow the sample index."""
    if n < 1:
      raise ValueError(f"n must be >= 1, got {n}")
    if not prompts:
      return None
    toks = [np.asarray(p.tokens, np.int32).reshape(-1) for p in prompts]
    if any(t.size == 0 for t in toks):
      raise ValueError("empty prompt")
    spec_d = dataclasses.asdict(spec)
    spec_d = {k: (list(v) if isinstance(v, tuple) else v) for k, v in spec_d.items()}
    return self._send("generate", {"n": n, "spec": spec_d, "sample_offset": int(sample_offset),
                                   "prompt_ids": [int(p.prompt_id) for p in prompts]},
                      {"prompt_tokens": np.concatenate(toks),
                       "prompt_lens": np.asarray([t.size for t in toks], np.int32)})

  def collect(self, pend, prompts: Sequence[PromptSpec], n: int,
              timeout: float | None = None) -> list[list[Completion]]:
    """Waits for a `submit`ted op; returns its completions, one group (list) per prompt."""
    header, arrays = self._wait(pend, timeout)
    out: list[list[Completion]] = [[] for _ in prompts]
    off = roff = 0
    routes = arrays.get("routes")   # return_routes: [Σ (prompt + completion tokens), R, K]
    for k, m in enumerate(header["completions"]):
      L = m["length"]
      sl = slice(off, off + L)
      off += L
      rows = None
      if routes is not None:
        n_rows = len(np.asarray(prompts[k // n].tokens).reshape(-1)) + L
        rows, roff = routes[roff:roff + n_rows].copy(), roff + n_rows
      out[k // n].append(Completion(
          prompt_id=m["prompt_id"], tokens=arrays["tokens"][sl].copy(),
          logprobs=arrays["logprobs"][sl].copy(), versions=arrays["versions"][sl].copy(),
          policy_mask=arrays["policy_mask"][sl].copy(), finish_reason=m["finish_reason"],
          routes=rows))
    if routes is not None and roff != len(routes):
      raise VLLMWorkerError(f"the worker sent {len(routes)} route rows; the completions and their "
                            f"prompts account for {roff}")
    return out

  def _shm_slots(self) -> P.ShmSlots | None:
    """The /dev/shm slots of the shared-memory transport, or None where /dev/shm is unusable."""
    if self._shm is None:
      try:
        self._shm = P.ShmSlots(2)
      except OSError:
        self._shm = False
    return self._shm or None

  def load_weights(self, weights: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]],
                   version: int, *, chunk_bytes: int = 64 << 20,
                   wire_dtype: str | None = None, transport: str = "auto") -> dict:
    """Pushes HF-named weights in chunks and makes them policy `version`, while generation runs.

    Generation is paused (mode "keep") for the duration; in-flight sequences then continue with
    the new weights and their old KV cache. `wire_dtype="bfloat16"` converts float32 arrays to
    bf16 before sending (round-to-nearest-even, bit-identical to vLLM's own cast; half the bytes).
    `transport`: "shm" (chunks written once into two reused /dev/shm files that vLLM's worker
    maps; whole layers per chunk), "socket" (the bytes travel in frames and vLLM's RPC), "auto"
    (shm where /dev/shm works). Returns (and stores in `last_update_stats`) bytes, seconds and
    MB/s of the transfer."""
    if transport not in ("auto", "shm", "socket"):
      raise ValueError(f"transport={transport!r}; expected 'auto', 'shm' or 'socket'")
    pairs = cast(list[tuple[str, np.ndarray]],
                 list(weights.items()) if isinstance(weights, Mapping) else list(weights))
    with self._update_lock:
      shm = self._shm_slots() if transport != "socket" else None
      if transport == "shm" and shm is None:
        raise VLLMWorkerError("transport='shm' but /dev/shm is not usable here")
      header, _ = self._call("weights_check", {"names": [n for n, _ in pairs]}, timeout=600)
      if header["unknown"]:        # nothing touched yet: the engine keeps its weights and version
        raise WeightUpdateError(version, header["unknown"][0],
                                f"unknown weight name: not in the served model "
                                f"({len(header['unknown'])} unknown)")
      # Names as the served model holds them (e.g. `language_model.` + the text model's names
      # in a multimodal Llama-4), mapped from the model vLLM loaded.
      self.name_map = dict(header["map"])
      pairs = [(self.name_map.get(n, n), a) for n, a in pairs]
      for n, a in pairs:
        want = self._hf_shapes.get(n)
        if want is not None and tuple(np.shape(a)) != want:
          raise WeightUpdateError(version, n, f"shape {tuple(np.shape(a))}, the model holds "
                                              f"{want}")
      t0 = time.perf_counter()
      self._call("weights_begin", {"version": int(version)})
      nbytes, names, error = self._push_chunks(pairs, chunk_bytes, wire_dtype, shm, version)
      if error is not None:
        # A chunk failed: the engine may hold a mix of old and new weights. The worker keeps its
        # old version number and does not resume generation (nothing is sampled under a version
        # it does not hold) until an update succeeds.
        self._call("weights_end", {"version": int(version), "abort": error.line()})
        raise error
      header, _ = self._call("weights_end", {"version": int(version)})
      self._version = int(header["version"])
      wall = time.perf_counter() - t0
      stats = {k: header[k] for k in ("bytes", "names", "pause_s", "load_s", "paused_total_s",
                                      "prefix_cache_reset")}
      stats.update(wall_s=wall, wire_bytes=nbytes, names_sent=names,
                   transport="shm" if shm is not None else "socket",
                   mb_per_s=nbytes / 1e6 / wall if wall > 0 else float("inf"))
      self.last_update_stats = stats
      return stats

  def _push_chunks(self, pairs, chunk_bytes: int, wire_dtype: str | None, shm, version: int = -1
                   ) -> tuple[int, int, WeightUpdateError | None]:
    """Sends the named arrays in chunks of an open update; returns (wire bytes, names, the first
    failure as a WeightUpdateError naming a tensor of the failed chunk, or None)."""
    pending, nbytes, names = [], 0, 0
    try:
      for i, chunk in enumerate(P.chunk_weights(pairs, chunk_bytes,
                                                P.hf_layer_key if shm else None)):
        if self.on_chunk is not None:
          self.on_chunk(i)
        dtypes = {n: wire_dtype for n, a in chunk if wire_dtype and a.dtype == np.float32}
        if shm is not None:
          if len(pending) >= len(shm.slots):    # that slot's previous chunk must be loaded
            self._wait(pending[-len(shm.slots)][1])
          path, metas = shm.write(i, chunk, dtypes)
          pending.append((chunk[0][0], self._send("weights_shm", {"path": path,
                                                                  "shm_arrays": metas})))
        else:
          pending.append((chunk[0][0], self._send("weights_chunk", {}, chunk, dtypes)))
        nbytes += sum(a.nbytes // (2 if n in dtypes else 1) for n, a in chunk)
        names += len(chunk)
    except Exception as e:   # noqa: BLE001 -- reported after the sent chunks were answered
      first: WeightUpdateError | None = WeightUpdateError(version, "", one_line(e))
    else:
      first = None
    for name, p in pending:      # every sent chunk is answered before the update is closed
      try:
        self._wait(p)
      except VLLMWorkerError as e:
        first = first or WeightUpdateError(version, f"{name} (chunk)", one_line(e))
    return nbytes, names, first

  @property
  def push_dtype(self) -> str | None:
    """The wire dtype of float32 arrays pushed by `load_params`: "bfloat16" for a
    bf16 engine (it stores bf16 weights, LM head included: the FP32 head casts at compute time;
    vLLM's own cast is the same round-to-nearest-even), None (as they are) for an fp32 engine."""
    return P.BF16 if self.dtype == P.BF16 else None

  def load_params(self, params, version: int, model_cfg) -> None:
    """Our-layout params (a streamed version, bf16 or fp32) as HF names, pushed in `push_dtype`."""
    self.load_weights(models.hf_named_arrays(model_cfg, params), version,
                      wire_dtype=self.push_dtype)

  # -- extras ----------------------------------------------------------------------------------------
  def info(self) -> dict:
    """Engine facts: vLLM version, engine/LM-head dtypes and the dtype of logits actually produced."""
    header, _ = self._call("info", timeout=120)
    return {k: v for k, v in header.items() if k not in ("op", "id", "arrays")}

  def progress(self) -> list[int]:
    """Tokens generated so far by each running request, ascending (started with
    `report_progress=True`; otherwise VLLMWorkerError)."""
    header, _ = self._call("progress", timeout=60)
    return list(header["running"])

  def param_digest(self, per_name: bool = False) -> str | dict[str, str]:
    """sha256 over the engine's current parameters (equal digests: bit-identical weights); with
    `per_name`, {vLLM parameter name: sha256} to locate a difference."""
    header, _ = self._call("param_digest", {"per_name": per_name}, timeout=300)
    return header["digest"]

  def set_head_dtype(self, dtype: str) -> str:
    """Test hook: LM-head projection dtype at run time ("float32", "bfloat16", or "model")."""
    header, _ = self._call("set_head_dtype", {"dtype": dtype}, timeout=120)
    return header["head_dtype"]

  def close(self) -> None:
    """Stops the engine and the worker process group (idempotent)."""
    if self._closed:
      return
    self._closed = True
    if self._sock is not None and not self._dead:
      try:
        with self._send_lock:
          P.send_msg(self._sock, {"op": "shutdown", "id": 0})
      except OSError:
        pass
    try:
      self._proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
      try:
        os.killpg(self._proc.pid, signal.SIGTERM)   # the group this class created
        self._proc.wait(timeout=15)
      except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
          os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
          pass
    for s in (self._sock, self._listener):
      if s is not None:
        s.close()
    if self._shm:
      self._shm.close()
    self._log.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class VLLMSlots:
  """Continuous generation on a VLLMGenerator: one vLLM request per sample, up to `capacity` in
  flight; the engine's scheduler batches them and a finished sample's slot is refilled at once.
  Same interface as generation/continuous.py's ContinuousDecoder (`free`, `in_flight`,
  `insert`, `step`, `stats`). Occupancy here is in time, not decode steps: `slot_steps` counts
  slot-milliseconds, `live_row_steps` the milliseconds samples were in flight."""

  def __init__(self, gen: VLLMGenerator, capacity: int, spec: SamplingSpec):
    if capacity <= 0:
      raise ValueError(f"capacity must be positive, got {capacity}")
    self.gen, self.capacity, self.spec = gen, int(capacity), spec
    self._ops: dict = {}   # pending op -> SlotRequest
    self.stats = DecodeStats()
    self._t = time.perf_counter()

  @property
  def free(self) -> int:
    """Slots without a request in flight."""
    return self.capacity - len(self._ops)

  @property
  def in_flight(self) -> list:
    """The SlotRequests being generated."""
    return list(self._ops.values())

  def _book(self) -> None:
    now = time.perf_counter()
    ms = (now - self._t) * 1e3
    self._t = now
    if self._ops:   # time the engine had work (free slots with nothing to insert: note_idle)
      self.stats.slot_steps += int(round(self.capacity * ms))
      self.stats.live_row_steps += int(round(len(self._ops) * ms))
      self.stats.row_steps += int(round(len(self._ops) * ms))   # the engine runs live ones only
      self.stats.decode_s += ms / 1e3

  def insert(self, requests) -> None:
    """Submits each SlotRequest as its own request: its seed, sample index and budgets."""
    if len(requests) > self.free:
      raise ValueError(f"{len(requests)} requests for {self.free} free slots")
    self._book()
    for r in requests:
      spec = dataclasses.replace(self.spec, seed=int(r.seed), think_budget_min=r.think_budget,
                                 think_budget_max=r.think_budget, answer_budget=r.answer_budget)
      self._ops[self.gen.submit([r.prompt], 1, spec, sample_offset=r.sample_index)] = r

  def step(self, timeout: float = 0.05, refill: bool = False) -> list:
    """Waits up to `timeout` s for samples to finish; returns them as (request, Completion).
    `refill`: ContinuousDecoder.step's; here every step returns at the first finished samples
    already (the engine's own scheduler refills its batch between tokens)."""
    del refill
    t_end = time.perf_counter() + timeout
    while True:
      ready = [p for p in self._ops if p.event.is_set()]
      if ready or not self._ops or time.perf_counter() >= t_end:
        break
      time.sleep(0.002)
    self._book()
    out = []
    for p in ready:
      r = self._ops.pop(p)
      (c,), = self.gen.collect(p, [r.prompt], 1)
      self.stats.completions += 1
      self.stats.tokens += len(c.tokens)
      self.stats.policy_tokens += int(np.sum(c.policy_mask))
      out.append((r, c))
    self.stats.chunks += 1
    return out

  def note_idle(self, seconds: float) -> None:
    """Books `seconds` the caller waited with free slots and nothing to insert."""
    self.stats.idle_s += float(seconds)

  def run(self, requests) -> list:
    """Generates all `requests` (slots refilled as samples finish): `slots.drive`."""
    return drive(self, requests)
