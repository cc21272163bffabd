"""Prompt templates (data.template), the verifiers with and without a required `</think>`, the
Llama-3-style test tokenizer, the scripted instruct model, the step-0 reward check (issue 24)."""
import json
import os

import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax import recipes, rewards
from scalerl_jax.data import build_dataset, templates
from scalerl_jax.data.hf_tokenizer import HFTokenizer
from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer, write_tiny_tokenizer
from scalerl_jax.generation.fake import ScriptedInstructModel, scripted_reply
from scalerl_jax.training.health import NoRewardSignal, step0_reward_check
from scalerl_jax.types import SamplingSpec

HEAD = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nWhat is 12 + 7?"
ASSISTANT = "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"


@pytest.fixture(scope="module")
def l3(tmp_path_factory):
  return write_llama3_style_tokenizer(str(tmp_path_factory.mktemp("l3")), vocab_size=512)


@pytest.fixture(scope="module")
def tiny_tok(tmp_path_factory):
  return write_tiny_tokenizer(str(tmp_path_factory.mktemp("tiny")))


def test_llama3_style_tokenizer_files_and_special_ids(l3):
  assert sorted(os.listdir(l3)) == ["special_tokens_map.json", "tokenizer.json",
                                    "tokenizer_config.json"]
  cfg = json.load(open(os.path.join(l3, "tokenizer_config.json")))
  assert cfg["bos_token"] == "<|begin_of_text|>" and cfg["eos_token"] == "<|eot_id|>"
  assert cfg["chat_template"].startswith("{% set loop_messages = messages %}")
  assert json.load(open(os.path.join(l3, "special_tokens_map.json"))) == {
      "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
  t = HFTokenizer(l3)
  ids = {s: t.tok.convert_tokens_to_ids(s) for s in
         ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
          "<|eot_id|>", "<|reserved_special_token_3|>", "<|reserved_special_token_55|>")}
  # 512 ids: 448 regular (256 bytes + merges), then 64 specials in Llama-3.1's order
  assert ids == {"<|begin_of_text|>": 448, "<|end_of_text|>": 449, "<|start_header_id|>": 454,
                 "<|end_header_id|>": 455, "<|eot_id|>": 457, "<|reserved_special_token_3|>": 459,
                 "<|reserved_special_token_55|>": 511}
  assert t.vocab_size == 512 and (t.bos_id, t.eos_id, t.pad_id) == (448, 457, 457)
  assert t.stop_ids == (457, 449)           # an instruct model ends its turn at <|eot_id|>
  text = "x = 1234\n```python\nprint('é')\n```</think> \\boxed{7}"
  assert t.decode(t.encode(text)) == text   # byte-level: any text round-trips


def test_llama3_style_tokenizer_pads_a_large_vocabulary_exactly(tmp_path):
  t = HFTokenizer(write_llama3_style_tokenizer(str(tmp_path), vocab_size=4096))
  assert t.vocab_size == 4096 and t.bos_id == 4096 - 256 and t.eos_id == 4096 - 256 + 9


def test_render_exact_token_strings(l3):
  t = HFTokenizer(l3, template="reasoning_instruct")
  text = t.prompt_text("What is 12 + 7?")
  assert text == (HEAD + "\n\nThink step by step, then close your reasoning with </think> and put "
                  "your final answer within \\boxed{}." + ASSISTANT + "<think>\n")
  toks = t.tok.convert_ids_to_tokens(t.encode_prompt("What is 12 + 7?"))
  assert toks == [
      "<|begin_of_text|>", "<|start_header_id|>", "u", "s", "er", "<|end_header_id|>", "Ċ", "Ċ",
      "What", "Ġis", "Ġ", "12", "Ġ+", "Ġ", "7", "?", "Ċ", "Ċ", "Th", "ink", "Ġstep", "Ġby",
      "Ġstep", ",", "Ġthe", "n", "Ġc", "lo", "se", "Ġyour", "Ġreason", "ing", "Ġwith", "Ġ", "</",
      "think", ">", "Ġand", "Ġput", "Ġyour", "Ġfinal", "Ġanswer", "Ġwithin", "Ġ\\", "boxed", "{}.",
      "<|eot_id|>", "<|start_header_id|>", "a", "ss", "istan", "t", "<|end_header_id|>", "Ċ", "Ċ",
      "<think", ">Ċ"]


def test_render_bare_and_instruct(l3):
  assert HFTokenizer(l3).prompt_text("What is 12 + 7?") == HEAD + ASSISTANT
  assert HFTokenizer(l3, template="instruct").prompt_text("What is 12 + 7?") == (
      HEAD + "\n\nPlease reason step by step, and put your final answer within \\boxed{}." + ASSISTANT)
  code = HFTokenizer(l3, template="reasoning_instruct", reward="code").prompt_text("Add two ints.")
  assert code.endswith("Add two ints.\n\nThink step by step, then close your reasoning with "
                       "</think> and give your final solution as one complete Python program in a "
                       "```python code block." + ASSISTANT + "<think>\n")
  sys = HFTokenizer(l3, system_prompt="Be brief.", template="instruct").prompt_text("x")
  assert sys.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief."
                        "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nx\n\nPlease")


def test_bare_keeps_the_old_prompt_and_the_think_prefix_is_never_doubled(tiny_tok):
  assert HFTokenizer(tiny_tok).prompt_text("what is 1 + 1 ?") == \
      "<s><|user|> what is 1 + 1 ? <|assistant|> <think>"
  # this chat template opens <think> itself: reasoning_instruct adds only its instruction
  text = HFTokenizer(tiny_tok, template="reasoning_instruct").prompt_text("what is 1 + 1 ?")
  assert text.endswith("\\boxed{}. <|assistant|> <think>") and text.count("<think>") == 1


def test_template_registry_and_config_errors():
  assert templates.names() == ("bare", "instruct", "reasoning_instruct")
  assert [templates.get(n).require_think_close for n in templates.names()] == [True, False, True]
  assert templates.get("").name == "bare"
  c = common.base_config()
  c.data.template = "chatml"
  with pytest.raises(recipes.ConfigError, match=r"config.data.template='chatml'; registered prompt "
                     r"templates: \['bare', 'instruct', 'reasoning_instruct'\]"):
    recipes.check_data(c.data)
  c.data.kind, c.data.template = "synthetic", "instruct"
  with pytest.raises(recipes.ConfigError, match="built-in task 'synthetic' has a fixed prompt"):
    recipes.check_data(c.data)
  c.data.tasks.code = common.task_section("deepcoder", template="nope")
  c.data.tasks.math = common.task_section("polaris", template="instruct")
  c.data.mixture = "math:0.5,code:0.5"
  with pytest.raises(recipes.ConfigError, match="data.tasks.code: config.data.template='nope'"):
    recipes.check_data(c.data)


@pytest.mark.parametrize("require,text,want", [
    (True, "The answer is \\boxed{5}.", (0.0, "no_answer")),
    (False, "The answer is \\boxed{5}.", (1.0, "pass")),
    (False, "The answer is \\boxed{4}.", (0.0, "wrong_answer")),
    (True, "hmm \\boxed{4} </think> so \\boxed{5}", (1.0, "pass")),
    (False, "hmm \\boxed{4} </think> so \\boxed{5}", (1.0, "pass")),
    (False, "hmm \\boxed{5} </think> no answer here", (0.0, "wrong_answer")),   # after </think> only
])
def test_math_verifier_with_and_without_required_think_close(require, text, want):
  g = rewards.grade("math", text, "5", require_think_close=require)
  assert (g.reward, g.reason) == want
  assert rewards.compute_reward("math", text, "5", require_think_close=require) == want[0]


def test_code_verifier_without_required_think_close():
  answer = json.dumps([{"input": "2 3\n", "output": "5\n"}])
  text = "Here it is:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
  g = rewards.grade("code", text, answer)
  assert (g.reward, g.reason) == (0.0, "no_code")
  g = rewards.grade("code", text, answer, require_think_close=False)
  assert (g.reward, g.reason, g.sandboxed) == (1.0, "pass", True)


def _math_dataset(tmp_path, tok, template, n=12):
  rows = [{"problem": f"What is {i} + {i + 10}?", "answer": str(2 * i + 10)} for i in range(n)]
  path = tmp_path / f"math_{template}.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  data = common.base_config().data
  data.update(dict(kind="polaris", path=str(path), tokenizer_path=tok, heldout=2,
                   template=template))
  return build_dataset(data, max_prompt_len=96)


@pytest.mark.parametrize("template,want", [
    ("bare", [0.0, 0.0, 0.0, 0.0]),                 # plain sentences at <|eot_id|>: no </think>
    ("reasoning_instruct", [1.0, 0.0, 1.0, 0.0]),   # </think> + boxed; odd samples off by one
    ("instruct", [1.0, 0.0, 1.0, 0.0]),             # boxed, no </think>, none required
])
def test_scripted_instruct_model_through_the_dataset(tmp_path, l3, template, want):
  d = _math_dataset(tmp_path, l3, template)
  assert d.stop_tokens == (457, 449) and d.template().name == template
  spec = SamplingSpec(stop_tokens=d.stop_tokens, think_budget_max=64, answer_budget=32)
  p = d.train[0]
  gen = ScriptedInstructModel(d.tokenizer, version=3)
  group, = gen.generate([p], 4, spec)
  assert [d.reward(c.tokens, p.answer) for c in group] == want
  assert all(c.tokens[-1] == 457 and c.finish_reason == "stop" and (c.versions == 3).all()
             for c in group)
  assert [d.grade(c.tokens, p.answer).reason for c in group][:2] == (
      ["no_answer"] * 2 if template == "bare" else ["pass", "wrong_answer"])


def test_scripted_reply_follows_the_prompt():
  assert scripted_reply("What is 3 + 4?", 0) == "The answer is 7."
  assert scripted_reply("What is 3 * 4? ... within \\boxed{}.", 1) == \
      "Computing the expression gives 13, so the answer is \\boxed{13}."
  assert scripted_reply("What is 9 - 4? assistant\n\n<think>\n", 0).endswith(
      "It equals 5.\n</think>\n\nThe answer is \\boxed{5}.")


def _Health(**kw):
  h = common.base_config().health
  h.update(kw)
  return h


def _samples(n, text="The answer is 7.", finish="stop"):
  return [(text, finish, "")] * n


def test_step0_check_stops_with_one_line_naming_the_knob():
  tmpl = {"": templates.get("bare")}
  with pytest.raises(NoRewardSignal) as e:
    step0_reward_check(np.zeros(768), _Health(), _samples(768), tmpl, {"": "math"})
  assert str(e.value) == (
      "step 0: 0 of 768 samples got a non-zero reward; 0 of them wrote `</think>`, which the "
      "verifier requires, and the template `bare` asks for none (768 ended their turn, 0 were "
      "cut): set --config.data.template=reasoning_instruct (think prefix + answer instruction; or "
      "`instruct`: no `</think>` required) (health.step0_reward_check=False skips this check)")
  assert "\n" not in str(e.value)


def test_step0_check_reasons_for_other_templates_and_mixtures():
  ri = {"math": templates.get("reasoning_instruct")}
  cut = [("I think and think", "length", "math")] * 60 + [("x", "stop", "math")] * 4
  ri["code"] = templates.get("bare")
  cut += [("</think> ```python\nprint(1)```", "stop", "code")] * 64     # a mixture: code is fine
  h64 = _Health(step0_min_samples=64)
  with pytest.raises(NoRewardSignal, match=r"^step 0: 0 of 128 samples got a non-zero reward; of "
                     r"task math's 64, 0 of them wrote `</think>`, which the verifier "
                     r"requires, though the template `reasoning_instruct` asks for it \(4 ended "
                     r"their turn, 60 were cut at the length budget\): raise "
                     r"rollout.think_budget_max / rollout.answer_budget if they were cut, else "
                     r"set --config.data.tasks.math.template=instruct"):
    step0_reward_check(np.zeros(128), h64, cut, ri, {"math": "math", "code": "code"})
  closed = [("ok </think> \\boxed{3}", "stop", "")] * 64
  with pytest.raises(NoRewardSignal, match=r"64 of them wrote `</think>` but no answer passed the "
                     r"`math` verifier: check that the template `instruct` \(data.template\)"):
    step0_reward_check(np.zeros(64), h64, closed, {"": templates.get("instruct")},
                       {"": "math"})
  with pytest.raises(NoRewardSignal, match=r"^step 0: 0 of 64 samples got a non-zero reward; see "
                     r"process 0's log for why"):
    step0_reward_check(np.zeros(64), h64)            # a process without the completions


def test_step0_check_threshold_and_knob():
  one, two = np.zeros(768), np.zeros(768)
  one[5], two[[5, 9]] = 1.0, 1.0
  with pytest.raises(NoRewardSignal, match="^step 0: 1 of 768 samples"):
    step0_reward_check(one, _Health())                 # 1/768 <= 0.002
  assert step0_reward_check(two, _Health()) == {"health/step0_nonzero_frac": 2 / 768}
  assert step0_reward_check(np.zeros(768), _Health(step0_reward_check=False)) == \
      {"health/step0_nonzero_frac": 0.0}
  # a batch under step0_min_samples (256) is not checked: 0 of 64 is noise at a 5 % pass rate
  assert step0_reward_check(np.zeros(64), _Health()) == {"health/step0_nonzero_frac": 0.0}
  assert step0_reward_check(np.zeros(64) + 0.5, _Health(step0_min_nonzero_frac=0.99,
                                                       step0_min_samples=1)) == \
      {"health/step0_nonzero_frac": 1.0}
  with pytest.raises(NoRewardSignal, match="^step 0: 32 of 64"):
    step0_reward_check(np.r_[np.ones(32), np.zeros(32)],
                       _Health(step0_min_nonzero_frac=0.5, step0_min_samples=64))
