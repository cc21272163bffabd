r"""A miniature real-format start checkpoint and data set that fit a rendered variant's layout.

  python -m launch.miniature launch/gke/rendered/8b-gb200 --out=/tmp/mini   # ckpt/ + polaris.parquet

For `python -m launch.rehearse DIR --real-shape`: the variant's learner mesh is kept, so the model
must divide it. Writes, offline (random weights, nothing downloaded):

* OUT/ckpt: a `save_pretrained` directory in the variant's model family, bf16, index + >= 3 shards:
  a random `LlamaForCausalLM` with a Llama-3.1 config.json (GQA, rope llama3 scaling, untied head)
  for a dense variant; a random `Llama4ForConditionalGeneration` (Scout's multimodal layout: text
  under `language_model.`, a tiny vision tower, fused experts) for an MoE one, with the variant's
  expert count. Widths are shrunk so that they still divide the layout's axes: kv heads a multiple
  of `tensor`, heads = 2 x kv heads, d_model = 256 (divides fsdp x expert), ffn 896, vocab 1024;
  depth 2 layers (4 for MoE: dense and MoE layers interleaved). Plus the Llama-3-style tokenizer
  files (data/tiny_hf_tokenizer.write_llama3_style_tokenizer) in the same directory, so the
  directory is both `model.hf_checkpoint` and `data.tokenizer_path`.
* OUT/polaris.parquet: Polaris-style rows (`problem`, `answer`), small integer sums.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import transformers

from launch import preflight
from scalerl_jax import models
from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 1024
D_MODEL = 256
FFN = 896


def widths(mesh: dict, num_experts: int = 0) -> dict:
  """Head / width numbers that divide `mesh` ({axis: size}): what the miniature model uses."""
  t = max(1, int(mesh.get("tensor", 1)))
  kv = max(2, t)
  heads = 2 * kv
  head_dim = max(8, D_MODEL // heads)
  for name, n in (("d_model", D_MODEL), ("ffn", FFN), ("vocab", VOCAB)):
    if n % t:
      raise ValueError(f"miniature {name}={n} does not divide tensor={t}")
  if D_MODEL % (int(mesh.get("fsdp", 1)) * int(mesh.get("expert", 1))):
    raise ValueError(f"miniature d_model={D_MODEL} does not divide fsdp x expert of {mesh}")
  return dict(heads=heads, kv_heads=kv, head_dim=head_dim, num_experts=num_experts)


def _randomize(model, seed: int):
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.02 * torch.randn_like(p))
  return model


def write_checkpoint(out: str, mesh: dict, family: str = "llama3", num_experts: int = 0,
                     seed: int = 0) -> str:
  """The miniature checkpoint + tokenizer in `out` (module docstring); returns `out`."""
  os.makedirs(out, exist_ok=True)
  write_llama3_style_tokenizer(out, vocab_size=VOCAB)
  tok = json.load(open(os.path.join(out, "tokenizer.json")))
  ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
  bos = ids["<|begin_of_text|>"]
  eos = [ids[t] for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>") if t in ids]
  w = widths(mesh, num_experts)
  if family == "llama3":
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=D_MODEL, intermediate_size=FFN, num_hidden_layers=2,
        num_attention_heads=w["heads"], num_key_value_heads=w["kv_heads"],
        head_dim=w["head_dim"], max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                            "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192},
        tie_word_embeddings=False, bos_token_id=bos, eos_token_id=eos)
    model = transformers.LlamaForCausalLM(cfg)
    shard = "600KB"
  else:
    text = models.get_preset(
        "tiny_llama4", vocab_size=VOCAB, d_model=D_MODEL, num_heads=w["heads"],
        num_kv_heads=w["kv_heads"], head_dim=w["head_dim"], ffn_dim=FFN, expert_ffn_dim=64,
        num_layers=4, num_experts=num_experts, attention_chunk_size=64, bos_token_id=bos,
        eos_token_id=eos[0])
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14, vision_output_dim=32,
                  projector_input_dim=32, projector_output_dim=32)
    model = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(
        text_config=models.to_hf_config(text).to_dict(), vision_config=vision))
    shard = "1MB"
  _randomize(model, seed)
  # transformers' `@wraps(nn.Module.to)` makes a type checker take the bound `to` as unbound
  model.to(torch.bfloat16).save_pretrained(out, max_shard_size=shard)  # pyright: ignore[reportArgumentType]
  n = sum(f.endswith(".safetensors") for f in os.listdir(out))
  if n < 3:
    raise RuntimeError(f"miniature checkpoint has {n} shards (< 3)")
  return out


def write_parquet(path: str, n: int = 96, seed: int = 0) -> str:
  """Polaris-style rows (problem, answer): `n` integer sums."""
  rng = random.Random(seed)
  rows = []
  for _ in range(n):
    a, b = rng.randint(1, 9), rng.randint(1, 9)
    rows.append({"problem": f"What is {a} + {b}?", "answer": str(a + b)})
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  pq.write_table(pa.Table.from_pylist(rows), path)
  return path


def variant_model(manifest_dir: str) -> tuple[dict, str, int]:
  """({mesh axis: size}, model family, experts) of a rendered variant's learner run config."""
  v = preflight.Variant(manifest_dir)
  if v.jobset is None:
    raise ValueError(f"{manifest_dir}: no JobSet (the learner) among the rendered documents")
  pod = v.jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  cfg, _ = preflight.learner_config(v, pod, pod["containers"][0])
  preset = models.get_preset(str(cfg.model.preset))
  return ({a: int(s) for a, s in cfg.mesh.shape}, preset.family, int(preset.num_experts or 0))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(prog="python -m launch.miniature", description=(__doc__ or "").split("\n")[0])
  ap.add_argument("manifests", help="a rendered variant (launch/gke/rendered/8b-gb200)")
  ap.add_argument("--out", required=True, help="writes OUT/ckpt and OUT/polaris.parquet")
  a = ap.parse_args(argv)
  sys.path.insert(0, REPO)
  mesh, family, experts = variant_model(a.manifests)
  ck = write_checkpoint(os.path.join(a.out, "ckpt"), mesh, family, experts)
  pq = write_parquet(os.path.join(a.out, "polaris.parquet"))
  print(json.dumps({"checkpoint": ck, "tokenizer": ck, "data": pq, "mesh": mesh,
                    "family": family, "experts": experts, "widths": widths(mesh, experts)}))
  return 0


if __name__ == "__main__":
  sys.exit(main())
