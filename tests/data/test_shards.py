"""Issue 46: a data path may be one file, a directory of shards or a glob of them (local here;
gs:// goes through the same storage calls: listdir / isdir / isfile), as DeepCoder ships its
splits; the records are the shards' in file order."""
import json

import pytest

from scalerl_jax.data import loaders


def _shards(d):
  pq = pytest.importorskip("pyarrow.parquet")
  import pyarrow as pa
  d.mkdir()
  for k in range(3):
    rows = [{"problem": f"p{k}-{i}", "answer": str(k * 10 + i)} for i in range(4)]
    pq.write_table(pa.Table.from_pylist(rows), str(d / f"train-{k:05d}-of-00003.parquet"))
  (d / "README.md").write_text("not data")
  return [f"p{k}-{i}" for k in range(3) for i in range(4)]


def test_a_directory_or_a_glob_of_parquet_shards_reads_every_shard_in_order(tmp_path):
  want = _shards(tmp_path / "deepcoder")
  for path in (str(tmp_path / "deepcoder"), str(tmp_path / "deepcoder") + "/",
               str(tmp_path / "deepcoder" / "train-*.parquet")):
    assert [r.problem for r in loaders.load_math(path)] == want, path
  one = str(tmp_path / "deepcoder" / "train-00001-of-00003.parquet")
  assert [r.problem for r in loaders.load_math(one)] == want[4:8]
  mixed = tmp_path / "mixed"
  mixed.mkdir()
  (mixed / "a.jsonl").write_text(json.dumps({"problem": "j", "answer": "1"}) + "\n")
  assert [r.problem for r in loaders.load_math(str(mixed))] == ["j"]
  for bad in (str(tmp_path / "deepcoder" / "test-*.parquet"), str(tmp_path / "nothing")):
    with pytest.raises(FileNotFoundError, match="names no data file"):
      loaders.load_math(bad)
