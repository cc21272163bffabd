"""Local Hugging Face tokenizer + chat template, behind the small interface the data code uses.

Never downloads: `AutoTokenizer.from_pretrained(path, local_files_only=True)` on a local directory.
Prompts are rendered by the prompt template `config.data.template` (scalerl_jax/data/templates.py):
the tokenizer's chat template plus the template's answer instruction and think prefix.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Iterable

from scalerl_jax.data import templates
from scalerl_jax.config import Task

# End-of-turn tokens a chat model stops at besides its eos token, when the vocabulary has them
# (Llama-3: <|eot_id|>; a Llama-3-Instruct tokenizer may name <|end_of_text|> as its eos).
END_OF_TURN = ("<|eot_id|>", "<|end_of_text|>", "<|im_end|>", "<|endoftext|>")


def checkpoint_eos_ids(path: str) -> tuple[int, ...]:
  """Every `eos_token_id` a checkpoint directory lists, config.json's first, then
  generation_config.json's (each an int or a list; Llama-3.1: <|end_of_text|>, <|eom_id|>,
  <|eot_id|>), without repeats; () when neither file names one."""
  out: list[int] = []
  for name in ("config.json", "generation_config.json"):
    f = os.path.join(path, name)
    if not os.path.exists(f):
      continue
    with open(f) as fh:
      d = json.load(fh)
    v = d.get("eos_token_id", d.get("text_config", {}).get("eos_token_id"))
    for i in (v if isinstance(v, (list, tuple)) else [v] if v is not None else []):
      if int(i) not in out:
        out.append(int(i))
  return tuple(out)


class HFTokenizer:
  """Wraps a local HF tokenizer: `encode/decode`, ids of eos/pad/</think>, chat-templated prompts.

  `template` names the prompt template (data/templates.py); `reward` the task's verifier, which
  picks the template's answer instruction (math: boxed answer, code: a code block)."""

  def __init__(self, path: str, system_prompt: str = Task.system_prompt, template: str = templates.DEFAULT,
               reward: str = "math"):
    if not path:
      raise ValueError("config.data.tokenizer_path is empty: give a local tokenizer directory")
    if not os.path.isdir(path):
      raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer  # local: pulls in torch (~2 CPU-s); every process imports data/
    self.path = path
    self.system_prompt = system_prompt
    self.template = templates.get(template)
    self.reward = reward
    self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    if not getattr(self.tok, "chat_template", None):
      raise ValueError(f"tokenizer at {path!r} has no chat_template (tokenizer_config.json)")
    if self.tok.eos_token_id is None:
      raise ValueError(f"tokenizer at {path!r} has no eos token")
    self.eos_id = int(self.tok.eos_token_id)
    self.pad_id = int(self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id)
    self.bos_id = None if self.tok.bos_token_id is None else int(self.tok.bos_token_id)

  @property
  def vocab_size(self) -> int:
    return len(self.tok)

  def encode(self, text: str) -> list[int]:
    """Plain encoding without added special tokens (for phrases such as the interruption text)."""
    return list(self.tok.encode(text, add_special_tokens=False))

  def decode(self, ids: Iterable[int]) -> str:
    return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)

  def prompt_text(self, problem: str) -> str:
    """The prompt as text: [system turn], user turn (problem + the template's answer
    instruction), generation prompt, the template's think prefix."""
    return self.template.render(self.tok, problem, self.reward, self.system_prompt)

  def encode_prompt(self, problem: str) -> list[int]:
    """Token ids of the chat-templated prompt (the template supplies bos etc.)."""
    return self.encode(self.prompt_text(problem))

  think_end_text = "</think>"   # the text that closes the thinking

  @property
  def think_end_ids(self) -> tuple[int, ...]:
    return tuple(self.encode(self.think_end_text))

  @functools.cached_property
  def vocab_texts(self) -> tuple[str, ...]:
    """decode([i]) of every id (special tokens kept, no clean-up): what the end-of-thinking rule
    reads (generation/interruption.py: `</think>` may take several tokens and merge with its
    neighbours, e.g. Llama-3's "</", "think", ">\n")."""
    return tuple(self.tok.batch_decode([[i] for i in range(len(self.tok))],
                                       skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))

  @property
  def stop_ids(self) -> tuple[int, ...]:
    """Generation stops at any of these: eos, every eos id the checkpoint's config.json and
    generation_config.json list in this directory (`checkpoint_eos_ids`; Llama-3.1's
    <|eom_id|> is one), and the end-of-turn tokens of END_OF_TURN that this vocabulary has as
    single special tokens (an instruct model ends its turn there)."""
    out = [self.eos_id]
    for i in checkpoint_eos_ids(self.path):
      if 0 <= i < len(self.tok) and i not in out:
        out.append(i)
    special = set(getattr(self.tok, "all_special_tokens", ()) or ())
    special |= {str(t) for t in (getattr(self.tok, "added_tokens_decoder", {}) or {}).values()}
    for t in END_OF_TURN:
      if t in special:
        i = self.tok.convert_tokens_to_ids(t)
        if isinstance(i, int) and i >= 0 and i not in out:
          out.append(int(i))
    return tuple(out)
