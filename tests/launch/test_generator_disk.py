"""The generator pods' ephemeral-storage request (launch/sizing.py::generator_disk_bytes, rendered by
launch/gke/render.py, checked by launch/preflight.py::check_generator_disk): checkpoint copy + HF
export + logs, x DISK_MARGIN, re-derived here from the model's parameter count (the sum of the
init_params leaves' sizes on abstract shapes) and the engine's bytes per weight."""
import math
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from scalerl_jax.models import sections as model_sections
from configs import tiny
from launch import sizing
from launch.preflight import Report, check_generator_disk
from scalerl_jax import models

GIB = 2 ** 30


def _params(c) -> int:
  shapes = jax.eval_shape(lambda: models.init_params(model_sections.model_config(c), jax.random.PRNGKey(0)))
  return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(shapes)))


@pytest.mark.parametrize("ckpt, dtype, copy, export", [
    ("", "bfloat16", 0, 2), ("", "float32", 0, 4),              # exported from fetched weights
    ("gs://bucket/ckpt", "bfloat16", 2, 0),                     # copied to local disk
    ("/data/ckpt", "bfloat16", 0, 0)])                          # read from the data volume
def test_generator_disk_is_copy_plus_export_plus_logs(ckpt, dtype, copy, export):
  c = tiny.get_config()
  c.model.dtype = dtype
  n = _params(c)
  c.model.hf_checkpoint = ckpt
  d = sizing.generator_disk_bytes(c)
  assert (d["copy"], d["export"], d["logs"]) == (copy * n, export * n, 2 * GIB)
  assert d["node_copy"] == 0
  assert d["total"] == (copy + export) * n + 2 * GIB
  assert d["request_gib"] == math.ceil(((copy + export) * n + 2 * GIB) * 1.2 / GIB)


def test_a_node_cache_moves_the_copy_out_of_the_pod_request():
  c = tiny.get_config()
  n = _params(c)
  c.model.dtype = "bfloat16"
  c.model.hf_checkpoint, c.generator.ckpt_cache_dir = "gs://bucket/ckpt", "/var/cache/ckpt"
  d = sizing.generator_disk_bytes(c)
  assert (d["copy"], d["node_copy"], d["export"]) == (0, 2 * n, 0)    # bf16: 2 bytes a param
  assert d["total"] == 2 * GIB and d["request_gib"] == math.ceil(2 * 1.2)


def test_preflight_fails_a_request_below_what_the_pod_writes():
  c = tiny.get_config()
  need = sizing.generator_disk_bytes(c)["total"]
  for q, ok in ((f"{math.ceil(need / GIB)}Gi", True), (f"{need // GIB - 1}Gi", False)):
    r = Report("v")
    check_generator_disk(r, c, {"resources": {"requests": {"ephemeral-storage": q}}})
    assert (not r.failures) is ok, (q, r.failures)


def test_rendered_generators_request_the_sized_disk():
  root = Path(__file__).resolve().parents[2] / "launch" / "gke" / "rendered"
  seen = 0
  for f in sorted(root.glob("*/generators.yaml")):
    for doc in yaml.safe_load_all(f.read_text()):
      if doc and doc.get("kind") == "Deployment":
        c = doc["spec"]["template"]["spec"]["containers"][0]
        # every committed variant starts vLLM from the checkpoint on the data volume: logs only,
        # 2 GiB x 1.2 -> 3 GiB
        assert c["resources"]["requests"]["ephemeral-storage"] == f"{math.ceil(2 * 1.2)}Gi"
        seen += 1
  assert seen >= 4
