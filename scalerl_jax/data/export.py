"""Writes a dataset's prompts as the rollout buffer's JSONL ({"prompt_id", "tokens", "answer"}).

  python -m scalerl_jax.data.export --config=configs/tiny.py --out=/tmp/prompts.jsonl [--split=train]
      [--config.a.b=value ...]

The buffer (scalerl_jax.buffer.server --prompts=FILE) reads this format.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from scalerl_jax import config as run_config
from scalerl_jax.data import build_dataset


def write_prompts(prompts, path: str) -> int:
  """Writes PromptSpecs as JSONL; returns the number of lines."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    for p in prompts:
      f.write(json.dumps({"prompt_id": int(p.prompt_id), "tokens": [int(t) for t in p.tokens],
                          "answer": p.answer}) + "\n")
  return len(prompts)


def build_parser() -> argparse.ArgumentParser:
  """The command-line flags of this entry point (launch tests parse the pod commands with it)."""
  ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
  ap.add_argument("--config", required=True,
                  help="a preset configs/X.py[:ARG] or a saved run file (as main's --config)")
  ap.add_argument("--out", required=True)
  ap.add_argument("--split", choices=("train", "heldout"), default="train")
  return ap


def main(argv=None) -> None:
  ap = build_parser()
  rest, overrides = run_config.split_overrides(sys.argv[1:] if argv is None else argv)
  a = ap.parse_args(rest)
  sys.path.insert(0, os.getcwd())   # so a preset's `from configs import tiny` resolves from the repo root
  try:
    config = run_config.resolve_config(a.config, overrides)   # as main resolves it
  except run_config.ConfigError as e:
    sys.exit(f"config error: {e}")
  print(run_config.knob_line(config, "export"), file=sys.stderr, flush=True)
  ds = build_dataset(config.data, config.rollout.max_prompt_len)
  n = write_prompts(ds.train if a.split == "train" else ds.heldout, a.out)
  print(json.dumps({"out": a.out, "split": a.split, "prompts": n, "kind": ds.kind}))


if __name__ == "__main__":
  main()
