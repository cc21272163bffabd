"""Real-data loaders (Polaris / DeepCoder style) on small files the tests write, with a local tokenizer."""
import json


from scalerl_jax import config as common
import numpy as np
import pytest

from scalerl_jax.data import build_dataset, loaders
from scalerl_jax.data.hf_tokenizer import HFTokenizer
from scalerl_jax.data.tiny_hf_tokenizer import write_tiny_tokenizer


@pytest.fixture(scope="module")
def tok_path(tmp_path_factory):
  return write_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))


def math_rows(n):
  rows = [{"problem": f"what is {i % 10} + {i % 7} ?", "answer": str(i % 10 + i % 7), "id": i}
          for i in range(n)]
  return [dict(r, problem=r["problem"] + " " + " ".join(["1"] * (i % 5))) for i, r in enumerate(rows)]


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


def cfg(**kw):
  data = common.base_config().data
  data.update({**dict(kind="polaris", path="", tokenizer_path="", heldout=10, split_seed=0), **kw})
  return data


def test_hf_tokenizer_chat_template(tok_path):
  t = HFTokenizer(tok_path)
  assert t.prompt_text("what is 1 + 1 ?") == "<s><|user|> what is 1 + 1 ? <|assistant|> <think>"
  ids = t.encode_prompt("what is 1 + 1 ?")
  assert ids[0] == t.tok.bos_token_id and t.decode(ids[-1:]) == "<think>"
  assert len(t.think_end_ids) == 1 and t.decode(t.think_end_ids) == "</think>"
  sys_t = HFTokenizer(tok_path, system_prompt="solve")
  assert sys_t.prompt_text("x").startswith("<s><|system|> solve <|user|> x")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    HFTokenizer(str(tok_path) + "_missing")


def test_polaris_jsonl(tmp_path, tok_path):
  rows = math_rows(60)
  rows.append(dict(rows[3]))                      # an exact duplicate problem
  rows.append({"problem": "what is " + "1 + " * 40 + "1 ?", "answer": "41"})   # too long
  path = write_jsonl(tmp_path / "polaris.jsonl", rows)
  d = build_dataset(cfg(path=path, tokenizer_path=tok_path), max_prompt_len=24)
  assert d.reward_name == "math" and d.kind == "polaris"
  assert d.stats == {"records": 62, "unsupported": 0, "malformed": 0, "too_long": 1, "duplicates": 1, "train": 50,
                     "heldout": 10}
  assert len(d.heldout) == 10 and len(d.train) == 50
  assert not {p.prompt_id for p in d.train} & {p.prompt_id for p in d.heldout}
  assert all(len(p.tokens) <= 24 and p.tokens.dtype == np.int32 for p in d.train + d.heldout)
  # prompt_id is the row index: answers and prompts line up with the file
  for p in d.train[:5] + d.heldout[:5]:
    assert p.answer == rows[p.prompt_id]["answer"]
    assert p.tokens.tolist() == d.tokenizer.encode_prompt(rows[p.prompt_id]["problem"])
  # fixed seed -> same held-out; another seed -> another one
  again = build_dataset(cfg(path=path, tokenizer_path=tok_path), max_prompt_len=24)
  assert [p.prompt_id for p in again.heldout] == [p.prompt_id for p in d.heldout]
  other = build_dataset(cfg(path=path, tokenizer_path=tok_path, split_seed=1), max_prompt_len=24)
  assert [p.prompt_id for p in other.heldout] != [p.prompt_id for p in d.heldout]
  p = d.heldout[0]
  assert d.reward(f"hmm </think> \\boxed{{{p.answer}}}", p.answer) == 1.0
  assert d.interruption_tokens("time is up. </think>")[-1] == d.think_end_tokens[0]


def test_polaris_parquet(tmp_path, tok_path):
  pa = pytest.importorskip("pyarrow")
  import pyarrow.parquet as pq
  rows = math_rows(30)
  rows[5]["answer"] = 7   # numeric answers are accepted as strings
  path = str(tmp_path / "polaris.parquet")
  pq.write_table(pa.Table.from_pylist([{"problem": r["problem"], "answer": str(r["answer"])}
                                       for r in rows]), path)
  d = build_dataset(cfg(path=path, tokenizer_path=tok_path, heldout=5), max_prompt_len=64)
  assert len(d.heldout) == 5 and len(d.train) == 25
  assert {p.prompt_id: p.answer for p in d.train + d.heldout}[5] == "7"


@pytest.mark.parametrize("line,match", [
    ('{"problem": "what is 1 ?"}', r"bad.jsonl:2: missing field 'answer'"),
    ('{"problem": "", "answer": "1"}', r"bad.jsonl:2: field 'problem' is empty"),
    ('{"problem": ["x"], "answer": "1"}', r"bad.jsonl:2: field 'problem' must be a string"),
    ('{"problem": "x", ', r"bad.jsonl:2: invalid JSON"),
    ('[1, 2]', r"bad.jsonl:2: expected a JSON object"),
])
def test_malformed_math_rows(tmp_path, tok_path, line, match):
  path = tmp_path / "bad.jsonl"
  path.write_text('{"problem": "what is 1 ?", "answer": "1"}\n' + line + "\n")
  with pytest.raises(loaders.DataError, match=match):
    build_dataset(cfg(path=str(path), tokenizer_path=tok_path), max_prompt_len=64)


def test_missing_inputs(tmp_path, tok_path):
  with pytest.raises(FileNotFoundError, match="nope.jsonl"):
    build_dataset(cfg(path=str(tmp_path / "nope.jsonl"), tokenizer_path=tok_path), 64)
  with pytest.raises(ValueError, match="config.data.path is empty"):
    build_dataset(cfg(tokenizer_path=tok_path), 64)
  path = write_jsonl(tmp_path / "m.jsonl", math_rows(12))
  with pytest.raises(ValueError, match="tokenizer_path is empty"):
    build_dataset(cfg(path=path), 64)
  with pytest.raises(loaders.DataError, match=r"held-out size 10 needs more than the 3 prompts .*9 longer than 10 tokens"):
    build_dataset(cfg(path=path, tokenizer_path=tok_path), max_prompt_len=10)
  with pytest.raises(ValueError, match="config.data.kind='bogus'"):
    build_dataset(cfg(kind="bogus"), 64)
  with pytest.raises(loaders.DataError, match="unsupported extension"):
    (tmp_path / "x.csv").write_text("a")
    build_dataset(cfg(path=str(tmp_path / "x.csv"), tokenizer_path=tok_path), 64)


def test_deepcoder_jsonl(tmp_path, tok_path):
  stdin_tests = [{"input": "1 2\n", "output": "3\n"}, {"input": "2 2\n", "output": "4\n"}]
  rows = [{"problem": f"print input {i} + 1 ?", "tests": json.dumps(stdin_tests)} for i in range(8)]
  rows.append({"problem": "def add return", "metadata": {"func_name": "add"},
               "tests": [{"input": "1\n2", "output": "3", "testtype": "functional"}]})
  rows.append({"problem": "compute input", "tests": {"inputs": ["5\n"], "outputs": ["5\n"]}})
  rows.append({"problem": "print 7", "tests": json.dumps(
      [{"type": "stdin_stdout", "input": "", "output": "7\n"}])})            # PrimeIntellect layout
  rows.append({"problem": "def f", "tests": json.dumps(
      [{"type": "function_call", "fn_name": "f", "input": [1], "output": [1]}])})   # unsupported
  path = write_jsonl(tmp_path / "deepcoder.jsonl", rows)
  d = build_dataset(cfg(kind="deepcoder", path=path, tokenizer_path=tok_path, heldout=2), 64)
  assert d.reward_name == "code" and len(d.train) == 9 and len(d.heldout) == 2
  assert d.stats["unsupported"] == 1 and d.stats["records"] == 12
  with pytest.raises(loaders.UnsupportedRecord, match=r"deepcoder.jsonl:12: tests\[0\].type='function_call'"):
    loaders.load_code(path)
  by_id = {p.prompt_id: p for p in d.train + d.heldout}
  assert json.loads(by_id[0].answer) == {"tests": stdin_tests, "fn_name": None}
  assert json.loads(by_id[8].answer)["fn_name"] == "add"
  assert json.loads(by_id[9].answer)["tests"] == [{"input": "5\n", "output": "5\n"}]
  assert json.loads(by_id[10].answer)["tests"] == [{"input": "", "output": "7\n"}]
  assert d.reward("</think>\n```python\nprint(7)\n```", by_id[10].answer) == 1.0
  code = "</think>\n```python\na, b = map(int, input().split())\nprint(a + b)\n```"
  assert d.reward(code, by_id[0].answer) == 1.0
  assert d.reward(code.replace("a + b", "a * b"), by_id[0].answer) == 0.0
  fn = "</think>\n```python\ndef add(a, b):\n  return a + b\n```"
  assert d.reward(fn, by_id[8].answer) == 1.0


def test_taco_layout_keeps_fn_name(tmp_path):
  """TACO rows (DeepCoder's taco subset) carry fn_name inside the tests JSON; call-based inputs
  are argument lists (one JSON argument per line for the code reward), outputs the wrapped return
  value; stdin rows may give inputs / outputs as lists of lines."""
  rows = [{"problem": "call", "tests": json.dumps({"inputs": [[1, "a b"], [[2, 3], None]],
                                                    "outputs": [[True], [[5]]], "fn_name": "g"})},
          {"problem": "stdin", "tests": {"inputs": [["1 2", "3"]], "outputs": [["3", "3"]]}}]
  recs, skipped = loaders.load_code(write_jsonl(tmp_path / "taco.jsonl", rows))
  assert skipped == 0
  assert json.loads(recs[0].answer) == {"fn_name": "g", "tests": [
      {"input": '1\n"a b"', "output": "[true]", "testtype": "functional", "apps_wrapped": True},
      {"input": "[2, 3]\nnull", "output": "[[5]]", "testtype": "functional", "apps_wrapped": True}]}
  assert json.loads(recs[1].answer) == {"fn_name": None, "tests": [
      {"input": "1 2\n3", "output": "3\n3"}]}


@pytest.mark.parametrize("tests,match", [
    (None, "missing field 'tests'"),
    ("[{", "field 'tests' is not valid JSON"),
    ([], "field 'tests' must be a non-empty list"),
    ([{"input": "1"}], r"tests\[0\] must be an object with 'input' and 'output'"),
    ([{"input": "1", "output": "1", "testtype": "functional"}],
     r"tests\[0\] is functional but there is no 'fn_name'"),
])
def test_malformed_code_rows(tmp_path, tok_path, tests, match):
  rec = {"problem": "p"} if tests is None else {"problem": "p", "tests": tests}
  path = write_jsonl(tmp_path / "dc.jsonl", [rec])
  with pytest.raises(loaders.DataError, match="dc.jsonl:1: " + match):
    loaders.load_code(path)
