"""Prompt sets for RL: `build_dataset(config.data, max_prompt_len)` -> `Dataset`.

  kind=synthetic  the built-in running-digit-sum task (scalerl_jax.data.synthetic), no files
  kind=tiny_code  the built-in tiny code task (scalerl_jax.data.tiny_code): programs run sandboxed
  kind=polaris    Polaris-53K-style math JSONL/Parquet (`problem`, `answer`) + local HF tokenizer
  kind=deepcoder  DeepCoder-style code JSONL/Parquet (`problem`, `tests`) + local HF tokenizer
  mixture         config.data.mixture="math:0.5,code:0.5" over the sections of config.data.tasks
                  (scalerl_jax/data/mixture.py): one Dataset, every prompt tagged with its task

HF chat datasets (polaris, deepcoder) render each problem with the prompt template
config.data.template (scalerl_jax/data/templates.py: bare | reasoning_instruct | instruct), which
also says whether the verifier requires a closed `</think>`; the built-in tasks have their own fixed
format (template bare). Every config.data key is declared in scalerl_jax/config/ base_config
(one-line comments there). See docs/DATA.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from scalerl_jax import rewards
from scalerl_jax.data import hf_tokenizer
from scalerl_jax.data import loaders
from scalerl_jax.data import synthetic
from scalerl_jax.data import tiny_code
from scalerl_jax.data import mixture
from scalerl_jax.data import templates
from scalerl_jax.types import PromptSpec

KINDS = ("synthetic", "tiny_code", "polaris", "deepcoder")
REWARD_FOR_KIND = {"synthetic": "synthetic", "tiny_code": "tiny_code", "polaris": "math",
                   "deepcoder": "code"}
MIXTURE = "mixture"


@dataclasses.dataclass
class Dataset:
  """Train and held-out prompts plus everything needed to sample and score them.

  `task_rewards` maps each task name to its reward ({"": reward_name} for a one-task dataset);
  `PromptSpec.task` of every prompt is one of its keys and `task_of(prompt_id)` recovers it from
  an id alone (mixture id ranges), which is how generators grade leased prompts.
  `task_templates` maps each task name to its prompt template's name (data/templates.py), whose
  `require_think_close` the grading follows."""
  kind: str
  train: list[PromptSpec]
  heldout: list[PromptSpec]
  tokenizer: Any                  # .encode(text) -> list[int], .decode(ids) -> str, .eos_id, .pad_id
  reward_name: str                # key in scalerl_jax.rewards ("mixture": see task_rewards)
  stop_tokens: tuple[int, ...]
  think_end_tokens: tuple[int, ...]
  stats: dict
  # (n, seed, step_noise) -> (tokens [n,T], loss_mask [n,T]); step_noise None = the default
  sft: Callable[..., tuple] | None = None
  task_rewards: dict = dataclasses.field(default_factory=dict)
  task_templates: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if not self.task_rewards:
      self.task_rewards = {"": self.reward_name}
    for t in self.task_rewards:
      self.task_templates.setdefault(t, templates.DEFAULT)

  def template(self, task: str = "") -> templates.Template:
    """The prompt template of `task` (data/templates.py)."""
    return templates.get(self.task_templates[task])

  @property
  def tasks(self) -> tuple[str, ...]:
    """Task names in mixture order (("",) for a one-task dataset)."""
    return tuple(self.task_rewards)

  @property
  def is_mixture(self) -> bool:
    return self.kind == MIXTURE

  @property
  def needs_sandbox(self) -> bool:
    """True when some task's reward runs model-written programs (rewards.is_sandboxed)."""
    return any(rewards.is_sandboxed(r) for r in self.task_rewards.values())

  def task_of(self, prompt_id: int) -> str:
    """The task of a prompt id (mixture id ranges; "" for a one-task dataset)."""
    if not self.is_mixture:
      return ""
    i = int(prompt_id) // mixture.TASK_ID_STRIDE
    if not 0 <= i < len(self.task_rewards):
      raise ValueError(f"prompt id {prompt_id} is outside every task's id range")
    return self.tasks[i]

  def sft_batch(self, n: int, seed: int = 0, step_noise: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """SFT traces for the warm start: (tokens int32 [n,T], loss_mask bool [n,T])."""
    if self.sft is None:
      raise ValueError(f"dataset kind {self.kind!r} ships no SFT traces; start RL from an SFT "
                       "checkpoint (config.model.hf_checkpoint)")
    return self.sft(n, seed, step_noise)

  def interruption_tokens(self, text: str) -> tuple[int, ...]:
    """Token ids of the forced-interruption phrase (config.rollout.interruption_text)."""
    return tuple(self.tokenizer.encode(text))

  def _text(self, completion_tokens_or_text) -> str:
    return (completion_tokens_or_text if isinstance(completion_tokens_or_text, str)
            else self.tokenizer.decode(completion_tokens_or_text))

  def grade(self, completion_tokens_or_text, answer: str, task: str = "") -> rewards.Grade:
    """Grades one completion with its task's reward: Grade(reward, reason, sandboxed, ...)."""
    if task not in self.task_rewards:
      raise ValueError(f"unknown task {task!r}; this dataset's tasks are {list(self.tasks)}")
    return rewards.grade(self.task_rewards[task], self._text(completion_tokens_or_text), answer,
                         require_think_close=self.template(task).require_think_close)

  def reward(self, completion_tokens_or_text, answer: str, task: str = "") -> float:
    """Scores one completion (token ids are decoded with this dataset's tokenizer)."""
    if task not in self.task_rewards:
      raise ValueError(f"unknown task {task!r}; this dataset's tasks are {list(self.tasks)}")
    return rewards.compute_reward(self.task_rewards[task], self._text(completion_tokens_or_text),
                                  answer, require_think_close=self.template(task).require_think_close)


def build_dataset(data_cfg, max_prompt_len: int) -> Dataset:
  """Builds the dataset of a run config's `data` section: the mixture `data_cfg.mixture` over
  `data_cfg.tasks` when set, else the one task named by `data_cfg.kind` (synthetic | tiny_code |
  polaris | deepcoder). `data_cfg`: the typed section (scalerl_jax.config.Data; a ConfigDict data
  section works too: data.export, launch/)."""
  mix = mixture.parse_mixture(data_cfg)
  if not mix:
    return _build_task(data_cfg, max_prompt_len)
  names = [n for n, _ in mix]
  parts = []
  for name in names:
    try:
      parts.append(_build_task(data_cfg.tasks[name], max_prompt_len))
    except (ValueError, FileNotFoundError) as e:   # name the task section in the message
      try:
        err = type(e)(f"data.tasks.{name}: {e}")
      except TypeError:                               # an exception type with other arguments
        err = ValueError(f"data.tasks.{name}: {e}")
      raise err from None
  tok = mixture.shared_tokenizer(names, [d.tokenizer for d in parts])
  seed = int(data_cfg.split_seed)
  keep = mixture.trimmed_counts([len(d.train) for d in parts], [s for _, s in mix])
  train, held = [], []
  stats: dict[str, Any] = {"tasks": {}}
  for i, ((name, share), d, n) in enumerate(zip(mix, parts, keep)):
    train += mixture.relabel(mixture.trim(d.train, n, seed), i, name)
    held += mixture.relabel(d.heldout, i, name)
    stats["tasks"][name] = dict(d.stats, kind=d.kind, reward=d.reward_name, share=share,
                                train=n, trimmed=len(d.train) - n)
  stats.update(train=len(train), heldout=len(held))
  if any(d.sft is not None for d in parts):
    sft = _mixture_sft(mix, parts, tok.pad_id)
  else:
    sft = None
  return Dataset(MIXTURE, train, held, tok, MIXTURE, tuple(parts[0].stop_tokens),
                 tuple(parts[0].think_end_tokens), stats, sft,
                 task_rewards={name: d.reward_name for name, d in zip(names, parts)},
                 task_templates={name: d.task_templates[""] for name, d in zip(names, parts)})


def _mixture_sft(mix, parts, pad_id: int):
  """SFT traces of a mixture: each task's share of `n`, padded to one length, shuffled."""
  def sft(n, seed, step_noise=None) -> tuple[np.ndarray, np.ndarray]:
    toks, masks = [], []
    for (name, share), d in zip(mix, parts):
      if d.sft is None:
        raise ValueError(f"task {name!r} ({d.kind}) ships no SFT traces; start from an SFT "
                         "checkpoint (config.model.hf_checkpoint)")
      t, m = d.sft(max(1, int(round(n * share))), seed, step_noise)
      toks.append(t)
      masks.append(m)
    T = max(t.shape[1] for t in toks)
    tokens = np.concatenate([np.pad(t, ((0, 0), (0, T - t.shape[1])), constant_values=pad_id)
                             for t in toks])
    mask = np.concatenate([np.pad(m, ((0, 0), (0, T - m.shape[1]))) for m in masks])
    order = np.random.default_rng([seed, 0x5F7, 7]).permutation(len(tokens))
    return tokens[order], mask[order]
  return sft


def check_answers(kind: str, reward: str, prompts: list[PromptSpec]) -> None:
  """Start-up check of a sandboxed reward's answers: each must be valid test JSON."""
  if not rewards.is_sandboxed(reward):
    return
  for p in prompts:
    try:
      rewards.parse_tests(p.answer)
    except ValueError as e:
      raise ValueError(f"{kind} prompt {p.prompt_id}: the answer is not valid test JSON ({e})") \
          from None


def reward_for(data_cfg) -> str:
  """The reward of a data section: `reward` when set (a registered name), else its kind's."""
  kind = data_cfg.kind
  if kind not in KINDS:
    raise ValueError(f"config.data.kind={kind!r}; expected one of {KINDS}")
  name = str(data_cfg.reward or REWARD_FOR_KIND[kind])
  if name not in rewards.names():
    raise ValueError(f"config.data.reward={name!r}; registered rewards: {list(rewards.names())}")
  return name


def _build_task(data_cfg, max_prompt_len: int) -> Dataset:
  """One task's dataset from a data section (config.data, or one of config.data.tasks)."""
  kind = data_cfg.kind
  reward = reward_for(data_cfg)
  heldout = int(data_cfg.heldout)
  seed = int(data_cfg.split_seed)
  template = check_template(kind, data_cfg.template)
  if kind in ("synthetic", "tiny_code"):
    return _build_builtin(kind, data_cfg, max_prompt_len, heldout, seed, reward)
  path = data_cfg.path
  if not path:
    raise ValueError(f"config.data.path is empty (kind={kind} needs a JSONL or Parquet file)")
  tok = hf_tokenizer.HFTokenizer(data_cfg.tokenizer_path,
                                 system_prompt=data_cfg.system_prompt, template=template,
                                 reward=reward)
  counts = {}
  if kind == "polaris":
    records = loaders.load_math(path)
  else:
    records, _ = loaders.load_code(path, skip_unsupported=True, skip_malformed=True,
                                   counts=counts)
  if kind == "deepcoder" and not records:
    raise loaders.DataError(f"{path}: every record was skipped ({counts}); nothing to train on")
  train, held, stats = loaders.split_prompts(records, tok.encode_prompt, max_prompt_len, heldout, seed)
  stats.unsupported = counts.get("unsupported", 0)
  stats.malformed = counts.get("malformed", 0)
  stats.records += stats.unsupported + stats.malformed
  check_answers(kind, reward, train + held)
  return Dataset(kind, train, held, tok, reward, tok.stop_ids, tok.think_end_ids,
                 dataclasses.asdict(stats), task_templates={"": template})


def check_template(kind: str, name: str) -> str:
  """The prompt template name of a data section (config.data.template), checked: a registered
  one, and `bare` for the built-in tasks (their prompts have a fixed format). ValueError otherwise."""
  name = name or templates.DEFAULT
  if name not in templates.TEMPLATES:
    raise ValueError(f"config.data.template={name!r}; registered prompt templates: "
                     f"{list(templates.names())} (docs/DATA.md \"Prompt templates\")")
  if kind in ("synthetic", "tiny_code") and name != templates.DEFAULT:
    raise ValueError(f"config.data.template={name!r}: the built-in task {kind!r} has a fixed "
                     f"prompt format; templates apply to HF chat datasets (polaris, deepcoder)")
  return name


def _build_builtin(kind, data_cfg, max_prompt_len, heldout, seed, reward) -> Dataset:
  """The generated tasks (no files): the digit-sum task or the tiny code task."""
  mod = synthetic if kind == "synthetic" else tiny_code
  num_terms, n_train = int(data_cfg.synthetic_num_terms), int(data_cfg.synthetic_n_train)
  most = int(data_cfg.synthetic_num_terms_max)
  train: list                # one task module's Problems (the two modules have the same functions)
  if most:                   # a digit count per problem in [num_terms, most]
    if kind != "synthetic" or most < num_terms:
      raise ValueError(f"data.synthetic_num_terms_max={most}: the synthetic task only (kind "
                       f"{kind!r}), and at least data.synthetic_num_terms={num_terms} (0 = off)")
    width = most if bool(data_cfg.synthetic_fixed_width) else 0
    train, held = synthetic.make_split(seed, n_train, heldout, (num_terms, most), width)
  elif bool(data_cfg.synthetic_fixed_width):
    raise ValueError("data.synthetic_fixed_width pads problems to data.synthetic_num_terms_max "
                     "digit slots: set that too (the synthetic task)")
  else:
    train, held = mod.make_split(seed, n_train, heldout, num_terms)
  specs = [p.to_prompt_spec() for p in train], [p.to_prompt_spec() for p in held]
  longest = max(len(s.tokens) for s in specs[0] + specs[1])
  if longest > max_prompt_len:
    raise ValueError(f"{kind} prompts are up to {longest} tokens > max_prompt_len={max_prompt_len}")
  tok = mod.TOKENIZER
  noise = float(data_cfg.synthetic_step_noise)

  def sft(n, sft_seed, step_noise=None) -> tuple[np.ndarray, np.ndarray]:
    if n > len(train):
      raise ValueError(f"asked for {n} SFT traces but the train split has {len(train)} prompts")
    q = noise if step_noise is None else step_noise
    return synthetic.pad_batch(mod.sft_examples(train[:n], sft_seed, q))

  check_answers(kind, reward, specs[0] + specs[1])
  return Dataset(kind, specs[0], specs[1], tok, reward, (tok.eos_id,),
                 (tok.end_think_id,), {"train": len(specs[0]), "heldout": len(specs[1])}, sft)


def stats_metrics(dataset: Dataset) -> dict:
  """The dataset's numeric stats as flat metric keys (`data/<key>`, mixture:
  `data/<task>/<key>`), e.g. data/code/malformed: prompts skipped for a malformed test case."""
  out = {}
  for k, v in dataset.stats.items():
    if k == "tasks":
      for name, st in v.items():
        out.update({f"data/{name}/{kk}": vv for kk, vv in st.items()
                    if isinstance(vv, (int, float)) and not isinstance(vv, bool)})
    elif isinstance(v, (int, float)) and not isinstance(v, bool):
      out[f"data/{k}"] = v
  return out


__all__ = ["Dataset", "build_dataset", "stats_metrics", "check_answers", "check_template", "KINDS",
           "REWARD_FOR_KIND", "MIXTURE", "reward_for"]
