"""The vLLM generator's start-up HF export (generation/vllm/engine.py) is reused across restarts
while its checksum matches the fetched weights, and rewritten when they changed or a file of it
was damaged (generation/export_cache.py)."""
import hashlib
import logging
import os

import jax
import numpy as np

from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax import models
from scalerl_jax.generation.export_cache import MARKER, cached_export, params_digest


def _files(d):
  return {n: hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
          for n in sorted(os.listdir(d))}


def test_export_reused_when_the_checksum_matches_rewritten_when_the_source_changed(tmp_path, caplog):
  mcfg = model_sections.model_config(tiny.get_config())
  params = jax.device_get(models.init_params(mcfg, jax.random.PRNGKey(0)))
  d = str(tmp_path / "vllm_export")
  writes = []

  def write(out):
    writes.append(out)
    models.save_hf(mcfg, params_now, out, dtype="float32")

  params_now = params
  digest = params_digest(params, "float32")
  caplog.set_level(logging.INFO, logger="scalerl.export_cache")
  assert cached_export(d, digest, write) is True and len(writes) == 1
  first = _files(d)
  assert "config.json" in first and MARKER in first
  mtimes = {n: os.stat(os.path.join(d, n)).st_mtime_ns for n in first}
  # A restart with the same weights: nothing written, the same bytes, a log line says so.
  assert cached_export(d, params_digest(params, "float32"), write) is False and len(writes) == 1
  assert _files(d) == first
  assert {n: os.stat(os.path.join(d, n)).st_mtime_ns for n in first} == mtimes
  assert any("reused" in r.getMessage() for r in caplog.records)
  # The source changed (one weight): a new digest, rewritten, the export holds the new weights.
  leaves, tree = jax.tree_util.tree_flatten(params)
  changed = [np.array(x) for x in leaves]
  changed[0] = changed[0] + 1.0
  params_now = jax.tree_util.tree_unflatten(tree, changed)
  digest2 = params_digest(params_now, "float32")
  assert digest2 != digest
  assert cached_export(d, digest2, write) is True and len(writes) == 2
  second = _files(d)
  assert second[MARKER] != first[MARKER]
  assert [n for n in first if n != MARKER and first[n] != second[n]], "no weight file changed"
  # Same digest but a damaged file (a restart cut a copy short): rewritten too.
  big = max((n for n in second if n != MARKER), key=lambda n: os.path.getsize(os.path.join(d, n)))
  with open(os.path.join(d, big), "r+b") as f:
    f.truncate(10)
  assert cached_export(d, digest2, write) is True and len(writes) == 3
  assert _files(d) == second
  assert not os.path.exists(d + ".writing")


def test_digest_names_dtype_and_every_leaf():
  a = {"w": np.zeros((2, 3), np.float32), "b": {"x": np.arange(4, dtype=np.int32)}}
  base = params_digest(a, "bf16")
  assert params_digest(a, "bf16") == base
  assert params_digest(a, "float32") != base
  assert params_digest({**a, "w": np.zeros((3, 2), np.float32)}, "bf16") != base   # shape
  assert params_digest({**a, "w": np.zeros((2, 3), np.float64)}, "bf16") != base   # dtype
  b = {"w": a["w"].copy(), "b": {"x": a["b"]["x"].copy()}}
  b["b"]["x"][3] = 5
  assert params_digest(b, "bf16") != base
