"""Real prompt sets: Polaris-53K-style math and DeepCoder-style code, from JSONL or Parquet
(local paths or gs://, through scalerl_jax.storage).

File formats (one record per JSONL line or Parquet row; extra fields are ignored):
  math (kind=polaris):    {"problem": str, "answer": str | number}
  code (kind=deepcoder):  {"problem": str, "tests": list | JSON str of [{"input", "output"[, "testtype"]}],
                           optional "fn_name" (or "metadata": {"func_name": ...}) for functional tests}
  DeepCoder-Preview subsets: lcbv5 ("testtype" stdin | functional) and codeforces load as-is;
  PrimeIntellect "type": "stdin_stdout" is normalized; "function_call" tests are unsupported
  (skipped by build_dataset and counted in stats["unsupported"]); TACO {"inputs", "outputs"
  [, "fn_name"]}: stdin tests, or call-based ones when "fn_name" is set (`_taco_tests`).
For code, `PromptSpec.answer` is the JSON the `code` reward reads: {"tests": [...], "fn_name": ...}.

Splitting (`split_prompts`): drop prompts longer than max_prompt_len tokens, drop repeated problem texts
(first kept), then a seeded permutation puts `heldout` prompts in the held-out split and the rest in
train; prompt_id is the record's 0-based index in the file, so ids are unique and traceable.
"""
from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import posixpath
from typing import Any, Iterator

import numpy as np

from scalerl_jax import storage
from scalerl_jax.types import PromptSpec


class DataError(ValueError):
  """A missing or malformed data file; the message names the file, record and field."""


class UnsupportedRecord(DataError):
  """A well-formed record in a layout the verifier cannot run (skippable)."""


class MalformedTest(DataError):
  """One test case of a code record is malformed (not {input, output}, bad testtype, functional
  without fn_name); `load_code(skip_malformed=True)` skips the record and counts it."""


DATA_EXTENSIONS = (".jsonl", ".json", ".parquet")


def data_files(path: str) -> list[str]:
  """The files a data path names, local or gs://: the file itself; every .jsonl / .json /
  .parquet file directly in a directory; the files a glob in the last path component matches
  (`shards/train-*.parquet`, as DeepCoder ships its splits). Sorted; FileNotFoundError when none."""
  if storage.isfile(path):
    return [path]
  base, pattern = posixpath.split(path.rstrip("/"))
  if storage.isdir(path):
    names = [n for n in storage.listdir(path) if n.endswith(DATA_EXTENSIONS)]
    out = sorted(storage.join(path, n) for n in names)
  elif any(ch in pattern for ch in "*?["):
    out = sorted(storage.join(base, n) for n in storage.listdir(base) if fnmatch.fnmatch(n, pattern))
  else:
    out = []
  if not out:
    raise FileNotFoundError(f"data path {path!r} names no data file (a .jsonl / .json / .parquet "
                            f"file, a directory of them, or a glob such as dir/train-*.parquet)")
  return out


def iter_records(path: str) -> Iterator[tuple[str, dict]]:
  """Yields (location, record) from every file `data_files(path)` names (a .jsonl / .json (list)
  / .parquet file, a directory or a glob of shards, local or gs://, read through
  scalerl_jax.storage), in file order; location is 'file:line'."""
  for f in data_files(path):
    yield from _iter_file(f)


def _iter_file(path: str) -> Iterator[tuple[str, dict]]:
  if path.endswith(".parquet"):
    try:
      import pyarrow.parquet as pq  # local: optional, only .parquet files need it
    except ImportError:
      raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
    with storage.open(path, "rb") as f:
      table = pq.read_table(f)
    for i, row in enumerate(table.to_pylist()):
      yield f"{path}:row {i}", row
  elif path.endswith(".jsonl"):
    with storage.open(path, encoding="utf-8") as f:
      for n, line in enumerate(f, 1):
        if not line.strip():
          continue
        try:
          rec = json.loads(line)
        except json.JSONDecodeError as e:
          raise DataError(f"{path}:{n}: invalid JSON ({e.msg})") from None
        if not isinstance(rec, dict):
          raise DataError(f"{path}:{n}: expected a JSON object, got {type(rec).__name__}")
        yield f"{path}:{n}", rec
  elif path.endswith(".json"):
    with storage.open(path, encoding="utf-8") as f:
      try:
        recs = json.load(f)
      except json.JSONDecodeError as e:
        raise DataError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(recs, list):
      raise DataError(f"{path}: expected a JSON list of objects")
    for i, rec in enumerate(recs):
      if not isinstance(rec, dict):
        raise DataError(f"{path}:item {i}: expected a JSON object")
      yield f"{path}:item {i}", rec
  else:
    raise DataError(f"{path}: unsupported extension (use .jsonl, .json or .parquet)")


def _text_field(loc: str, rec: dict, field: str) -> str:
  if field not in rec or rec[field] is None:
    raise DataError(f"{loc}: missing field {field!r}")
  value = rec[field]
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise DataError(f"{loc}: field {field!r} must be a string, got {type(value).__name__}")
  value = str(value).strip()
  if not value:
    raise DataError(f"{loc}: field {field!r} is empty")
  return value


@dataclasses.dataclass(frozen=True)
class Record:
  """One problem: `answer` is what the reward's verifier reads."""
  index: int
  location: str
  problem: str
  answer: str


def load_math(path: str) -> list[Record]:
  """Polaris-style records: `problem` and `answer`."""
  return [Record(i, loc, _text_field(loc, rec, "problem"), _text_field(loc, rec, "answer"))
          for i, (loc, rec) in enumerate(iter_records(path))]


def _code_answer(loc: str, rec: dict) -> str:
  if "tests" not in rec or rec["tests"] is None:
    raise DataError(f"{loc}: missing field 'tests'")
  tests: Any = rec["tests"]
  if isinstance(tests, str):
    try:
      tests = json.loads(tests)
    except json.JSONDecodeError as e:
      raise DataError(f"{loc}: field 'tests' is not valid JSON ({e.msg})") from None
  taco_fn = None
  if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:   # APPS/TACO layout
    taco_fn = tests.get("fn_name") or None
    tests = _taco_tests(loc, tests["inputs"], tests["outputs"], taco_fn)
  if not isinstance(tests, list) or not tests:
    raise DataError(f"{loc}: field 'tests' must be a non-empty list")
  meta = rec.get("metadata") or {}
  if isinstance(meta, str):
    try:
      meta = json.loads(meta)
    except json.JSONDecodeError:
      meta = {}
  fn_name = (taco_fn or rec.get("fn_name")
             or (meta.get("func_name") if isinstance(meta, dict) else None))
  norm = []
  for j, t in enumerate(tests):
    if isinstance(t, dict) and "type" in t and "testtype" not in t:   # PrimeIntellect layout
      if t["type"] != "stdin_stdout":
        raise UnsupportedRecord(f"{loc}: tests[{j}].type={t['type']!r} is not supported "
                                "(stdin_stdout, or testtype stdin/functional)")
      t = {k: v for k, v in t.items() if k != "type"}
    norm.append(t)
    if not isinstance(t, dict) or "input" not in t or "output" not in t:
      raise MalformedTest(f"{loc}: tests[{j}] must be an object with 'input' and 'output'")
    if t.get("testtype", "stdin") not in ("stdin", "functional"):
      raise MalformedTest(f"{loc}: tests[{j}].testtype must be 'stdin' or 'functional'")
    if t.get("testtype") == "functional" and not fn_name:
      raise MalformedTest(f"{loc}: tests[{j}] is functional but there is no "
                          "'fn_name'/'metadata.func_name'")
  return json.dumps({"tests": norm, "fn_name": fn_name})


def _taco_tests(loc: str, inputs: Any, outputs: Any, fn_name: str | None) -> list[dict]:
  """APPS/TACO `{"inputs": [...], "outputs": [...][, "fn_name": f]}` -> our tests.

  Standard-input problems: each input / output is a string (a list of lines is joined with
  newlines). Call-based problems (`fn_name` set): each input is the list of the call's
  arguments, written one JSON argument per line (testtype functional); each output is the return
  value wrapped in a one-element list (the APPS/TACO convention; their checker accepts the value
  or its wrapper), so such a test carries `"apps_wrapped": true` and the `code` reward accepts the
  wrapper's element as well as the wrapper itself."""
  if not isinstance(inputs, list) or not isinstance(outputs, list):
    raise DataError(f"{loc}: tests 'inputs' and 'outputs' must be lists")

  def text(v) -> Any:
    return "\n".join(str(x) for x in v) if isinstance(v, list) else v

  out = []
  for i, o in zip(inputs, outputs):
    if not fn_name:
      out.append({"input": text(i), "output": text(o)})
      continue
    args = i if isinstance(i, list) else [i]
    t: dict[str, Any] = {"input": "\n".join(json.dumps(a) for a in args), "output": json.dumps(o),
         "testtype": "functional"}
    if isinstance(o, list) and len(o) == 1:
      t["apps_wrapped"] = True
    out.append(t)
  return out


def load_code(path: str, skip_unsupported: bool = False, skip_malformed: bool = False,
              counts: dict | None = None) -> tuple[list[Record], int]:
  """DeepCoder-style records (see module docstring) -> (records, number skipped).

  A malformed record (no problem, `tests` missing, not JSON or not a non-empty list) always raises
  `DataError`; records whose tests use a layout the `code` reward cannot run (e.g. PrimeIntellect
  `function_call`) raise `UnsupportedRecord` unless `skip_unsupported`; a record with a malformed
  test case raises `MalformedTest` unless `skip_malformed`. Skips are counted in `counts`
  ({"unsupported": n, "malformed": n}) when given, and logged once per reason.
  """
  out, skipped = [], 0
  first: dict[str, str] = {}
  for i, (loc, rec) in enumerate(iter_records(path)):
    problem = _text_field(loc, rec, "problem")
    try:
      out.append(Record(i, loc, problem, _code_answer(loc, rec)))
    except (UnsupportedRecord, MalformedTest) as e:
      reason = "unsupported" if isinstance(e, UnsupportedRecord) else "malformed"
      if not (skip_unsupported if reason == "unsupported" else skip_malformed):
        raise
      skipped += 1
      first.setdefault(reason, str(e))
      if counts is not None:
        counts[reason] = counts.get(reason, 0) + 1
  for reason, msg in first.items():
    logging.getLogger(__name__).warning("skipped %s code records (first: %s)", reason, msg)
  return out, skipped


@dataclasses.dataclass
class SplitStats:
  records: int = 0
  unsupported: int = 0
  malformed: int = 0          # code records skipped for a malformed test case
  too_long: int = 0
  duplicates: int = 0
  train: int = 0
  heldout: int = 0


def split_prompts(records: list[Record], encode_prompt, max_prompt_len: int, heldout: int,
                  seed: int) -> tuple[list[PromptSpec], list[PromptSpec], SplitStats]:
  """Length filter + dedup, then a seeded held-out/train split (held-out never overlaps train)."""
  stats = SplitStats(records=len(records))
  kept, seen = [], set()
  for r in records:
    key = " ".join(r.problem.split())
    if key in seen:
      stats.duplicates += 1
      continue
    seen.add(key)
    tokens = np.asarray(encode_prompt(r.problem), np.int32)
    if len(tokens) > max_prompt_len:
      stats.too_long += 1
      continue
    kept.append(PromptSpec(prompt_id=r.index, tokens=tokens, answer=r.answer))
  if heldout >= len(kept):
    raise DataError(f"held-out size {heldout} needs more than the {len(kept)} prompts left after "
                    f"filtering ({stats.too_long} longer than {max_prompt_len} tokens, "
                    f"{stats.duplicates} duplicates)")
  order = np.random.default_rng(seed).permutation(len(kept))
  held_idx = set(order[:heldout].tolist())
  held = [kept[i] for i in sorted(held_idx)]
  train = [p for i, p in enumerate(kept) if i not in held_idx]
  assert not {p.prompt_id for p in held} & {p.prompt_id for p in train}
  stats.train, stats.heldout = len(train), len(held)
  return train, held, stats
