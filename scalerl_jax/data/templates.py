"""Prompt and answer formats for reasoning RL on HF chat datasets (config.data.template).

A template names everything between a dataset problem and the verifier's verdict:
  - the chat template: always the tokenizer's own `chat_template` (tokenizer_config.json);
  - an answer instruction appended to the user message, per reward (math: `\\boxed{}`, code: a
    ```python block); none for `bare`;
  - a think prefix pre-filled at the start of the assistant turn (prompt tokens, never policy
    tokens), unless the chat template's generation prompt already ends with it (R1-distill /
    Qwen3-style templates add `<think>` themselves);
  - `require_think_close`: whether the verifier grades only the text after the last `</think>`
    and gives 0 without one (the paper's contract), or, when False, grades the whole completion
    when it holds no `</think>`.

  bare                the chat template alone; `</think>` required. The historical behaviour and
                      the default: right for a policy SFT'd to think in <think>...</think>.
  reasoning_instruct  `<think>\\n` pre-filled, the instruction asks to close the reasoning with
                      `</think>` and to box the answer / write a code block; `</think>` required.
                      For an instruct model (Llama-3.1-8B-Instruct style) that was never SFT'd on
                      the think format; keeps the paper's verifier and length-control contract.
  instruct            the answer instruction only (no thinking asked for); `</think>` not required.

    render("reasoning_instruct", hf_tok, "What is 2 + 3?", reward="math")
    -> "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\\n\\nWhat is 2 + 3?\\n\\n"
       "...within \\\\boxed{}.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\\n\\n<think>\\n"

docs/DATA.md "Prompt templates" says which one the paper's 8B used (the paper is silent) and why.
"""
from __future__ import annotations

import dataclasses

from scalerl_jax.registry import Registry
from scalerl_jax.config import Task

DEFAULT = "bare"
END_THINK = "</think>"

_THINK_THEN = "Think step by step, then close your reasoning with </think> and "
MATH_BOXED = "put your final answer within \\boxed{}."
CODE_BLOCK = "give your final solution as one complete Python program in a ```python code block."


@dataclasses.dataclass(frozen=True)
class Template:
  """One prompt/answer format; see the module docstring."""
  name: str
  description: str
  think_prefix: str = ""                       # pre-filled at the start of the assistant turn
  instructions: tuple[tuple[str, str], ...] = ()   # (reward name, text appended to the user turn)
  require_think_close: bool = True
  system_prompt: str = ""                      # used when config.data.system_prompt is ""

  def instruction(self, reward: str) -> str:
    """The answer instruction for a task graded by `reward` ("" when none)."""
    return dict(self.instructions).get(reward, "")

  @property
  def asks_to_think(self) -> bool:
    return bool(self.think_prefix) or any(END_THINK in t for _, t in self.instructions)

  def render(self, hf_tok, problem: str, reward: str,
             system_prompt: str = Task.system_prompt) -> str:
    """The prompt text: [system], user turn (problem + instruction), generation prompt, think
    prefix. `hf_tok` is a transformers tokenizer with a `chat_template`."""
    instr = self.instruction(reward)
    content = f"{problem}\n\n{instr}" if instr else problem
    messages = [{"role": "user", "content": content}]
    system = system_prompt or self.system_prompt
    if system:
      messages.insert(0, {"role": "system", "content": system})
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prefix = self.think_prefix
    if prefix and text.rstrip().endswith(prefix.strip()):   # the chat template already opens it
      prefix = ""
    return text + prefix


TEMPLATES: Registry[Template] = Registry("prompt template")


def register(t: Template) -> Template:
  """Adds a template to the registry (config.data.template names it)."""
  TEMPLATES.register(t.name)(t)
  return t


register(Template(
    "bare", "the chat template alone; the verifier requires `</think>`"))
register(Template(
    "reasoning_instruct",
    "`<think>\\n` pre-filled; the user turn asks to close the reasoning with `</think>` and to box "
    "the answer (math) or write a ```python block (code); the verifier requires `</think>`",
    think_prefix="<think>\n",
    instructions=(("math", _THINK_THEN + MATH_BOXED), ("code", _THINK_THEN + CODE_BLOCK))))
register(Template(
    "instruct",
    "the user turn asks to box the answer (math) or write a ```python block (code); no thinking "
    "asked for; without `</think>` the verifier grades the whole completion",
    instructions=(("math", "Please reason step by step, and " + MATH_BOXED),
                  ("code", "Reason step by step, then " + CODE_BLOCK)),
    require_think_close=False))


def get(name: str) -> Template:
  """The template registered as `name`; ValueError listing the registered ones otherwise."""
  return TEMPLATES.get(name or DEFAULT)


def names() -> tuple[str, ...]:
  return TEMPLATES.names()


def render(name: str, hf_tok, problem: str, reward: str,
           system_prompt: str = Task.system_prompt) -> str:
  """`get(name).render(...)`: the prompt text of one problem."""
  return get(name).render(hf_tok, problem, reward, system_prompt)


__all__ = ["Template", "TEMPLATES", "DEFAULT", "register", "get", "names", "render"]
