"""Task mixtures: several tasks, each with its own loader, reward and share of the train prompts.

Config (declared in scalerl_jax/config/ base_config; docs/DATA.md "Mixtures"):
  config.data.tasks     ConfigDict of named task sections, each a full data section
                        (scalerl_jax.config.task_section(kind, ...): kind, path, heldout, ...)
  config.data.mixture   "name:share,name:share" over those names (shares > 0, summing to 1);
                        "" = no mixture: config.data itself is the one task

Every prompt carries its task: task i of the mixture owns the prompt ids
[i * TASK_ID_STRIDE, (i + 1) * TASK_ID_STRIDE) (its own ids shifted), so any process holding the
dataset (generators, learner) maps a leased or trained prompt id back to its task and reward with
no change to the buffer protocol. Shares: the train split of each task is trimmed (a `split_seed`
permutation) so task counts are in the ratio of the shares, and the buffer's uniform epoch shuffle
then leases task i with probability share_i. Held-out sets stay per task, untrimmed.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

TASK_ID_STRIDE = 1 << 32        # task i's prompt ids: i * TASK_ID_STRIDE + the task's own id
SHARE_TOLERANCE = 1e-6


def parse_mixture(data_cfg) -> list[tuple[str, float]]:
  """[(task name, share), ...] of `data_cfg.mixture` ([] when unset); raises ValueError with one
  clear line for a malformed string, an unknown task, a non-positive share or shares not summing
  to 1."""
  text = str(data_cfg.mixture or "").strip()
  if not text:
    return []
  declared = sorted(data_cfg.tasks.keys())
  out, seen = [], set()
  for part in text.split(","):
    name, sep, share = part.strip().partition(":")
    name = name.strip()
    if not sep or not name:
      raise ValueError(f"data.mixture={text!r}: expected 'task:share,task:share' "
                       f"(e.g. 'math:0.5,code:0.5'), got {part.strip()!r}")
    try:
      value = float(share)
    except ValueError:
      raise ValueError(f"data.mixture={text!r}: share {share.strip()!r} of task {name!r} is not a "
                       "number") from None
    if name not in declared:
      raise ValueError(f"data.mixture names unknown task {name!r}; config.data.tasks declares "
                       f"{declared}")
    if name in seen:
      raise ValueError(f"data.mixture={text!r} names task {name!r} twice")
    if not value > 0:
      raise ValueError(f"data.mixture={text!r}: share of {name!r} must be > 0, got {value}")
    seen.add(name)
    out.append((name, value))
  total = sum(s for _, s in out)
  if abs(total - 1.0) > SHARE_TOLERANCE:
    raise ValueError(f"data.mixture={text!r}: shares sum to {total:.6g}, not 1")
  return out


def trimmed_counts(train_sizes: list[int], shares: list[float]) -> list[int]:
  """Train prompts kept per task so counts are in the ratio of the shares (the task that runs out
  first keeps all of its prompts; the others are trimmed)."""
  total = min(n / s for n, s in zip(train_sizes, shares))
  return [min(n, int(np.floor(total * s + 1e-9))) for n, s in zip(train_sizes, shares)]


def trim(train: list, n: int, seed: int) -> list:
  """`n` prompts of `train` chosen by a seeded permutation, in their original order."""
  if n >= len(train):
    return list(train)
  keep = set(np.random.default_rng([seed, 0x3A1]).permutation(len(train))[:n].tolist())
  return [p for i, p in enumerate(train) if i in keep]


def relabel(prompts: list, index: int, task: str) -> list:
  """The prompts of task number `index` with their mixture ids and task name."""
  return [dataclasses.replace(p, prompt_id=index * TASK_ID_STRIDE + int(p.prompt_id), task=task)
          for p in prompts]


def shared_tokenizer(names: list[str], tokenizers: list) -> Any:
  """The one tokenizer a mixture samples with: word-level vocabularies must be prefixes of the
  widest one (equal ids for shared words); HF tokenizers must come from the same directory."""
  vocabs: list = [getattr(t, "vocab", None) for t in tokenizers]   # tuples (word-level) or None
  if all(isinstance(v, tuple) for v in vocabs):
    widest = max(range(len(vocabs)), key=lambda i: len(vocabs[i]))
    for n, v in zip(names, vocabs):
      if vocabs[widest][:len(v)] != v:
        raise ValueError(f"data.mixture: task {n!r}'s vocabulary is not a prefix of task "
                         f"{names[widest]!r}'s: one model needs one tokenizer")
    return tokenizers[widest]
  paths = [getattr(t, "path", None) for t in tokenizers]
  if any(isinstance(v, tuple) for v in vocabs) or len(set(paths)) != 1:
    raise ValueError(f"data.mixture: tasks {names} use different tokenizers "
                     f"({[p or 'word-level' for p in paths]}); one model needs one tokenizer "
                     "(set the same tokenizer_path in every task section)")
  return tokenizers[0]
