"""Start from a checkpoint (model.hf_checkpoint; models/hf_slices.py, sft.start_from_checkpoint).

A real-format miniature Llama-3.1 checkpoint (random `LlamaForCausalLM` from transformers, rope
llama3, saved in bf16 by `save_pretrained` as an index + >= 3 shards) is loaded by 2 JAX processes
x 4 CPU devices (mesh fsdp=4 x tensor=2) through `sft.warm_start`, each reading only its slices:

* every addressable shard equals transformers' own load of the checkpoint after the same dtype
  conversion (bf16 -> f32), bit for bit, mapped to our layout by an explicit reference here;
* each process's peak RSS growth during the load is <= 2x the bytes its devices hold;
* the same from a gs:// copy in a GCS emulator (ranged reads; nothing copied locally), where data
  files (jsonl, parquet) load from gs:// too.

Scout's multimodal layout (Llama4ForConditionalGeneration: `language_model.` prefix, vision tower,
fused experts.gate_up_proj) loads in one process, bf16 and fp32 checkpoints.

This file is also the worker: `python tests/training/test_ckpt_start.py worker CKPT REF_DIR OUT.json`.
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from gcs_emulator import emulator_in_this_process  # noqa: E402
from helpers import finish, free_port, start, xla_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "scalerl-ckpt"
MESH = (("data", 1), ("fsdp", 4), ("tensor", 2), ("expert", 1))
# Llama-3.1 architecture (GQA 4:1, ffn 3.5 x d_model, rope llama3), widths shrunk: 44 M params.
LLAMA31 = dict(vocab_size=16384, hidden_size=512, intermediate_size=1792, num_hidden_layers=8,
               num_attention_heads=8, num_key_value_heads=2, head_dim=64,
               max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
               tie_word_embeddings=False, bos_token_id=1, eos_token_id=[2, 3])


def _randomize(model, seed):
  import torch
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():   # norms too, so a wrong norm mapping cannot hide
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.02 * torch.randn_like(p))
  return model


@pytest.fixture(scope="module")
def llama31_ckpt(tmp_path_factory):
  import torch
  import transformers
  path = str(tmp_path_factory.mktemp("llama31") / "ckpt")
  model = _randomize(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA31)), 0)
  model.to(torch.bfloat16).save_pretrained(path, max_shard_size="30MB")
  return path


# ------------------------------------------------------------------ reference (explicit layout)
def _ref_layer(cfg, sd, i, ff="mlp."):
  """Our layout of layer i from HF tensors, written out by hand (independent of hf_io.Source)."""
  D, N, K, H = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = f"model.layers.{i}."
  t = {"attn": {"q": sd[p + "self_attn.q_proj.weight"].T.reshape(D, N, H),
                "k": sd[p + "self_attn.k_proj.weight"].T.reshape(D, K, H),
                "v": sd[p + "self_attn.v_proj.weight"].T.reshape(D, K, H),
                "o": sd[p + "self_attn.o_proj.weight"].T.reshape(N, H, D)},
       "attn_norm": {"scale": sd[p + "input_layernorm.weight"]},
       "ffn_norm": {"scale": sd[p + "post_attention_layernorm.weight"]}}
  if cfg.layer_is_moe(i):
    F = cfg.expert_ffn_dim
    gu = sd[p + ff + "experts.gate_up_proj"]
    t["moe"] = {"router": sd[p + ff + "router.weight"].T, "gate": gu[..., :F], "up": gu[..., F:],
                "down": sd[p + ff + "experts.down_proj"],
                "shared": {n: sd[p + ff + f"shared_expert.{n}_proj.weight"].T
                           for n in ("gate", "up", "down")}}
  else:
    t["mlp"] = {n: sd[p + ff + f"{n}_proj.weight"].T for n in ("gate", "up", "down")}
  return t


def _ref_params(cfg, sd, ff="mlp."):
  """{keystr path: array} of our params (scanned or not) from HF tensors."""
  import jax
  top = {"embed": sd["model.embed_tokens.weight"], "final_norm": {"scale": sd["model.norm.weight"]},
         "lm_head": sd["lm_head.weight"].T}
  layers = [_ref_layer(cfg, sd, i, ff) for i in range(cfg.num_layers)]
  if cfg.scan_layers:
    p = cfg.scan_period
    top["blocks"] = {f"layer_{j}": jax.tree.map(lambda *xs: np.stack(xs), *layers[j::p])
                     for j in range(p)}
  else:
    top.update({f"layers_{i}": t for i, t in enumerate(layers)})
  return {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(top)[0]}


def _status(key):
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(key + ":"):
        return int(line.split()[1]) * 1024
  raise KeyError(key)


# ------------------------------------------------------------------ the 2-process worker
def _worker(ckpt, ref_dir, out_path):
  from scalerl_jax import distributed
  distributed.initialize()
  import jax
  from scalerl_jax.config import base_config
  from scalerl_jax import sharding
  from scalerl_jax.models import sections as model_sections
  from scalerl_jax.training import sft
  config = base_config()
  config.model.hf_checkpoint = ckpt
  config.mesh.shape = MESH
  cfg = model_sections.model_config(config)              # architecture from CKPT/config.json (gs:// too)
  assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
  # warm-up outside the measurement: the runtime's first allocations, tracing the shardings
  mesh = sharding.make_mesh(config.mesh.shape)
  sharding.param_shardings(cfg, mesh, config.mesh.rules)
  one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
  jax.block_until_ready(jax.make_array_from_callback((8,), one, lambda i: np.zeros(8)[i]))
  try:                                            # peak RSS := current RSS (Linux >= 4.0)
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    reset = True
  except OSError:
    reset = False
  before = _status("VmRSS")
  params, info = sft.warm_start(config, cfg, None, os.path.dirname(out_path), progress=False)
  jax.block_until_ready(params)
  peak = _status("VmHWM")
  # Reference: transformers' own load of the (local) checkpoint, bf16 -> float32.
  import torch
  import transformers
  hf = transformers.LlamaForCausalLM.from_pretrained(ref_dir, dtype=torch.bfloat16)
  ref = _ref_params(cfg, {k: v.float().numpy() for k, v in hf.state_dict().items()})
  flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  checked, bad = 0, []
  for k, x in flat.items():
    for s in x.addressable_shards:
      checked += 1
      got = np.asarray(s.data)
      if got.dtype != np.float32 or not np.array_equal(got, ref[k][s.index]):
        bad.append(k)
  out = dict(process=jax.process_index(), info={k: v for k, v in info.items()},
             leaves=len(flat), keys_equal=sorted(flat) == sorted(ref), checked=checked, bad=bad,
             shard_sharded=sum(not x.sharding.is_fully_replicated for x in flat.values()),
             rss_before=before, peak=peak, growth=peak - before, reset=reset,
             param_bytes=int(sum(x.nbytes for x in flat.values())))
  with open(out_path, "w") as f:
    json.dump(out, f)
  print(json.dumps(out))


def _env(**extra):
  env = dict(os.environ, XLA_FLAGS=xla_flags(4),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _run_two(ckpt, ref_dir, tmp_path, **env):
  port = free_port()
  outs = [str(tmp_path / f"p{i}" / "out.json") for i in range(2)]
  for o in outs:
    os.makedirs(os.path.dirname(o), exist_ok=True)
  res = finish([start([sys.executable, os.path.abspath(__file__), "worker", ckpt, ref_dir, outs[i]],
                      str(tmp_path / f"p{i}" / "log"), cwd=ROOT,
                      env=_env(SCALERL_COORDINATOR=f"127.0.0.1:{port}", SCALERL_NUM_PROCESSES=2,
                               SCALERL_PROCESS_ID=i, **env)) for i in range(2)], timeout=600)
  for rc, _, err in res:
    assert rc == 0, err[-4000:]
  return [json.load(open(o)) for o in outs]


def _ckpt_bytes(path):
  return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
             if f.endswith(".safetensors"))


def _check(outs, ckpt_bytes):
  for o in outs:
    i = o["info"]
    mb = lambda x: f"{x / 1e6:.1f} MB"
    print(f"\n[process {o['process']}] holds {mb(i['local_param_bytes'])} of {mb(o['param_bytes'])}"
          f" params; RSS {mb(o['rss_before'])} -> peak {mb(o['peak'])} (growth {mb(o['growth'])}"
          f" = {o['growth'] / i['local_param_bytes']:.2f}x its share); read {mb(i['bytes_read'])}"
          f" of {mb(ckpt_bytes)} in {i['requests']} requests, {i['seconds']:.2f} s")
    assert o["keys_equal"] and o["bad"] == [], o["bad"][:5]
    assert o["checked"] == 4 * o["leaves"] and o["shard_sharded"] >= 9
    assert i["start"] == "hf_checkpoint"
    # its devices hold half of the (f32) params, plus the replicated norms
    assert 0.5 <= i["local_param_bytes"] / o["param_bytes"] <= 0.51
    assert o["reset"] and o["growth"] <= 2 * i["local_param_bytes"], o
  assert sorted(o["process"] for o in outs) == [0, 1]


@pytest.mark.slow
@pytest.mark.xdist_group("ckpt_start")
def test_two_processes_load_their_slices_of_a_llama31_checkpoint(llama31_ckpt, tmp_path):
  names = os.listdir(llama31_ckpt)
  assert "model.safetensors.index.json" in names
  assert sum(n.endswith(".safetensors") for n in names) >= 3
  hf_cfg = json.load(open(os.path.join(llama31_ckpt, "config.json")))
  rope = hf_cfg.get("rope_parameters") or hf_cfg["rope_scaling"]   # transformers 5 / 4 name
  assert rope["rope_type"] == "llama3" and hf_cfg["dtype"] == "bfloat16"
  outs = _run_two(llama31_ckpt, llama31_ckpt, tmp_path)
  total = _ckpt_bytes(llama31_ckpt)
  _check(outs, total)
  for o in outs:   # local reads are exact: its half of the bf16 tensors (+ replicated norms)
    assert o["info"]["bytes_read"] <= 0.51 * total, o["info"]


@pytest.mark.slow
@pytest.mark.xdist_group("ckpt_start")
def test_same_from_a_gcs_copy_and_data_from_gcs(llama31_ckpt, tmp_path):
  from scalerl_jax import storage
  from scalerl_jax.data import loaders
  with emulator_in_this_process(str(tmp_path), BUCKET) as url:
    remote = f"gs://{BUCKET}/ckpt/llama31"
    storage.copy_tree(llama31_ckpt, remote, last=("config.json",))
    # data files on gs:// (jsonl and parquet) load through storage
    recs = [{"problem": f"p{i}", "answer": str(i)} for i in range(3)]
    storage.write_text(f"gs://{BUCKET}/data/m.jsonl", "".join(json.dumps(r) + "\n" for r in recs))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(recs), str(tmp_path / "m.parquet"))
    storage.copy_tree(str(tmp_path), f"gs://{BUCKET}/data2")   # includes m.parquet
    for p in (f"gs://{BUCKET}/data/m.jsonl", f"gs://{BUCKET}/data2/m.parquet"):
      assert [(r.problem, r.answer) for r in loaders.load_math(p)] == \
          [(r["problem"], r["answer"]) for r in recs]
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k in ("TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    outs = _run_two(remote, llama31_ckpt, tmp_path, STORAGE_EMULATOR_HOST=url,
                    TMPDIR=str(tmpdir), **env)
  total = _ckpt_bytes(llama31_ckpt)
  _check(outs, total)
  for o in outs:   # ranged reads: never more than one copy's bytes, nothing written locally
    assert o["info"]["bytes_read"] <= total, o["info"]
  local = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(tmpdir) for f in fs)
  assert local < 1 << 20, local


# ------------------------------------------------------------------ Scout's multimodal layout
@pytest.mark.parametrize("stored,param_dtype", [("bfloat16", "float32"), ("float32", "bfloat16")])
def test_llama4_multimodal_checkpoint(tmp_path, stored, param_dtype):
  """Llama4ForConditionalGeneration (Scout's layout): text weights under `language_model.`, the
  vision tower and projector skipped (never read), fused gate_up_proj split into gate / up."""
  import jax
  import ml_dtypes
  import torch
  import transformers
  from scalerl_jax import models, sharding
  from scalerl_jax.models import hf_io, hf_slices
  cfg = models.get_preset("tiny_llama4", vocab_size=512, d_model=64, head_dim=16, ffn_dim=96,
                          expert_ffn_dim=32, num_layers=4, attention_chunk_size=16)
  vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14, vision_output_dim=32, projector_input_dim=32,
                projector_output_dim=32)
  hf = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
      text_config=models.to_hf_config(cfg).to_dict(), vision_config=vision))
  _randomize(hf, 1)
  tdt = torch.bfloat16 if stored == "bfloat16" else torch.float32
  hf.to(tdt).save_pretrained(str(tmp_path), max_shard_size="200KB")
  names = os.listdir(tmp_path)
  assert sum(n.endswith(".safetensors") for n in names) >= 3
  ck = hf_slices.HFCheckpoint(str(tmp_path))
  assert ck.prefix == "language_model."
  vision_keys = [k for k in ck.keys() if not k.startswith("language_model.")]
  assert any(k.startswith("vision_model.") for k in vision_keys)
  got_cfg = ck.model_config(param_dtype=param_dtype, scan_layers=True)
  assert (got_cfg.family, got_cfg.num_experts, got_cfg.d_model, got_cfg.num_layers) == \
      ("llama4", cfg.num_experts, 64, 4) and got_cfg.param_dtype == param_dtype
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  params, stats = hf_slices.load_sharded(ck, got_cfg, jax.tree.map(
      lambda _: one, sharding.abstract_params(got_cfg)))
  # Reference: transformers' state_dict, cast like the load (torch's rounding for f32 -> bf16).
  sd = {k[len("language_model."):]: v.to(torch.bfloat16 if param_dtype == "bfloat16"
                                          else torch.float32).float().numpy()
        for k, v in hf.state_dict().items() if k.startswith("language_model.")}
  ref = _ref_params(got_cfg, sd, ff="feed_forward.")
  flat = {jax.tree_util.keystr(k): np.asarray(v)
          for k, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  assert sorted(flat) == sorted(ref)
  want = np.dtype(ml_dtypes.bfloat16) if param_dtype == "bfloat16" else np.dtype(np.float32)
  for k, v in flat.items():
    assert v.dtype == want and np.array_equal(v.astype(np.float32), ref[k]), k
  assert any("moe" in k for k in flat) and any("mlp" in k for k in flat)
  text_bytes = sum(ck.info(k[len("language_model."):])[1].nbytes
                   for k in ck.keys() if k.startswith("language_model."))
  assert stats["bytes_read"] == text_bytes      # every text byte once, no vision byte
  # Any box of any param reads right (slices of the fused / transposed / split tensors), with
  # exact runs and with gaps read through.
  rng = np.random.default_rng(0)
  srcs = hf_io.param_sources(got_cfg)
  is_src = lambda x: isinstance(x, (hf_io.Source, hf_io.Stacked))
  for path, s in jax.tree_util.tree_flatten_with_path(srcs, is_leaf=is_src)[0]:
    full = ref[jax.tree_util.keystr(path)]
    for b, src in enumerate(s.sources if isinstance(s, hf_io.Stacked) else [s]):
      layer = full[b] if isinstance(s, hf_io.Stacked) else full
      for gap in (0, 100, 1 << 20):
        ck.max_gap = gap
        box = [(a, int(rng.integers(a + 1, n + 1)))
               for a, n in ((int(rng.integers(0, n)), n) for n in src.shape)]
        part = ck.read_source_box(src, box).astype(want).astype(np.float32)
        exact = layer[tuple(slice(a, e) for a, e in box)]
        assert np.array_equal(part, exact), (path, box, gap)
  ck.close()


def test_vllm_generators_start_on_the_start_checkpoint(tmp_path):
  """Without generator.vllm_model_dir, a vLLM generator at version 0 starts on model.hf_checkpoint
  (a gs:// one through one copy per node: tests/core/test_node_cache.py); later versions and runs
  without a checkpoint export the fetched weights ("")."""
  from scalerl_jax.config import base_config
  from scalerl_jax.generation.vllm.engine import vllm_start_dir
  c = base_config()
  assert vllm_start_dir(c.model, c.generator, 0) == ""
  c.model.hf_checkpoint = str(tmp_path / "ckpt")
  assert vllm_start_dir(c.model, c.generator, 0) == str(tmp_path / "ckpt")
  assert vllm_start_dir(c.model, c.generator, 3) == ""


if __name__ == "__main__":
  if sys.argv[1] == "worker":
    _worker(*sys.argv[2:5])
