"""The shared SFT warm-start cache (`sft.cache_dir` / $SCALERL_SFT_CACHE_DIR): a second run with
the same model, sft, data and seed loads the first run's policy instead of training again, bit
for bit; any change to those sections is a different entry; a gs:// cache is refused."""
import json
import os

import jax
import numpy as np
import pytest

from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax.training import sft
from scalerl_jax.data import build_dataset


def _config(cache):
  c = tiny.get_config()
  c.sft.clean_steps, c.sft.steps, c.sft.num_examples, c.sft.batch_size = 2, 2, 64, 16
  c.sft.cache_dir = str(cache)
  return c


def test_second_warm_start_reuses_the_first_bit_for_bit(tmp_path, monkeypatch):
  monkeypatch.delenv("SCALERL_SFT_CACHE_DIR", raising=False)
  c = _config(tmp_path / "cache")
  model_cfg = model_sections.model_config(c)
  ds = build_dataset(c.data, c.rollout.max_prompt_len)
  p1, info1 = sft.warm_start(c, model_cfg, ds, str(tmp_path / "run1"), progress=False)
  assert info1["sft_cached"] is False and "sft_cache" not in info1
  entry = sft.cache_entry(c)
  assert os.path.dirname(entry) == str(tmp_path / "cache")
  assert json.load(open(os.path.join(entry, "sft_info.json")))["sft_steps"] == 2

  def no_training(*a, **k):
    raise AssertionError("trained again despite a cached warm start")
  monkeypatch.setattr(sft, "train_sft", no_training)
  p2, info2 = sft.warm_start(c, model_cfg, ds, str(tmp_path / "run2"), progress=False)
  assert info2["sft_cache"] == entry and info2["sft_final_loss"] == info1["sft_final_loss"]
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert os.path.exists(tmp_path / "run2" / sft.BASE_DIR / "config.json")   # the run's own copy


def test_entries_differ_when_anything_the_warm_start_reads_differs(tmp_path, monkeypatch):
  monkeypatch.delenv("SCALERL_SFT_CACHE_DIR", raising=False)
  base = _config(tmp_path)
  keys = {sft.cache_entry(base)}
  for change in (lambda c: setattr(c, "seed", c.seed + 1),
                 lambda c: setattr(c.sft, "steps", 3),
                 lambda c: setattr(c.model, "d_model", 64),
                 lambda c: setattr(c.data, "split_seed", c.data.split_seed + 1)):
    c = _config(tmp_path)
    change(c)
    keys.add(sft.cache_entry(c))
  assert len(keys) == 5
  c = _config(tmp_path)
  c.sft.cache_dir = ""
  assert sft.cache_entry(c) == ""                       # no cache unless asked for
  monkeypatch.setenv("SCALERL_SFT_CACHE_DIR", str(tmp_path / "env"))
  assert sft.cache_entry(c).startswith(str(tmp_path / "env"))
  c.sft.cache_dir = "gs://bucket/sft"
  with pytest.raises(ValueError, match="must be a local directory"):
    sft.cache_entry(c)
