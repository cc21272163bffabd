"""Prompt sets for RL: `build_dataset(config.data, max_prompt_len)` -> `Dataset`.

  kind=synthetic  the built-in running-digit-sum task (scalerl_jax.data.synthetic), no files
  kind=polaris    Polaris-53K-style math JSONL/Parquet (`problem`, `answer`) + local HF tokenizer
  kind=deepcoder  DeepCoder-style code JSONL/Parquet (`problem`, `tests`) + local HF tokenizer

Every config.data key is declared in configs/common.py base_config (one-line comments there).
See docs/DATA.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from scalerl_jax import rewards
from scalerl_jax.data import hf_tokenizer
from scalerl_jax.data import loaders
from scalerl_jax.data import synthetic
from scalerl_jax.types import PromptSpec

KINDS = ("synthetic", "polaris", "deepcoder")
REWARD_FOR_KIND = {"synthetic": "synthetic", "polaris": "math", "deepcoder": "code"}


@dataclasses.dataclass
class Dataset:
  """Train and held-out prompts plus everything needed to sample and score them."""
  kind: str
  train: list[PromptSpec]
  heldout: list[PromptSpec]
  tokenizer: Any                  # .encode(text) -> list[int], .decode(ids) -> str, .eos_id, .pad_id
  reward_name: str                # key in scalerl_jax.rewards
  stop_tokens: tuple[int, ...]
  think_end_tokens: tuple[int, ...]
  stats: dict
  # (n, seed, step_noise) -> (tokens [n,T], loss_mask [n,T]); step_noise None = the default
  sft: Callable[..., tuple] | None = None

  def sft_batch(self, n: int, seed: int = 0, step_noise: float | None = None):
    """SFT traces for the warm start: (tokens int32 [n,T], loss_mask bool [n,T])."""
    if self.sft is None:
      raise ValueError(f"dataset kind {self.kind!r} ships no SFT traces; start RL from an SFT "
                       "checkpoint (config.model.hf_checkpoint)")
    return self.sft(n, seed, step_noise)

  def interruption_tokens(self, text: str) -> tuple[int, ...]:
    """Token ids of the forced-interruption phrase (config.rollout.interruption_text)."""
    return tuple(self.tokenizer.encode(text))

  def reward(self, completion_tokens_or_text, answer: str) -> float:
    """Scores one completion (token ids are decoded with this dataset's tokenizer)."""
    text = (completion_tokens_or_text if isinstance(completion_tokens_or_text, str)
            else self.tokenizer.decode(completion_tokens_or_text))
    return rewards.compute_reward(self.reward_name, text, answer)


def build_dataset(data_cfg, max_prompt_len: int) -> Dataset:
  """Builds the dataset named by `data_cfg.kind` (synthetic | polaris | deepcoder); `data_cfg` is
  a run config's `data` section (every key declared in configs/common.py base_config)."""
  kind = data_cfg.kind
  if kind not in KINDS:
    raise ValueError(f"config.data.kind={kind!r}; expected one of {KINDS}")
  heldout = int(data_cfg.heldout)
  seed = int(data_cfg.split_seed)
  if kind == "synthetic":
    num_terms = data_cfg.synthetic_num_terms
    train, held = synthetic.make_split(seed, int(data_cfg.synthetic_n_train),
                                       heldout, num_terms)
    specs = [p.to_prompt_spec() for p in train], [p.to_prompt_spec() for p in held]
    longest = max(len(s.tokens) for s in specs[0] + specs[1])
    if longest > max_prompt_len:
      raise ValueError(f"synthetic prompts are up to {longest} tokens > max_prompt_len={max_prompt_len}")
    tok = synthetic.TOKENIZER
    noise = float(data_cfg.synthetic_step_noise)

    def sft(n, sft_seed, step_noise=None):
      if n > len(train):
        raise ValueError(f"asked for {n} SFT traces but the train split has {len(train)} prompts")
      q = noise if step_noise is None else step_noise
      return synthetic.pad_batch(synthetic.sft_examples(train[:n], sft_seed, q))

    return Dataset(kind, specs[0], specs[1], tok, "synthetic", (tok.eos_id,), (tok.end_think_id,),
                   {"train": len(specs[0]), "heldout": len(specs[1])}, sft)

  path = data_cfg.path
  if not path:
    raise ValueError(f"config.data.path is empty (kind={kind} needs a JSONL or Parquet file)")
  tok = hf_tokenizer.HFTokenizer(data_cfg.tokenizer_path,
                                 system_prompt=data_cfg.system_prompt)
  if kind == "polaris":
    records, unsupported = loaders.load_math(path), 0
  else:
    records, unsupported = loaders.load_code(path, skip_unsupported=True)
  train, held, stats = loaders.split_prompts(records, tok.encode_prompt, max_prompt_len, heldout, seed)
  stats.unsupported = unsupported
  stats.records += unsupported
  return Dataset(kind, train, held, tok, REWARD_FOR_KIND[kind], (tok.eos_id,), tok.think_end_ids,
                 dataclasses.asdict(stats))


__all__ = ["Dataset", "build_dataset", "KINDS", "REWARD_FOR_KIND"]
