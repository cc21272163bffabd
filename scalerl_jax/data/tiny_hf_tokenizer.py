"""Builds tiny Hugging Face tokenizers (with a chat template) on disk, offline.

For tests and demos that need `AutoTokenizer.from_pretrained(path)` without downloading anything:

  path = write_tiny_tokenizer("/tmp/tok", extra_text=["what is 1 + 1 ?"])   # word-level, <think>
  path = write_llama3_style_tokenizer("/tmp/l3", vocab_size=512)   # byte-level BPE, Llama-3
      # special tokens and chat template, eos <|eot_id|> (an instruct model's layout)
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, \
    trainers
from transformers import PreTrainedTokenizerFast

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


# ---- Llama-3-style tokenizer ---------------------------------------------------------------------

# Llama-3.1's named special tokens, in its id order from the first special id (128000 there);
# the rest of the special block is <|reserved_special_token_K|> (K from 3, as in Llama-3.1).
LLAMA3_NAMED_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>")
# Meta-Llama-3-8B-Instruct's chat template (tokenizer_config.json), verbatim.
LLAMA3_CHAT_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Llama-3's pre-tokenizer split (tiktoken cl100k-style: digits in groups of up to three).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_CORPUS = BASE_TEXT + [
    "system user assistant You are a helpful assistant.",
    "What is 12 + 7? What is 3 * 4? What is 20 - 5? Compute the value of the expression.",
    "Think step by step, then close your reasoning with </think> and put your final answer "
    "within \\boxed{}.",
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "give your final solution as one complete Python program in a ```python code block.",
    "<think>\nI compute the expression step by step. It equals 19.\n</think>\n\n"
    "The answer is \\boxed{19}.",
    "Computing the expression gives 12, so the answer is \\boxed{12}. The answer is 15.",
    "```python\nimport sys\ndef main():\n    a, b = map(int, input().split())\n    print(a + b)\n"
    "main()\n```",
    "def add(a, b):\n    return a + b\nclass Solution:\n    def solve(self, n):\n        return n\n",
    "Let x be a real number such that x^2 + 2x + 1 = 0. Find the sum of all possible values.",
    "The quick brown fox jumps over the lazy dog. Okay, so the problem asks for the number of ways.",
]


def write_llama3_style_tokenizer(path: str, vocab_size: int = 512, num_special: int | None = None,
                                 extra_text: Sequence[str] = ()) -> str:
  """Writes a small tokenizer laid out like Llama-3(.1)-Instruct's into `path`, offline, built
  with the `tokenizers` library: byte-level BPE on LLAMA3_CORPUS + `extra_text` (Llama-3's split
  regex, so any text encodes), then a block of `num_special` special tokens at the END of the
  vocabulary (default min(256, vocab_size // 8); Llama-3 has 256 from id 128000) starting with
  LLAMA3_NAMED_SPECIALS (<|begin_of_text|>, ..., <|start_header_id|>, <|end_header_id|>, <|eom_id|>,
  <|eot_id|>, ...) and filled with <|reserved_special_token_K|>. Exactly `vocab_size` ids: when
  the corpus yields fewer merges, unreachable filler tokens pad the regular part.

  Files as in a Llama-3.1-8B-Instruct checkpoint: tokenizer.json; tokenizer_config.json with the
  Llama-3 `chat_template` inline, bos <|begin_of_text|>, eos <|eot_id|>, no pad token, the
  `added_tokens_decoder`; special_tokens_map.json. Returns `path`."""
  n_special = min(256, vocab_size // 8) if num_special is None else int(num_special)
  if n_special < len(LLAMA3_NAMED_SPECIALS):
    raise ValueError(f"num_special={n_special} < the {len(LLAMA3_NAMED_SPECIALS)} named specials")
  n_regular = vocab_size - n_special
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if n_regular < len(alphabet):
    raise ValueError(f"vocab_size={vocab_size} leaves {n_regular} regular ids; byte-level BPE "
                     f"needs at least {len(alphabet)} (+ {n_special} specials)")
  pre = pre_tokenizers.Sequence([
      pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
      pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre
  tok.train_from_iterator(list(LLAMA3_CORPUS) + list(extra_text), trainers.BpeTrainer(
      vocab_size=n_regular, initial_alphabet=alphabet, show_progress=False, special_tokens=[]))
  model = json.loads(tok.to_str())["model"]
  vocab, merges = dict(model["vocab"]), [tuple(m) if isinstance(m, list) else tuple(m.split(" "))
                                         for m in model["merges"]]
  k = 0
  while len(vocab) < n_regular:          # unreachable fillers: no merge ever produces them
    vocab[f"<|filler_{k}|>"] = len(vocab)
    k += 1
  tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
  tok.pre_tokenizer = pre
  tok.decoder = decoders.ByteLevel()
  names = list(LLAMA3_NAMED_SPECIALS) + [f"<|reserved_special_token_{i}|>"
                                         for i in range(3, 3 + n_special - len(LLAMA3_NAMED_SPECIALS))]
  tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in names])
  bos = n_regular
  tok.post_processor = processors.Sequence([
      processors.ByteLevel(trim_offsets=False),
      processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                    pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                                    special_tokens=[("<|begin_of_text|>", bos)])])
  assert tok.get_vocab_size() == vocab_size and tok.token_to_id("<|begin_of_text|>") == bos
  os.makedirs(path, exist_ok=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  added = {str(n_regular + i): {"content": t, "lstrip": False, "normalized": False,
                                "rstrip": False, "single_word": False, "special": True}
           for i, t in enumerate(names)}
  config = {"added_tokens_decoder": added, "bos_token": "<|begin_of_text|>",
            "chat_template": LLAMA3_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
            "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"],
            "model_max_length": 131072, "tokenizer_class": "PreTrainedTokenizerFast"}
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(config, f, indent=2)
  with open(os.path.join(path, "special_tokens_map.json"), "w") as f:
    json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, f, indent=2)
  return path
