"""The end-of-run HF export where each process writes its own share (models/hf_export.py).

* One process: `to_hf` inverts every `Source` (plain, transposed, reshaped, the fused gate_up
  halves, scanned stacks) bit for bit against `hf_io.hf_named_arrays`; `save_hf_sharded` of params
  on an 8-device mesh loads back bit-identical and equals `save_hf`'s tensors.
* Two `jax.distributed` CPU processes (2 devices each, gloo): each writes only its own file; the
  union is bit-identical to the gathered params; each process writes about half the bytes and never
  holds more than one tensor + one source slice. With a layout where each process holds whole
  tensors (data-parallel across processes) nothing crosses processes at all.

This file is also the worker: `python tests/models/test_hf_export.py worker MESH OUT`.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # also run as a script
from helpers import finish, free_port, start, xla_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MESHES = {   # process 0 has devices 0-1, process 1 devices 2-3 (make_mesh keeps jax.devices()' order)
    "split": (("data", 1), ("fsdp", 2), ("tensor", 2), ("expert", 1)),   # fsdp across processes
    "local": (("data", 2), ("fsdp", 2), ("tensor", 1), ("expert", 1)),   # each process: a replica
}


def _cfg(scan: bool):
  from scalerl_jax import models
  return models.get_preset("tiny_llama4", num_layers=4, vocab_size=96, d_model=64, head_dim=16,
                           ffn_dim=96, expert_ffn_dim=32, scan_layers=scan)


def _bits(a):
  a = np.ascontiguousarray(a)
  return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def _assert_same(got: dict, want: dict):
  import jax
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize("scan", [False, True])
def test_to_hf_inverts_every_source_bit_for_bit(scan):
  import jax
  from scalerl_jax import models
  from scalerl_jax.models import hf_export, hf_io
  cfg = _cfg(scan)
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(3)))
  want = dict(hf_io.hf_named_arrays(cfg, params))
  leaves = jax.tree.leaves(params)
  parts = hf_export.plan(cfg, leaves)
  assert sorted(p.name for p in parts) == sorted(want)
  assert any(len(p.srcs) == 2 for p in parts)            # the fused gate_up_proj
  for p in parts:
    blocks = [leaves[i] if b is None else leaves[i][b] for i, b, _ in p.srcs]
    got = hf_export.to_hf(p, blocks, np.float32)
    assert got.shape == want[p.name].shape and np.array_equal(_bits(got), _bits(want[p.name]))


def _run(tmp_path, mesh, processes):
  """This file's worker as `processes` processes of one job (4 CPU devices in all) on the meshes
  `mesh` (comma-separated) -> (the export root, each process's {mesh: stats})."""
  port = free_port()
  out = str(tmp_path / "exports")
  env = dict(os.environ, XLA_FLAGS=xla_flags(4 // processes), JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  if processes > 1:
    env.update(SCALERL_COORDINATOR=f"127.0.0.1:{port}", SCALERL_NUM_PROCESSES=str(processes))
  procs = [start([sys.executable, os.path.abspath(__file__), "worker", mesh, out],
                 str(tmp_path / f"p{i}"), cwd=ROOT, env=dict(env, SCALERL_PROCESS_ID=str(i)))
           for i in range(processes)]
  outs = []
  for rc, so, se in finish(procs, timeout=600):
    assert rc == 0, se[-4000:]
    outs.append(json.loads(so.strip().splitlines()[-1]))
  print(f"\n[hf_export {mesh} x{processes}] {outs}")
  return out, outs


def _check_bits(out):
  """The export loads back bit for bit equal to the gathered params the worker saved."""
  import jax
  from scalerl_jax.models import hf_io
  cfg, got = hf_io.load_hf(out, scan_layers=True)
  ref = np.load(out + ".ref.npz")
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(got)[0]}
  assert sorted(flat) == sorted(ref.files)
  for k in ref.files:
    assert flat[k].dtype == ref[k].dtype and np.array_equal(_bits(flat[k]), _bits(ref[k])), k
  assert cfg.num_layers == _cfg(True).num_layers


@pytest.mark.slow
@pytest.mark.xdist_group("hf_export")
def test_one_process_sharded_params_export_equals_save_hf(tmp_path):
  from scalerl_jax.models import hf_io
  root, res = _run(tmp_path, "split", 1)
  out, o = os.path.join(root, "split"), res[0]["split"]
  assert o["files"] == [hf_io.SINGLE_FILE] and o["gathered"] == 0
  assert o["written"] == o["total"] and o["peak"] < o["total"] / 4
  _check_bits(out)
  a, b = hf_io.SafetensorsDir(out), hf_io.SafetensorsDir(out + ".save_hf")
  assert sorted(a.keys()) == sorted(b.keys())
  for k in b.keys():
    assert np.array_equal(_bits(a.get(k)), _bits(b.get(k))), k
  assert json.load(open(os.path.join(out, "config.json"))) == \
      json.load(open(os.path.join(out + ".save_hf", "config.json")))
  assert not os.path.exists(os.path.join(out, hf_io.INDEX_FILE))


def _worker(mesh_names, out_root):
  """Exports the same params on each mesh of `mesh_names` (comma-separated) to OUT_ROOT/MESH;
  process 0 saves the gathered params beside it (the reference). Last line: {mesh: stats}."""
  from scalerl_jax import distributed
  distributed.initialize()
  import jax
  from scalerl_jax.config import DEFAULT_RULES
  from scalerl_jax import sharding
  from scalerl_jax.models import hf_export, hf_io
  cfg = _cfg(True)
  res = {}
  for name in mesh_names.split(","):
    out = os.path.join(out_root, name)
    mesh = sharding.make_mesh(MESHES[name])
    params, _ = sharding.sharded_init(cfg, jax.random.PRNGKey(7), mesh, DEFAULT_RULES)
    st = hf_export.save_hf_sharded(cfg, params, out)
    full = distributed.gather_to_host(params)     # the reference only (the test's, not the export's)
    if jax.process_index() == 0:
      flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(full)[0]}
      np.savez(out + ".ref.npz", **flat)
      if jax.process_count() == 1:     # the gathering writer, for comparison
        hf_io.save_hf(cfg, full, out + ".save_hf")
    leaves = jax.tree.leaves(full)
    biggest = max(int(np.prod(p.hf_shape)) for p in hf_export.plan(cfg, leaves)) * 4
    res[name] = dict(process=jax.process_index(), written=st.written_bytes, local=st.local_bytes,
                     gathered=st.gathered_bytes, peak=st.peak_bytes, tensors=st.tensors,
                     files=st.files, biggest=biggest, total=sum(int(a.nbytes) for a in leaves))
  print(json.dumps(res), flush=True)


@pytest.mark.slow
@pytest.mark.xdist_group("hf_export")
def test_two_processes_each_write_their_share_bit_identical(tmp_path):
  root, res = _run(tmp_path, "split,local", 2)
  for mesh in ("split", "local"):
    _check_share(os.path.join(root, mesh), mesh, [r[mesh] for r in res])


def _check_share(out, mesh, outs):
  from scalerl_jax.models import hf_io
  total = outs[0]["total"]
  # each process wrote its own file; together every byte once, about half each
  assert [o["files"] for o in outs] == [["model-00001-of-00002.safetensors"],
                                        ["model-00002-of-00002.safetensors"]]
  assert sum(o["written"] for o in outs) == total
  assert all(0.3 * total < o["written"] < 0.7 * total for o in outs), outs
  # never more than one tensor + its source slice(s) held at once: far from the whole model
  assert all(o["peak"] <= 2 * o["biggest"] < total / 4 for o in outs), outs
  if mesh == "local":   # each process holds whole tensors: nothing crosses processes
    assert all(o["gathered"] == 0 and o["local"] == o["written"] for o in outs), outs
  else:                 # split tensors arrive one slice at a time; held ones are assembled locally
    assert all(o["gathered"] > 0 and o["local"] > 0 for o in outs), outs
  index = json.load(open(os.path.join(out, hf_io.INDEX_FILE)))
  assert index["metadata"]["total_size"] == total
  assert sorted(set(index["weight_map"].values())) == [f for o in outs for f in o["files"]]
  _check_bits(out)


if __name__ == "__main__":
  if sys.argv[1] == "worker":
    _worker(*sys.argv[2:4])
