"""PipelineRL-k vs synchronous RL (k=0) on the same config and machine: trained tokens per second.

  python -m bench.pipeline [--steps 30] [--k 8]

Runs `scalerl_jax.main.run` twice on configs/tiny.py (one SFT warm start shared by both), once
with rollout.max_lag=k (PipelineRL: generators keep sampling while the learner trains, weights
swapped in flight) and once with k=0 (strictly on-policy: generate, then train, then generate).
Throughput = policy tokens in the trained batches / wall time from the first to the last step
(evaluation excluded: one evaluation at the start only). Last stdout line: one JSON object.
"""
import argparse
import json
import os
import shutil
import tempfile


from scalerl_jax.models import sections as model_sections
from scalerl_jax.training import job as run_main
from scalerl_jax import config as run_config
from scalerl_jax import recipes
from scalerl_jax.training import sft
from scalerl_jax.data import build_dataset


def _throughput(workdir):
  lines = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
  train = [l for l in lines if l["kind"] == "train"]
  skip = 2   # first steps include compilation in both modes
  t = train[-1]["time"] - train[skip - 1]["time"]
  tokens = sum(l["policy_tokens"] for l in train[skip:])
  return tokens / t, dict(steps=len(train) - skip, seconds=t, tokens=tokens,
                          max_lag=max(l["max_lag"] for l in train))


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--steps", type=int, default=30)
  ap.add_argument("--k", type=int, default=8)
  ap.add_argument("--workdir", default=None)
  a = ap.parse_args()
  root = a.workdir or tempfile.mkdtemp(prefix="bench_pipeline_")
  base = run_config.resolve_config("configs/tiny.py", [
      f"--config.total_steps={a.steps}", f"--config.eval.every_steps={10 ** 6}",
      "--config.eval.samples_per_prompt=1", "--config.data.heldout=16",
      f"--config.checkpoint.every_steps={10 ** 6}", "--config.sft.steps=50"])
  sft.warm_start(base, model_sections.model_config(base), build_dataset(base.data, 32), root)
  results = {}
  for name, k in (("pipeline", a.k), ("sync", 0)):
    c = run_config.resolve_config(base, [f"--config.rollout.max_lag={k}"])
    d = os.path.join(root, name)
    recipes.validate(c, d)
    shutil.copytree(os.path.join(root, sft.BASE_DIR), os.path.join(d, sft.BASE_DIR))
    run_main.run(c, d, progress=False)
    results[name] = _throughput(d)
  ours, peer = results["pipeline"][0], results["sync"][0]
  print(json.dumps({"ours": ours, "peer": peer, "unit": "policy tokens/s", "ratio": ours / peer,
                    "k": a.k, "pipeline": results["pipeline"][1], "sync": results["sync"][1],
                    "workdir": root}))


if __name__ == "__main__":
  main()
