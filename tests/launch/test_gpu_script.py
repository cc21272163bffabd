"""scripts/gpu_bench.sh (issue #26's prepared GPU command) on CPU: its syntax, every bench command
line it runs parsed by that bench's own argument parser (in both its GPU and its dry form), and the
benches' FLOP and reference arithmetic against independent counts."""
import os
import re
import shlex
import subprocess

import numpy as np
import pytest

from bench import head_precision, learner, vllm_routes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "gpu_bench.sh")


def test_script_syntax():
  assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


def _variables(text):
  """HEAD / SLICE values of the dry branch and of the GPU branch."""
  dry = dict(re.findall(r'^\s+(HEAD|SLICE|ROUTES)="([^"]*)"', text.split("else", 1)[0], re.M))
  gpu = dict(re.findall(r'^\s+(HEAD|SLICE|ROUTES)="([^"]*)"', text.split("else", 1)[1], re.M))
  return dry, gpu


def test_every_bench_command_parses():
  text = open(SCRIPT).read()
  runs = re.findall(r"^run \S+ -m (\S+) (.*)$", text, re.M)
  assert [m for m, _ in runs] == ["bench.head_precision", "bench.learner", "bench.learner",
                                  "bench.vllm_routes"]
  for env in _variables(text):
    assert set(env) == {"HEAD", "SLICE", "ROUTES"}
    for module, args in runs:
      argv = shlex.split(re.sub(r"\$(HEAD|SLICE|ROUTES)", lambda m: env[m.group(1)], args))
      mod = {"bench.head_precision": head_precision, "bench.learner": learner,
             "bench.vllm_routes": vllm_routes}[module]
      mod._args(argv)                        # SystemExit on an unknown or malformed flag


@pytest.mark.parametrize("t,q", [(256, 64), (300, 48), (7, 64)])
def test_attention_flops_count_the_tiles_each_kernel_computes(t, q):
  """causal_blocks: query block i sees key slots [0, end of block i); counted by brute force."""
  cfg = learner.model_config("tiny_llama3", 0, "cpu")
  per_pair = 3 * 2 * 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
  pairs = sum(min((i // q + 1) * q, t) for i in range(t))        # keys each query row computes
  assert learner.attention_flops(cfg, 1, t, "causal_blocks", q) == per_pair * pairs
  assert learner.attention_flops(cfg, 2, t, "causal") == 2 * per_pair * t * (t + 1) // 2
  assert learner.attention_flops(cfg, 1, t, "full") == per_pair * t * t


def test_head_precision_reference_is_float64_log_softmax():
  from scipy.special import log_softmax
  r = np.random.default_rng(0)
  h, w = r.normal(size=(300, 16)).astype(np.float32), r.normal(size=(16, 50)).astype(np.float32)
  tgt = r.integers(0, 50, 300)
  want = log_softmax(h.astype(np.float64) @ w.astype(np.float64), axis=1)[np.arange(300), tgt]
  np.testing.assert_allclose(head_precision.reference(h, w, tgt), want, rtol=0, atol=1e-12)
