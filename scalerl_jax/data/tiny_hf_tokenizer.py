"""Builds a tiny Hugging Face tokenizer (word-level, with a chat template) on disk, offline.

For tests and demos that need `AutoTokenizer.from_pretrained(path)` without downloading anything:

  path = write_tiny_tokenizer("/tmp/tok", extra_text=["what is 1 + 1 ?"])
"""
from __future__ import annotations

import os
from typing import Sequence

SPECIALS = ["<pad>", "<unk>", "<s>", "</s>", "<think>", "</think>", "<|user|>", "<|assistant|>",
            "<|system|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> <think>{% endif %}")
BASE_TEXT = [
    "Okay, time is up. Let me stop thinking and formulate a final answer now.",
    "the answer is \\boxed { } $ x + - * / = ^ ( ) 0 1 2 3 4 5 6 7 8 9 . , ? :",
    "what is compute find solve print input def return python",
]


def write_tiny_tokenizer(path: str, extra_text: Sequence[str] = ()) -> str:
  """Trains a WordLevel tokenizer on `BASE_TEXT + extra_text` and saves it with `save_pretrained`."""
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
  from transformers import PreTrainedTokenizerFast
  tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins words with spaces
  tok.train_from_iterator(list(BASE_TEXT) + list(extra_text),
                          trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1))
  fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                 pad_token="<pad>", unk_token="<unk>",
                                 additional_special_tokens=["<think>", "</think>"])
  fast.chat_template = CHAT_TEMPLATE
  os.makedirs(path, exist_ok=True)
  fast.save_pretrained(path)
  return path
