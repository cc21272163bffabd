"""Local Hugging Face tokenizer + chat template, behind the small interface the data code uses.

Never downloads: `AutoTokenizer.from_pretrained(path, local_files_only=True)` on a local directory.
"""
from __future__ import annotations

import os
from typing import Iterable


class HFTokenizer:
  """Wraps a local HF tokenizer: `encode/decode`, ids of eos/pad/</think>, chat-templated prompts."""

  def __init__(self, path: str, system_prompt: str = ""):
    if not path:
      raise ValueError("config.data.tokenizer_path is empty: give a local tokenizer directory")
    if not os.path.isdir(path):
      raise FileNotFoundError(f"tokenizer directory {path!r} does not exist")
    from transformers import AutoTokenizer
    self.path = path
    self.system_prompt = system_prompt
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
    """The chat-templated prompt (user turn + generation prompt) as text."""
    messages = [{"role": "user", "content": problem}]
    if self.system_prompt:
      messages.insert(0, {"role": "system", "content": self.system_prompt})
    return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

  def encode_prompt(self, problem: str) -> list[int]:
    """Token ids of the chat-templated prompt (the template supplies bos etc.)."""
    return self.encode(self.prompt_text(problem))

  @property
  def think_end_ids(self) -> tuple[int, ...]:
    return tuple(self.encode("</think>"))
