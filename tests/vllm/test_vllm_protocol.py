"""Fast tests of the vLLM worker's wire protocol and pure helpers (no vLLM engine needed)."""
import os
import socket

import numpy as np
import pytest

from scalerl_jax.generation.vllm import protocol as P
from scalerl_jax.generation.interruption import think_budget
from scalerl_jax.generation.vllm.worker import find_subsequence, request_seed


def test_frame_roundtrip_keeps_dtypes_shapes_and_values():
  a, b = socket.socketpair()
  arrays = {"f": np.arange(12, dtype=np.float32).reshape(3, 4), "i": np.array([1, -2], np.int32),
            "m": np.array([True, False, True]), "e": np.zeros((0, 5), np.float32),
            "big_endian": np.arange(3, dtype=">f4")}
  n = P.send_msg(a, {"op": "x", "id": 7, "nested": {"k": [1, 2]}}, arrays)
  header, got = P.recv_msg(b)
  assert header["op"] == "x" and header["id"] == 7 and header["nested"] == {"k": [1, 2]}
  assert n > sum(v.nbytes for v in arrays.values())
  for k, v in arrays.items():
    assert got[k].shape == v.shape
    np.testing.assert_array_equal(got[k], v)
  assert got["big_endian"].dtype == np.dtype("<f4")
  a.close(), b.close()


def test_bad_magic_and_inconsistent_header_are_rejected():
  with pytest.raises(P.ProtocolError, match="bad magic"):
    P.parse_prefix(b"XXXX" + bytes(12))
  head = b'{"op":"x","arrays":[{"name":"a","dtype":"float32","shape":[4],"offset":0,"nbytes":8}]}'
  with pytest.raises(P.ProtocolError, match="inconsistent"):
    P.decode(head, bytes(8))
  with pytest.raises(P.ProtocolError, match="not supported"):
    P.encode({"op": "x"}, {"c": np.zeros(2, np.complex64)})


def test_bf16_wire_conversion_is_bit_identical_to_torch():
  torch = pytest.importorskip("torch")
  rng = np.random.default_rng(0)
  x = (rng.standard_normal(200_000) * 10.0 ** rng.integers(-30, 30, 200_000)).astype(np.float32)
  x[:4] = [0.0, -0.0, np.inf, -np.inf]
  x[4:9] = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000],   # ties, max,
                    np.uint32).view(np.float32)                                    # subnormal
  ours = P.f32_to_bf16_bits(x)
  ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
  np.testing.assert_array_equal(ours, ref)                          # ml_dtypes path
  np.testing.assert_array_equal(P._f32_to_bf16_bits_np(x), ref)     # the NumPy fallback (vLLM venv)
  nan = np.array([np.nan, -np.nan], np.float32)
  np.testing.assert_array_equal(P.f32_to_bf16_bits(nan), P._f32_to_bf16_bits_np(nan))
  np.testing.assert_array_equal(P.bf16_bits_to_f32(ours),
                                torch.from_numpy(x).to(torch.bfloat16).float().numpy())
  a, b = socket.socketpair()
  P.send_msg(a, {"op": "w", "id": 1}, {"w": x[:1000]}, dtypes={"w": "bfloat16"})
  header, got = P.recv_msg(b)
  assert header["arrays"][0]["dtype"] == "bfloat16" and header["arrays"][0]["nbytes"] == 2000
  np.testing.assert_array_equal(got["w"], ours[:1000])


def test_chunk_weights_respects_budget_and_order():
  w = [(f"p{i}", np.zeros(250, np.float32)) for i in range(10)]   # 1000 bytes each
  chunks = list(P.chunk_weights(w, 2500))
  assert [len(c) for c in chunks] == [2, 2, 2, 2, 2]
  assert [n for c in chunks for n, _ in c] == [f"p{i}" for i in range(10)]
  assert [len(c) for c in P.chunk_weights(dict(w), 10)] == [1] * 10   # oversize tensors go alone


def test_interruption_helpers():
  assert find_subsequence([5, 1, 2, 3, 1, 2], [1, 2]) == 3
  assert find_subsequence([5, 1, 3], [1, 2]) == -1
  assert find_subsequence([1, 2], []) == -1
  spec = {"think_budget_min": 10, "think_budget_max": 20, "seed": 3}
  draw = lambda s, pid, j: think_budget(s["seed"], pid, j, s["think_budget_min"],
                                        s["think_budget_max"])      # what the worker calls
  budgets = [draw(spec, pid, j) for pid in range(50) for j in range(4)]
  assert min(budgets) >= 10 and max(budgets) <= 20 and len(set(budgets)) > 5
  assert budgets == [draw(spec, pid, j) for pid in range(50) for j in range(4)]
  assert draw({**spec, "think_budget_min": 7, "think_budget_max": 7}, 0, 0) == 7
  with pytest.raises(ValueError):
    draw({**spec, "think_budget_max": 5}, 0, 0)
  assert request_seed(spec, 1, 0, 0) != request_seed(spec, 1, 1, 0) != request_seed(spec, 1, 1, 1)


def test_shm_slots_roundtrip_and_reject_paths():
  """ShmSlots writes (with the bf16 cast fused) what read_shm maps back; paths outside /dev/shm
  and inconsistent metadata are refused."""
  slots = P.ShmSlots(2)
  try:
    x = np.random.default_rng(0).standard_normal((33, 7)).astype(np.float32)
    y = np.arange(10, dtype=np.int32)
    t = np.random.default_rng(1).standard_normal((5, 12)).astype(np.float32).T   # a [12, 5] view
    path, metas = slots.write(3, [("x", x), ("y", y), ("t", t), ("tb", t)],
                              {"x": "bfloat16", "tb": "bfloat16"})
    assert path == slots.slots[1]["path"] and all(m["offset"] % 64 == 0 for m in metas)
    assert [m.get("transposed", False) for m in metas] == [False, False, True, True]
    got = P.read_shm(path, metas)
    assert np.array_equal(got["x"], P.f32_to_bf16_bits(x)) and np.array_equal(got["y"], y)
    assert got["t"].shape == (12, 5) and np.array_equal(got["t"], t)
    assert np.array_equal(got["tb"], P.f32_to_bf16_bits(np.ascontiguousarray(t)))
    with pytest.raises(P.ProtocolError):
      P.read_shm("/etc/passwd", metas)
    with pytest.raises(P.ProtocolError):
      P.read_shm(path, [dict(metas[1], nbytes=999)])
  finally:
    slots.close()
  assert not os.path.exists(path)


def test_repo_root_and_vllm_venv_path_point_at_this_checkout():
  """The vLLM client finds the repo (PYTHONPATH for the engine process) and .venv-vllm from its own
  file location: a package move once left them pointing inside scalerl_jax/."""
  import pathlib
  from scalerl_jax.generation.vllm.generator import REPO_ROOT, vllm_python
  here = pathlib.Path(__file__).resolve().parents[2]
  assert REPO_ROOT == here and (REPO_ROOT / "scalerl_jax" / "__init__.py").exists()
  assert vllm_python() == here / ".venv-vllm" / "bin" / "python"
