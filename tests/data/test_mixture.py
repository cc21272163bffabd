"""Task mixtures and the tiny code task (issue 16 part 2): config shape and start-up errors, shares,
task ids, per-task held-out sets and rewards, SFT traces, sandboxed grading, skipped records."""
import dataclasses
import importlib
import json

import numpy as np
import pytest

from scalerl_jax import config as common
from scalerl_jax import recipes, rewards
from scalerl_jax.training import job
from scalerl_jax.data import (build_dataset, check_answers, loaders, mixture, stats_metrics,
                              synthetic, tiny_code)
from scalerl_jax.data.tiny_hf_tokenizer import write_tiny_tokenizer
from scalerl_jax.rewards import sandbox
from scalerl_jax.rewards import tiny_code as tiny_code_reward


def _multitask():
  return importlib.import_module("configs.tiny_multitask").get_config()


def _small(c, n=64, held_math=8, held_code=4):
  c.data.tasks.math.synthetic_n_train = n
  c.data.tasks.code.synthetic_n_train = n
  c.data.tasks.math.heldout = held_math
  c.data.tasks.code.heldout = held_code
  return c


@pytest.mark.parametrize("mix,match", [
    ("math:0.5,code:0.4", r"shares sum to 0.9, not 1"),
    ("math:0.5,poetry:0.5", r"unknown task 'poetry'; config.data.tasks declares \['code', 'math'\]"),
    ("math:0.5,code", r"expected 'task:share,task:share'"),
    ("math:half,code:0.5", r"share 'half' of task 'math' is not a number"),
    ("math:1.0,code:0", r"share of 'code' must be > 0"),
    ("math:0.5,math:0.5", r"names task 'math' twice"),
])
def test_bad_mixture_fails_validation(mix, match):
  c = _multitask()
  c.data.mixture = mix
  with pytest.raises(recipes.ConfigError, match=match):
    recipes.validate(c)


def test_bad_task_kind_and_command_line_shape():
  c = _multitask()
  c.data.tasks.code.kind = "poetry"
  with pytest.raises(recipes.ConfigError, match=r"data.tasks.code.kind='poetry'"):
    recipes.validate(c)
  c = _multitask()
  recipes.validate(c)                                     # the shipped config is valid
  # Declared in base_config, so `--config.data.mixture=...` and per-task keys override.
  assert common.base_config().data.mixture == "" and len(common.base_config().data.tasks) == 0
  c.data.mixture = "math:1.0"                             # a one-task "mixture" is fine
  recipes.validate(c)
  with pytest.raises(KeyError, match="unknown data key 'bogus'"):
    common.task_section("synthetic", bogus=1)


def test_mixture_dataset_tasks_ids_and_rewards():
  d = build_dataset(_small(_multitask()).data, 32)
  assert d.is_mixture and d.tasks == ("math", "code") and d.needs_sandbox
  assert d.task_rewards == {"math": "synthetic", "code": "tiny_code"}
  assert len(d.train) == 128 and len(d.heldout) == 12
  held = {t: [p for p in d.heldout if p.task == t] for t in d.tasks}
  assert (len(held["math"]), len(held["code"])) == (8, 4)     # held-out drawn per task
  for p in d.train + d.heldout:                               # the task follows from the id alone
    assert d.task_of(p.prompt_id) == p.task
  assert all(p.prompt_id < mixture.TASK_ID_STRIDE for p in d.train if p.task == "math")
  assert all(p.prompt_id >= mixture.TASK_ID_STRIDE for p in d.train if p.task == "code")
  assert len({p.prompt_id for p in d.train + d.heldout}) == 140
  with pytest.raises(ValueError, match="outside every task's id range"):
    d.task_of(5 * mixture.TASK_ID_STRIDE)
  # One tokenizer: the tiny code vocabulary extends the digit-sum one (same ids for shared words).
  assert d.tokenizer.vocab[:32] == synthetic.VOCAB and d.tokenizer.vocab_size == 39
  assert synthetic.TOKENIZER.encode("sum 3 = <think>") == d.tokenizer.encode("sum 3 = <think>")
  m = held["math"][0]
  prob = next(p for p in synthetic.make_split(0, 0, 8)[1] if p.prompt_id == m.prompt_id)
  assert d.reward(prob.gold_completion_tokens, m.answer, "math") == 1.0
  assert d.grade(prob.gold_completion_tokens, m.answer, "math").sandboxed is False
  with pytest.raises(ValueError, match="unknown task 'poetry'"):
    d.reward([1], "1", "poetry")
  st = stats_metrics(d)
  assert st["data/math/train"] == 64 and st["data/code/share"] == 0.5 and st["data/heldout"] == 12


def test_shares_trim_train_splits():
  c = _small(_multitask(), n=90)
  c.data.mixture = "math:0.25,code:0.75"
  d = build_dataset(c.data, 32)
  n = {t: sum(p.task == t for p in d.train) for t in d.tasks}
  assert n == {"math": 30, "code": 90}                    # 30 : 90 = 0.25 : 0.75
  assert d.stats["tasks"]["math"]["trimmed"] == 60 and d.stats["tasks"]["code"]["trimmed"] == 0
  assert mixture.trimmed_counts([100, 100], [0.5, 0.5]) == [100, 100]
  assert mixture.trimmed_counts([1000, 100], [0.7, 0.3]) == [233, 100]


def test_mixture_sft_traces_cover_both_tasks():
  d = build_dataset(_small(_multitask()).data, 32)
  tokens, mask = d.sft_batch(40, seed=0, step_noise=0.0)
  assert tokens.shape == mask.shape and tokens.shape[0] == 40
  code_id = d.tokenizer.token_id("code")
  sum_id = d.tokenizer.token_id("sum")
  assert (tokens[:, 1] == code_id).sum() == 20 and (tokens[:, 1] == sum_id).sum() == 20
  # Clean code traces print exactly the prompt's expression, and that program passes the verifier.
  row = next(r for r in tokens if r[1] == code_id)
  text = d.tokenizer.decode(row)
  expr = text.split(" code ")[1].split(" = ")[0]
  assert text.split("</think> ")[1].startswith(f"print ( {expr} ) <eos>")


def test_tiny_code_task_and_sandboxed_grade():
  rewards.prepare_code_rewards(common.base_config())       # the real bwrap sandbox
  tiny_code_reward.clear_cache()
  p = tiny_code.Problem(0, (3, 7, 2, 5, 1, 8), ("+", "*", "-", "*", "+"))
  assert p.target == str(3 + 7 * 2 - 5 * 1 + 8) == "20"
  assert json.loads(p.answer) == {"tests": [{"input": "", "output": "20"}], "fn_name": None}
  tok = tiny_code.TOKENIZER
  good = tok.encode("</think> print ( 3 + 7 * 2 - 5 * 1 + 8 ) <eos> <pad>")
  g = rewards.grade("tiny_code", tok.decode(good), p.answer)
  assert (g.reward, g.reason, g.sandboxed, g.cached) == (1.0, "pass", True, False)
  g2 = rewards.grade("tiny_code", tok.decode(good), p.answer)   # the same program: memoized
  assert (g2.reward, g2.sandboxed, g2.cached) == (1.0, True, True)
  other = tok.encode("</think> print ( 2 * 1 0 ) <eos>")       # any program printing 20 passes
  assert rewards.grade("tiny_code", tok.decode(other), p.answer).reward == 1.0
  wrong = rewards.grade("tiny_code", "</think> print ( 3 + 7 ) <eos>", p.answer)
  assert (wrong.reward, wrong.reason, wrong.sandboxed) == (0.0, "wrong_answer", True)
  broken = rewards.grade("tiny_code", "</think> print ( 3 + ) <eos>", p.answer)
  assert (broken.reason, broken.sandboxed) == ("runtime_error", True)
  assert rewards.grade("tiny_code", "print ( 2 0 )", p.answer).reason == "no_code"  # no </think>
  assert rewards.grade("tiny_code", "</think> x", "not json").reason == "bad_tests"
  with pytest.raises(ValueError, match="not JSON"):
    rewards.compute_reward("tiny_code", "</think> x", "not json")
  # SFT noise: an exact imitator passes (1 - q)^n of the time.
  train, held = tiny_code.make_split(0, 200, 16)
  assert not {(q.digits, q.ops) for q in train} & {(q.digits, q.ops) for q in held}
  ex = tiny_code.sft_examples(train, seed=0, step_noise=0.2)
  assert abs(np.mean([e.correct for e in ex]) - tiny_code.expected_pass_rate(0.2, 6)) < 0.08


def _code_rows():
  ok = [{"input": "1\n", "output": "1\n"}]
  rows = [{"problem": f"echo the number {i} back", "tests": json.dumps(ok)} for i in range(12)]
  rows.append({"problem": "bad case", "tests": [{"input": "1"}]})                  # no output
  rows.append({"problem": "bad type", "tests": [{"input": "1", "output": "1", "testtype": "x"}]})
  rows.append({"problem": "fn", "tests": [{"type": "function_call", "input": [1], "output": [1]}]})
  return rows


def test_malformed_test_case_skips_the_prompt_and_is_counted(tmp_path):
  tok = write_tiny_tokenizer(str(tmp_path / "tok"))
  path = tmp_path / "dc.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in _code_rows()))
  data = common.base_config().data
  data.update(dict(kind="deepcoder", path=str(path), tokenizer_path=tok, heldout=2))
  d = build_dataset(data, 64)
  assert (d.stats["records"], d.stats["malformed"], d.stats["unsupported"]) == (15, 2, 1)
  assert len(d.train) + len(d.heldout) == 12
  assert stats_metrics(d)["data/malformed"] == 2
  with pytest.raises(loaders.MalformedTest, match=r"dc.jsonl:13: tests\[0\] must be an object"):
    loaders.load_code(str(path))                     # strict by default
  counts = {}
  records, skipped = loaders.load_code(str(path), True, True, counts)
  assert (len(records), skipped, counts) == (12, 3, {"malformed": 2, "unsupported": 1})
  # A `tests` field that is not JSON at all stops the run at start-up, naming file and line.
  path.write_text(path.read_text() + json.dumps({"problem": "p", "tests": "[{"}) + "\n")
  with pytest.raises(loaders.DataError, match=r"dc.jsonl:16: field 'tests' is not valid JSON"):
    build_dataset(data, 64)
  # In a mixture the error names the task section.
  c = common.base_config()
  c.data.tasks.code = common.task_section("deepcoder", path=str(path), tokenizer_path=tok, heldout=2)
  c.data.mixture = "code:1.0"
  with pytest.raises(loaders.DataError, match=r"data.tasks.code: .*not valid JSON"):
    build_dataset(c.data, 64)


def test_code_answers_must_be_test_json():
  ok = tiny_code.make_split(0, 2, 1)[0][0].to_prompt_spec()
  bad = ok.__class__(prompt_id=7, tokens=ok.tokens, answer="[{")
  with pytest.raises(ValueError, match="tiny_code prompt 7: the answer is not valid test JSON"):
    check_answers("tiny_code", "tiny_code", [ok, bad])


def test_mixed_tokenizers_are_refused(tmp_path):
  c = _small(_multitask())
  c.data.tasks.math = common.task_section("polaris", path="/nonexistent.jsonl",
                                          tokenizer_path=write_tiny_tokenizer(str(tmp_path)))
  with pytest.raises(FileNotFoundError, match="data.tasks.math"):
    build_dataset(c.data, 32)
  with pytest.raises(ValueError, match="use different tokenizers"):
    mixture.shared_tokenizer(["a", "b"], [synthetic.TOKENIZER, type("T", (), {"path": "/x"})()])
  with pytest.raises(ValueError, match="not a prefix"):
    mixture.shared_tokenizer(["a", "b"], [synthetic.TOKENIZER,
                                          synthetic.SyntheticTokenizer(("x",) + synthetic.VOCAB)])


def test_mixture_with_code_refuses_to_start_without_sandbox(tmp_path):
  """A mixture with a sandboxed task stops at job start (before config.json, SFT, buffer) when the
  sandbox cannot start; the digit-sum task alone needs no sandbox."""
  saved = sandbox.settings()
  try:
    c = _small(_multitask())
    c.rewards.code_bwrap = "/bin/false"
    workdir = tmp_path / "run"
    recipes.validate(c, str(workdir))
    with pytest.raises(rewards.SandboxUnavailable, match="did not start"):
      job.run(c, str(workdir), progress=False)
    assert not (workdir / "config.json").exists() and not (workdir / "base_policy").exists()
    c.data.mixture = "math:1.0"
    assert not build_dataset(c.data, 32).needs_sandbox
  finally:
    sandbox.configure(**dataclasses.asdict(saved))


def test_sandbox_breaking_mid_run_stops_grading():
  """A sandbox that breaks after start-up (its binary gone) gives `sandbox_error` grades, which are
  never memoized; sandbox_still_works (called by generators and evaluation on such a grade) then
  raises instead of letting the run train on zero rewards."""
  saved = sandbox.settings()
  tiny_code_reward.clear_cache()
  p = tiny_code.Problem(0, (2, 3), ("*",))
  try:
    rewards.prepare_code_rewards(common.base_config())
    rewards.sandbox_still_works("")                       # working: no error
    sandbox.configure(bwrap="/bin/false")                # what a vanished binary looks like
    g = rewards.grade("tiny_code", "</think> print ( 2 * 3 ) <eos>", p.answer)
    assert (g.reward, g.reason, g.cached) == (0.0, "sandbox_error", False)
    assert rewards.grade("tiny_code", "</think> print ( 2 * 3 ) <eos>", p.answer).cached is False
    with pytest.raises(rewards.SandboxUnavailable, match="did not start"):
      rewards.sandbox_still_works(g.detail)
  finally:
    sandbox.configure(**dataclasses.asdict(saved))
