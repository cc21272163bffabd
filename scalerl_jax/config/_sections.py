"""The sections of the processes' parts: model, mesh, rl, optim, learner, rollout, generator,
buffer, weights, tls, eval, checkpoint, audit. Each field is one knob: its type, its default (the
only one) and its comment; value checks in the section's `check()`."""

import dataclasses
from typing import Any, ClassVar, Mapping

from scalerl_jax.config import _libraries
from scalerl_jax.config._base import (DEFAULT_RULES, VERIFY_MODES, WIRE_DTYPES, ConfigError,
                                      Section)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Model(Section):
  """Preset name + dtype / scan / remat choices (scalerl_jax.models.config presets). Other keys
  set on config.model (vocab_size, d_model, ...) override the preset's ModelConfig fields: they
  land in `arch`, each checked to name a ModelConfig field."""
  PATH: ClassVar[str] = "model"
  preset: str = "llama3_8b"
  param_dtype: str = "float32"
  dtype: str = "bfloat16"
  fp32_lm_head: bool = True
  scan_layers: bool = True
  remat: str = "full"
  hf_checkpoint: str = ""
  moe_impl: str = "dispatch"           # MoE: dispatch (expert-parallel, active FLOPs) | dense (reference)
  moe_capacity_factor: float = 0.0     # dispatch: 0 = dropless; c > 0 = c x average rows per expert,
                                       # overflow copies dropped and counted (metric moe_dropped)
  # Training-path attention backend (models/attention.py): auto = cuDNN flash attention on GPU,
  # Pallas splash on TPU, causal_blocks (query-blocked, tiles above the diagonal skipped)
  # elsewhere; blockwise = pure-JAX flash; xla_einsum = materialised scores.
  attention_impl: str = "auto"
  attention_block: int = 512           # key-block size of the blockwise backend
  attention_q_block: int = 64          # query-block size of the causal_blocks backend (CPU default)
  # LM-head matmul precision: fp32 (HIGHEST, the paper's FP32 head) | tf32 | bf16 inputs with fp32
  # accumulation (GPU / TPU speed; log-prob error measured in docs/LEARNER.md "Head precision").
  head_precision: str = "fp32"
  logits_chunk: int = 1024             # learner log-probs over sequence chunks of this many positions
  # Not a key: the ModelConfig field overrides set on config.model besides the keys above.
  arch: Mapping[str, Any] = dataclasses.field(default_factory=dict, metadata={"key": False})

  @classmethod
  def extra_keys(cls, node, extra, where):
    # The ModelConfig fields are the models package's (it loads JAX): each key is checked where
    # the ModelConfig is built (scalerl_jax/models/run.py::model_config, at resolve in main and
    # at the start of every JAX process), not here.
    return {"arch": {k: node[k] for k in extra}}

  def check(self):
    if self.attention_block < 1 or self.logits_chunk < 1:
      raise ConfigError("model.attention_block and model.logits_chunk must be >= 1")

  def to_dict(self) -> dict:
    return {**super().to_dict(), **self.arch}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mesh(Section):
  """Mesh shape over axes (data, fsdp, tensor, expert) and THE logical-axis rules table."""
  PATH: ClassVar[str] = "mesh"
  shape: tuple[tuple[str, int], ...] = (("data", 1), ("fsdp", -1), ("tensor", 1), ("expert", 1))
  rules: tuple[tuple[str, Any], ...] = DEFAULT_RULES


@dataclasses.dataclass(frozen=True, kw_only=True)
class RL(Section):
  """Loss family, aggregation, advantage normalization, filters, interruption."""
  PATH: ClassVar[str] = "rl"
  loss: str = "cispo"
  cispo_eps_max: float = 5.0
  clip_eps_low: float = 0.2
  clip_eps_high: float = 0.28
  gspo_eps_low: float = 3e-3
  gspo_eps_high: float = 4e-3
  aggregation: str = "prompt"          # prompt | sample | token
  adv_norm: str = "batch"              # batch | prompt | none
  zero_variance_filter: bool = True
  no_positive_resampling: bool = True
  npr_threshold: float = 0.9
  length_control: str = "interrupt"    # interrupt | penalty
  length_penalty_max: int = 14336
  length_penalty_cache: int = 2048
  routing_replay: bool = False         # MoE (R3): the learner reuses the generator's expert choices
  # Rollout correction (docs/LEARNER.md "Rollout correction"; ρ = learner-now / generator-then):
  rc_token_tis_cap: float = 0.0        # token TIS: loss weight × min(ρ_t, cap); 0 = off
  rc_token_mask_low: float = 0.0       # token band (IcePop): tokens with ρ_t outside [low, high]
  rc_token_mask_high: float = 0.0      #   are masked; both 0 = off; high may be inf
  rc_seq_mask_low: float = 0.0         # sequence band: rows whose geometric-mean ratio
  rc_seq_mask_high: float = 0.0        #   exp(mean log ρ) is outside [low, high] are masked; 0/0 = off
  rc_seq_tis_cap: float = 0.0          # sequence TIS: row weight × min(Π ρ_t, cap); 0 = off
  routing_replay_auto: bool = True     # MoE: start-up turns routing_replay on where the (local)
                                       # generators record routes (False: routing_replay as set)
  record_routes: bool = False          # MoE: generators record routes also without replay (R3
                                       # off), for the learner metric router_disagree

  def check(self):
    # The loss registry's names, the aggregations, advantage norms and the correction's bounds
    # belong to rl/, which loads JAX: recipes.validate checks them at resolve time in main (and
    # the learner's RLSpec again), not every process that reads this section.
    if self.length_control not in ("interrupt", "penalty"):
      raise ConfigError(f"rl.length_control={self.length_control!r}; expected "
                        "'interrupt' or 'penalty'")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Optim(Section):
  """AdamW + schedule + clipping (paper defaults)."""
  PATH: ClassVar[str] = "optim"
  lr: float = 5e-7
  b1: float = 0.9
  b2: float = 0.999
  eps: float = 1e-15
  weight_decay: float = 0.01
  warmup_steps: int = 100
  max_grad_norm: float = 1.0
  microbatches: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class Learner(Section):
  """Learner padding (docs/SCALE.md "Padding"): a batch's token axis is padded to a multiple of
  pad_multiple (config.padded_length, never above prompt + think + injected + answer); with
  optim.microbatches > 1 the rows are length-sorted into micro-batches and each micro-batch is cut
  to the smallest of at most max_buckets lengths covering it (one compiled branch each)."""
  PATH: ClassVar[str] = "learner"
  pad_multiple: int = 128              # token-axis bucket (tokens); 1 = no bucketing
  max_buckets: int = 8                 # per-micro-batch length buckets (compiled branches)
  sort_rows: bool = True               # length-sort rows into micro-batches (loss unchanged)
  progress_file: str = ""              # touched at every step and weight publish (scalerl_jax/progress.py); "" = none
  progress_max_age_s: float = 1800.0   # the learner pod's liveness probe fails past this age of progress_file


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rollout(Section):
  """Batch geometry, PipelineRL-k, generation budgets."""
  PATH: ClassVar[str] = "rollout"
  prompts_per_step: int = 48
  generations_per_prompt: int = 16
  batch_size: int = 0                  # if > 0: sets prompts_per_step = batch_size / generations
  mode: str = "pipeline"               # pipeline (PipelineRL-k) | ppo_off_policy
  max_lag: int = 8                     # k
  think_budget_min: int = 10240
  think_budget_max: int = 12288
  answer_budget: int = 2048
  max_prompt_len: int = 2048
  interruption_text: str = ("Okay, time is up. Let me stop thinking and formulate a final answer "
                            "now. </think>")
  max_ahead: int = -1                  # freshness bound: learner batches leased beyond the newest
                                       # version (pipeline; lag <= it); -1 = off (k alone bounds)

  def check(self):
    if self.mode not in ("pipeline", "ppo_off_policy"):
      raise ConfigError(f"rollout.mode={self.mode!r}; expected 'pipeline' or 'ppo_off_policy'")
    if self.max_lag < 0:
      raise ConfigError(f"rollout.max_lag (k) must be >= 0, got {self.max_lag}")
    if self.max_ahead < -1 or (self.max_ahead >= 0 and self.mode != "pipeline"):
      raise ConfigError(f"rollout.max_ahead={self.max_ahead}: -1 (off) or >= 0 with "
                        f"rollout.mode=pipeline (got mode {self.mode!r})")
    if self.prompts_per_step < 1 or self.generations_per_prompt < 1:
      raise ConfigError("rollout.prompts_per_step and rollout.generations_per_prompt must be >= 1")
    if self.batch_size:              # resolved into prompts_per_step
      if self.batch_size % self.generations_per_prompt:
        raise ConfigError(f"rollout.batch_size={self.batch_size} is not divisible by "
                          f"rollout.generations_per_prompt={self.generations_per_prompt}")
      object.__setattr__(self, "prompts_per_step", self.batch_size // self.generations_per_prompt)
    if not 0 <= self.think_budget_min <= self.think_budget_max:
      raise ConfigError(f"need 0 <= think_budget_min <= think_budget_max, got "
                        f"[{self.think_budget_min}, {self.think_budget_max}]")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Generator(Section):
  """Fault tolerance (docs/RELIABILITY.md): heartbeats keep leases alive, a lease silent for
  buffer.lease_ttl_s expires (its prompt is re-leased); the supervisor restarts dead generators /
  a dead buffer up to max_restarts times."""
  PATH: ClassVar[str] = "generator"
  # backend: vllm | jax | scripted (generation/fake.py: a scripted stand-in for an instruct model,
  # no weights; tests and wiring demos of the prompt templates only).
  backend: str = "vllm"
  num_workers: int = 64
  # temperature T also sets the learner's log-probs (log_softmax(logits / T)); top_p must stay 1
  # for training (truncated sampling is refused).
  temperature: float = 1.0
  top_p: float = 1.0
  heartbeat_s: float = 10.0
  retry_budget_s: float = 60.0
  max_restarts: int = 3
  jax_devices: int = 1               # JAX backend: decode data-parallel over N XLA:CPU devices
  chunk_steps: int = 16              # JAX backend: decode steps per jitted chunk (weight swaps between)
  groups_per_lease: int = 4          # groups a worker leases (and generates) at once
  tensor_parallel: int = 1           # vLLM engine tensor-parallel size (devices per generator)
  decode_batch: int = 64             # sequences in a generator's KV cache (vLLM max_num_seqs)
  # Continuous batching (JAX: generation/continuous.py; vLLM: one request per sample): decode_batch
  # slots kept full, each group graded and pushed when its last sample ends. False: one batch
  # per lease, drained (also the fallback where continuous cannot run: Worker.continuous_ok).
  continuous: bool = True
  grade_workers: int = 2             # threads grading finished groups off the decode path
  gpu_memory_utilization: float = 0.9  # vLLM on GPU: share of HBM for weights + KV cache
  kv_cache_bytes: int = 0            # vLLM: explicit KV-cache bytes (0 = from gpu_memory_utilization)
  eval_hold_versions: int = 2        # weight versions a generator keeps for pinned evaluations
  eval_groups_per_lease: int = 64    # evaluation groups (prompts) a worker samples at once
  # A continuous JAX generator decodes an evaluation lease through this many slots, refilled as its
  # samples end (generation/eval_lane.py; ~2x faster than the lease as one static batch on the
  # tiny lengths task); 0: one static batch per lease, as the drain loop does.
  eval_decode_batch: int = 64
  vllm_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # extra VLLMGenerator kwargs (engine_args...)
  # vLLM engine start checkpoint: "" = the learner's version-0 weights exported into the workdir;
  # else a local HF directory (the fleet image's copy of the base model). It must hold the
  # learner's start weights: the start-up parity gate (health.parity_gate) stops the run if not.
  vllm_model_dir: str = ""
  scripted_hostile_every: int = 0    # scripted backend: every Nth sample boxes a hostile math answer (tests, chaos; 0 = never)
  # A gs:// model.hf_checkpoint is copied once per node for vLLM (scalerl_jax/node_cache.py): into
  # this node-local directory shared by the node's generator pods (the manifests' hostPath), under
  # a lock, by parallel ranged reads; "" = TMPDIR/scalerl-ckpt (one copy per container).
  ckpt_cache_dir: str = ""
  ckpt_fetch_workers: int = 16       # concurrent ranged reads per file of that copy
  ckpt_fetch_piece_mb: int = 64      # MiB per ranged read (memory: workers x piece)
  ckpt_cache_verify: bool = True     # re-hash the node copy (MD5s in its manifest) before reusing it

  def check(self):
    names = _libraries.owner("backends").names()
    if self.backend not in names:
      raise ConfigError(f"generator.backend={self.backend!r}; expected one of {names}")
    if not self.temperature > 0:
      raise ConfigError(f"generator.temperature={self.temperature}: training rollouts need T > 0 "
                        f"(the learner computes log_softmax(logits / T) for the importance ratios)")
    if self.top_p < 1.0:
      raise ConfigError(f"generator.top_p={self.top_p}: "
                        "truncated sampling is refused for training rollouts: the generators' "
                        "log-probs would be renormalised over the kept tokens while the learner's "
                        "are over the whole vocabulary, which biases every importance ratio; use "
                        "eval.top_p / eval.temperature for evaluation only")
    if self.num_workers < 1:
      raise ConfigError(f"generator.num_workers must be >= 1, got {self.num_workers}")
    if self.eval_hold_versions < 1:
      raise ConfigError(f"generator.eval_hold_versions must be >= 1, got "
                        f"{self.eval_hold_versions}")
    if self.eval_decode_batch < 0:
      raise ConfigError(f"generator.eval_decode_batch must be >= 0 (0 = a static batch per "
                        f"evaluation lease), got {self.eval_decode_batch}")
    if self.ckpt_fetch_workers < 1 or self.ckpt_fetch_piece_mb < 1:
      raise ConfigError(f"generator.ckpt_fetch_workers={self.ckpt_fetch_workers} and "
                        f"generator.ckpt_fetch_piece_mb={self.ckpt_fetch_piece_mb} must be >= 1")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buffer(Section):
  """gRPC rollout buffer address, auth, limits."""
  PATH: ClassVar[str] = "buffer"
  address: str = "127.0.0.1:0"
  auth_token_env: str = "SCALERL_BUFFER_TOKEN"
  external: bool = False               # True: connect to a buffer service at `address` (launch/)
                                       # instead of starting one plus generators (separate jobs)
  max_message_bytes: int = 64 << 20
  lease_ttl_s: float = 120.0
  max_restarts: int = 3
  wal_dir: str = ""                  # the buffer's write-ahead log on local disk; "" = LOCAL_DIR/buffer_wal
  wal_fsync: str = "batch"           # batch (fsync per request) | interval | none (buffer/wal.py)
  generator_address: str = ""        # the address generators dial ("" = the buffer's; e.g. a proxy)
  progress_file: str = ""            # touched at every WAL commit and served lease (the buffer's liveness beacon); "" = none
  progress_max_age_s: float = 600.0  # the buffer pod's liveness probe fails past this age of progress_file

  def check(self):
    if self.external and self.address.endswith(":0"):
      raise ConfigError(f"buffer.external=True needs buffer.address=HOST:PORT of the buffer "
                        f"service, got {self.address!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weights(Section):
  """Weight updates (docs/ROLLOUT.md "Weights"): serve_from="learner": every learner process
  serves its own shards (weights/source.py, one hop; host/port: where it listens, "" = 127.0.0.1
  for one process with its own buffer, else 0.0.0.0; advertise: the host generators dial, default
  the listening host, or this host's address for 0.0.0.0); "buffer": chunks go through the buffer
  (two hops, the buffer host holds the model)."""
  PATH: ClassVar[str] = "weights"
  serve_from: str = "learner"
  host: str = ""
  port: int = 0
  advertise: str = ""
  # dtype float32 params travel in to generators (learner keeps fp32 masters): "bfloat16" (half
  # the bytes; a bf16 engine holds bf16 weights anyway, its FP32 LM head casts at compute time)
  # or "float32" (an fp32 generator, e.g. configs/tiny.py, computes with the exact masters).
  wire_dtype: str = "bfloat16"
  # A generator whose weight update fails (checksum, shape, name, engine load) keeps its version,
  # waits update_backoff_s (doubling, <= 60 s) and fetches again; after update_retries failed
  # updates in a row it exits non-zero with one line naming the version, the tensor and the cause.
  update_retries: int = 5
  update_backoff_s: float = 1.0
  # Exact deltas (weights/delta.py) for a bfloat16 wire from learner sources: a generator that
  # holds the previous version gets only the changed elements (bit-exact, CRC-checked, a counted
  # full fetch otherwise). Every delta_full_every-th version goes out full. A float32 wire (the
  # tiny demo's exact masters) always sends full versions.
  delta: bool = True
  delta_full_every: int = 20
  # Relay fan-out (weights/relay.py): generators pass on the chunks they fetched in a tree of this
  # fan-out (0 = every generator fetches from the learner sources); relay_port: where each
  # generator's relay listens (0 = any free port), relay_advertise: the host others dial.
  relay_fanout: int = 2
  relay_port: int = 0
  relay_advertise: str = ""
  # The bulk weight channel (weights/bulk.py: chunks over plain TCP, same token and TLS) of the
  # learner's weight source (bulk_port) and of each generator's relay (relay_bulk_port); 0 = any
  # free port (found with the WeightBulkAddress call); launch/ pins both (in the manifests).
  bulk_port: int = 0
  relay_bulk_port: int = 0

  def check(self):
    if self.relay_fanout < 0 or not 0 <= self.relay_port <= 65535:
      raise ConfigError(f"weights.relay_fanout={self.relay_fanout} must be >= 0 and "
                        f"weights.relay_port={self.relay_port} a TCP port (0 = any free port)")
    if self.delta_full_every < 1:
      raise ConfigError(f"weights.delta_full_every={self.delta_full_every} must be >= 1 "
                        f"(1 = every version full)")
    if self.update_retries < 0 or not self.update_backoff_s >= 0:
      raise ConfigError(f"weights.update_retries={self.update_retries} and weights."
                        f"update_backoff_s={self.update_backoff_s} must be >= 0")
    if self.serve_from not in ("learner", "buffer"):
      raise ConfigError(f"weights.serve_from={self.serve_from!r}; expected 'learner' (each "
                        f"learner process serves its shards) or 'buffer'")
    if self.wire_dtype not in WIRE_DTYPES:
      raise ConfigError(f"weights.wire_dtype={self.wire_dtype!r}; expected one of {WIRE_DTYPES}")
    if not 0 <= self.port <= 65535:
      raise ConfigError(f"weights.port={self.port} is not a TCP port (0 = any free port)")
    for k in ("bulk_port", "relay_bulk_port"):
      if not 0 <= getattr(self, k) <= 65535:
        raise ConfigError(f"weights.{k}={getattr(self, k)} is not a TCP port (0 = any free port)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Tls(Section):
  """TLS on every gRPC channel (buffer, learner weight sources, all clients; protocol/rpc.py TLS,
  docs/ROLLOUT.md "TLS"). All empty = plaintext (the bearer token is checked either way)."""
  PATH: ClassVar[str] = "tls"
  cert: str = ""            # PEM certificate chain of this run's servers (and clients with mutual)
  key: str = ""             # PEM private key of tls.cert
  ca: str = ""              # PEM CA that clients verify servers with ("" = system roots)
  mutual: bool = False      # servers also require client certificates signed by tls.ca (mTLS)
  server_name: str = ""     # name clients check in server certificates ("" = the dialed host)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Eval(Section):
  """Held-out evaluation."""
  PATH: ClassVar[str] = "eval"
  every_steps: int = 100
  # num_prompts: held-out prompts per evaluation (a seeded subset of the held-out split, whose size
  # is data.heldout: 1000 at paper scale); 0 = the whole split. samples_per_prompt: mean@n's n.
  num_prompts: int = 0
  samples_per_prompt: int = 16
  # mode (docs/ROLLOUT.md "Evaluation through the fleet"): "fleet" = held-out prompts go to the
  # generators through the buffer's evaluation lane, pinned to the evaluated version, ahead of
  # training leases (the learner gathers rewards, never parameters, and allocates no KV cache);
  # "local" = learner process 0 samples them itself (gathers the params, one-device JAX sampler).
  mode: str = "fleet"
  timeout_s: float = 1800.0  # fleet: an evaluation not complete this long after submission is dropped
  temperature: float = 1.0   # evaluation sampling temperature (training uses generator.temperature)
  top_p: float = 1.0         # evaluation nucleus; generator.top_p < 1 is refused (biased IS ratios)

  def check(self):
    if not (0.0 < self.top_p <= 1.0 and self.temperature > 0):
      raise ConfigError(f"eval.top_p must be in (0, 1] and eval.temperature > 0, got "
                        f"{self.top_p} / {self.temperature}")
    if self.every_steps < 1:
      raise ConfigError(f"eval.every_steps must be >= 1, got {self.every_steps}")
    if self.mode not in ("fleet", "local"):
      raise ConfigError(f"eval.mode={self.mode!r}; expected 'fleet' (the generators evaluate, "
                        f"through the buffer's evaluation lane) or 'local' (learner process 0 "
                        f"samples)")
    if self.samples_per_prompt < 1:
      raise ConfigError(f"eval.samples_per_prompt must be >= 1 (mean@n needs n >= 1 samples per "
                        f"prompt), got {self.samples_per_prompt}")
    if self.num_prompts < 0:
      raise ConfigError(f"eval.num_prompts must be >= 0 (0 = the whole held-out split), got "
                        f"{self.num_prompts}")
    if not self.timeout_s > 0:
      raise ConfigError(f"eval.timeout_s must be > 0, got {self.timeout_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Checkpoint(Section):
  PATH: ClassVar[str] = "checkpoint"
  every_steps: int = 50
  keep: int = 3
  async_save: bool = True        # the learner keeps stepping while orbax writes; manifest after
  verify: str = "metadata"       # resume check: commit marker + object checksums | "full" re-read
  termination_grace_s: float = 120.0   # learner pod's terminationGracePeriodSeconds; a SIGTERM'd learner saves only if this allows

  def check(self):
    if self.verify not in VERIFY_MODES:
      raise ConfigError(f"checkpoint.verify must be one of {VERIFY_MODES}, got {self.verify!r}")
    if not self.termination_grace_s > 0:
      raise ConfigError(f"checkpoint.termination_grace_s must be > 0, got {self.termination_grace_s}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Audit(Section):
  """Audit trail for fault-injection runs (harness/chaos.py, tools/audit.py): trained_ids writes
  WORKDIR/trained_ids.jsonl (the rollout ids of each step, truncated on resume like metrics);
  wal_archive makes the buffer move compacted WAL segments to WAL_DIR/archive/ instead of
  deleting them, so every acknowledged rollout stays on disk."""
  PATH: ClassVar[str] = "audit"
  trained_ids: bool = False
  wal_archive: bool = False
