"""docs/ARCHITECTURE.md's "one place to change" table, proved row by row: each test plants the change
in a scratch copy of the packages, touching ONLY the file(s) its row names, and runs a short check
of the change where it is used, in a subprocess whose PYTHONPATH is the copy. Each test has its own
copy of one module-wide copy, and `_plant` asserts that the files that differ from it are exactly
the row's.

Rows: a loss, a rollout correction, a reward, a generator backend, a model family, a launch target,
a launch backend. (A config knob / a buffer knob: the config layer's own tests.)

The copy holds scalerl_jax/, configs/ and launch/ (without the rendered manifests).
"""
import filecmp
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = ("scalerl_jax", "configs", "launch")

# The row of docs/ARCHITECTURE.md each test plants, and the files that row names.
ROWS = {
    "a loss": ("scalerl_jax/rl/losses.py",),
    "a rollout correction": ("scalerl_jax/rl/correction.py",),
    "a reward": ("scalerl_jax/rewards/always_half.py", "scalerl_jax/rewards/__init__.py"),
    "a generator backend": ("scalerl_jax/generation/echo_engine.py",
                            "scalerl_jax/generation/backends.py"),
    "a model family": ("scalerl_jax/models/families/mistral.py",
                       "scalerl_jax/models/families/__init__.py"),
    "a launch target": ("scalerl_jax/topologies.py",),
    "a launch backend": ("launch/backends.py", "launch/print_backend.py"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
  """One scratch copy of the packages (no __pycache__), taken once for the module."""
  dst = tmp_path_factory.mktemp("one_place")
  for pkg in PACKAGES:
    shutil.copytree(os.path.join(ROOT, pkg), dst / pkg,
                    ignore=shutil.ignore_patterns("__pycache__", "rendered"))
  return dst


@pytest.fixture
def copy(pristine, tmp_path):
  """This test's own copy of the module's scratch copy (a plant never meets another's)."""
  dst = tmp_path / "tree"
  shutil.copytree(pristine, dst)
  _PRISTINE[str(dst)] = pristine
  return dst


_PRISTINE: dict = {}   # a test's copy -> the module's copy it was taken from


def _changed(a, b) -> set[str]:
  """Paths (relative) whose bytes differ between trees `a` and `b`, or that only one has."""
  out = set()
  for base, _, files in os.walk(a):
    for f in files:
      rel = os.path.relpath(os.path.join(base, f), a)
      other = os.path.join(b, rel)
      if "__pycache__" in rel:
        continue
      if not os.path.exists(other) or not filecmp.cmp(os.path.join(a, rel), other, shallow=False):
        out.add(rel)
  return out


def _plant(copy, row: str, edits: dict) -> None:
  """Applies `edits` {path: (anchor, text) to insert after the anchor, or (None, text) for a new
  file}; the paths must be exactly the row's files."""
  assert set(edits) == set(ROWS[row]), (row, sorted(edits))
  for rel, (anchor, text) in edits.items():
    path = copy / rel
    if anchor is None:
      assert not path.exists(), rel
      path.write_text(textwrap.dedent(text))
      continue
    src = path.read_text()
    assert src.count(anchor) == 1, (rel, anchor)
    path.write_text(src.replace(anchor, anchor + text))
  assert _changed(copy, _PRISTINE[str(copy)]) | _changed(_PRISTINE[str(copy)], copy) == set(edits)


def _run(copy, code: str) -> str:
  """Runs `code` with the copy first on the path; returns its stdout (fails with its stderr)."""
  env = dict(os.environ, PYTHONPATH=str(copy), JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=str(copy),
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout.strip().splitlines()[-1]


def test_a_new_loss(copy):
  _plant(copy, "a loss", {"scalerl_jax/rl/losses.py": ("LossOut(total, jnp.sum(w), stats)\n", textwrap.dedent("""

      @register_loss("half_reinforce")
      def half_reinforce(logp, gen_logp, adv, weights, loss_mask, hp: LossHParams) -> LossOut:
        \"\"\"Planted: half of REINFORCE's term.\"\"\"
        del gen_logp, hp
        act = _active(weights, loss_mask)
        term = -0.5 * adv[:, None] * jnp.where(act, logp, 0.0)
        none = jnp.zeros_like(act)
        return _reduce(term, weights, act, none, none)
      """))})
  out = _run(copy, """
      import dataclasses, jax, jax.numpy as jnp, numpy as np, optax
      from scalerl_jax import config as common
      from scalerl_jax.learner import LearnerState, RLSpec, make_train_step
      cfg = common.base_config()
      cfg.rl.loss = "half_reinforce"                      # selected by config
      run = common.RunConfig.from_config(cfg)
      rng = np.random.default_rng(0)
      B, T, V = 4, 6, 5
      batch = dict(tokens=rng.integers(0, V, (B, T)).astype(np.int32),
                   gen_logprobs=np.full((B, T), -1.5, np.float32),
                   loss_mask=np.arange(T)[None].repeat(B, 0) >= 2,
                   rewards=np.array([1., 0., 1., 1.], np.float32),
                   prompt_ids=np.array([0, 0, 1, 1], np.int32))
      params = {"w": jnp.asarray(rng.standard_normal((V, V)), jnp.float32)}
      apply_fn = lambda p, tokens, positions: p["w"][tokens]
      def loss(name):
        spec = RLSpec.from_config(dataclasses.replace(run.rl, loss=name))
        step = jax.jit(make_train_step(apply_fn, optax.sgd(0.0), spec, 1))
        return float(step(LearnerState.create(params, optax.sgd(0.0)), batch)[1]["loss"])
      print(loss("half_reinforce"), loss("reinforce"))
      """)
  half, full = map(float, out.split())
  assert abs(full) > 1e-3 and half == pytest.approx(0.5 * full, rel=1e-6)


def test_a_new_rollout_correction(copy):
  _plant(copy, "a rollout correction", {"scalerl_jax/rl/correction.py": (
      "  seq_tis_cap: float = 0.0\n",
      "  token_floor: float = 0.0          # planted: drop tokens whose ratio is below the floor\n")})
  path = copy / "scalerl_jax/rl/correction.py"       # and its switch, in the same file
  path.write_text(path.read_text() + textwrap.dedent("""

      @register_switch("token_floored", lambda c: bool(c.token_floor))
      def token_floor(scale, r: Ratios, c):
        \"\"\"Planted: 0 where rho_t < token_floor.\"\"\"
        keep = r.ratio >= c.token_floor
        return jnp.where(keep, scale, 0.0), r.act & ~keep
      """))
  out = _run(copy, """
      import types, numpy as np
      from scalerl_jax.rl.correction import Correction, corrected_weights, stat_names
      fields = dict(token_tis_cap=0, token_mask_low=0, token_mask_high=0, seq_mask_low=0,
                    seq_mask_high=0, seq_tis_cap=0, token_floor=0.5)
      c = Correction.from_config(types.SimpleNamespace(**{"rc_" + k: v for k, v in fields.items()}))
      logp = np.log(np.array([[0.5, 0.1, 0.4]], np.float32))
      gen = np.log(np.array([[0.5, 0.5, 0.5]], np.float32))
      w, flags = corrected_weights(logp, gen, np.ones((1, 3), np.float32), np.ones((1, 3), bool), c)
      print(np.asarray(w).tolist(), np.asarray(flags["token_floored"]).tolist(), stat_names()[-1])
      """)
  assert out == "[[1.0, 0.0, 1.0]] [[False, True, False]] token_floored"


def test_a_new_reward(copy):
  _plant(copy, "a reward", {
      "scalerl_jax/rewards/always_half.py": (None, """\
          \"\"\"Planted: a reward of 0.5 for every completion.\"\"\"
          from scalerl_jax.rewards.registry import register


          @register("always_half")
          def always_half(completion_text: str, answer: str) -> float:
            return 0.5
          """),
      "scalerl_jax/rewards/__init__.py": ("synthetic, tiny_code", ", always_half")})
  out = _run(copy, """
      from scalerl_jax import config as common
      from scalerl_jax import rewards
      cfg = common.base_config()
      cfg.data.reward = "always_half"
      run = common.RunConfig.from_config(cfg)
      print(run.data.reward, rewards.compute_reward(run.data.reward, "</think> 7", "7"))
      """)
  assert out == "always_half 0.5"


def test_a_new_generator_backend(copy):
  _plant(copy, "a generator backend", {
      "scalerl_jax/generation/echo_engine.py": (None, """\
          \"\"\"Planted: a backend whose engine builds the scripted generator.\"\"\"
          from scalerl_jax.generation.fake import ScriptedEngine


          class EchoEngine(ScriptedEngine):
            pass
          """),
      "scalerl_jax/generation/backends.py": (
          'about="a scripted stand-in instruct model (tests and demos; no weights)"))\n',
          'register(Backend("echo", "scalerl_jax.generation.echo_engine:EchoEngine"))\n')})
  out = _run(copy, """
      from scalerl_jax import config as common
      from scalerl_jax.generation import backends, worker_cli
      args = worker_cli.build_parser().parse_args(
          ["--run_config=x", "--buffer=y", "--backend=echo"])
      cfg = common.base_config()
      cfg.generator.backend = "echo"
      run = common.RunConfig.from_config(cfg)
      print(args.backend, run.generator.backend, backends.engine_class("echo").__name__,
            backends.parity_gate_on("vllm", "echo"))
      """)
  assert out == "echo echo EchoEngine False"


def test_a_new_model_family(copy):
  _plant(copy, "a model family", {
      "scalerl_jax/models/families/mistral.py": (None, """\
          \"\"\"Planted: the Mistral dense family (HF MistralForCausalLM), no sliding window.\"\"\"
          from scalerl_jax.models.families.base import Family, register


          def _from_hf(d) -> dict:
            if d.get("sliding_window"):
              raise ValueError("sliding_window is not supported")
            return {"ffn_dim": d["intermediate_size"]}


          def _to_hf(cfg) -> dict:
            return {"intermediate_size": cfg.ffn_dim, "sliding_window": None}


          MISTRAL = register(Family(
              name="mistral", hf_model_types=("mistral",), hf_config_class="MistralConfig",
              hf_model_class="MistralForCausalLM", ff_prefix="mlp.", rope_layout="half",
              default_rope_theta=10000.0, from_hf=_from_hf, to_hf=_to_hf))
          """),
      "scalerl_jax/models/families/__init__.py": ("from scalerl_jax.models.families import llama3",
                                                  ", mistral")})
  out = _run(copy, """
      from scalerl_jax import models
      cfg = models.get_preset("tiny_llama3", family="mistral", num_layers=2)
      hf = models.to_hf_config(cfg)
      back = models.from_hf_config(hf.to_dict())
      print(type(hf).__name__, back.family, back == cfg)
      """)
  assert out == "MistralConfig mistral True"


def test_a_new_launch_target(copy):
  _plant(copy, "a launch target", {"scalerl_jax/topologies.py": (
      '                        machine_type="a4x-highgpu-4g", cpu="128", memory="800Gi", arch="arm64")),\n',
      '        Accelerator("gpu-b200", "gpu", "b200", 180 * GB, 0.90, 2.25e15,\n'
      '                    "planted: NVIDIA B200, 180 GB HBM3e", (16,), dict(\n'
      '                        chips_per_host=8, resource="nvidia.com/gpu", xm_resource="b200",\n'
      '                        node_selector={"cloud.google.com/gke-accelerator": "nvidia-b200"},\n'
      '                        machine_type="a4-highgpu-8g", cpu="200", memory="1600Gi", arch="amd64")),\n')})
  out = _run(copy, """
      from launch import backends, spec as spec_lib
      from scalerl_jax import topologies
      specs = spec_lib.resolve(spec_lib.load_config("configs/8b.py"),
                               dict(generator_platform="gpu-b200", config_file="configs/8b.py"))
      docs = backends.plan("gke", specs)["generators.yaml"]
      sel = [d["spec"]["template"]["spec"]["nodeSelector"] for d in docs if d["kind"] == "Deployment"]
      print("gpu-b200" in spec_lib.PLATFORMS, "b200_16" in topologies.TOPOLOGIES,
            sel[0]["cloud.google.com/gke-accelerator"])
      """)
  assert out == "True True nvidia-b200"


def test_a_new_launch_backend(copy):
  _plant(copy, "a launch backend", {
      "launch/print_backend.py": (None, """\
          \"\"\"Planted: a launch backend that lists each job's image and command.\"\"\"


          def plan(specs: dict) -> dict:
            return {n: [specs[n]["image"], specs[n]["command"][0]]
                    for n in ("learner", "generators", "buffer")}
          """),
      "launch/backends.py": ('about="the GKE manifests as local processes, one loopback address per pod"))\n',
                             'register(LaunchBackend("print", "launch.print_backend:plan"))\n')})
  out = _run(copy, """
      import io, contextlib, json
      from launch import backends
      buf = io.StringIO()
      with contextlib.redirect_stdout(buf):
        rc = backends.main(["--backend=print", "--config=configs/8b.py"])
      plan = json.loads(buf.getvalue())
      print(rc, sorted(plan), plan["buffer"][1])
      """)
  assert out == "0 ['buffer', 'generators', 'learner'] python"
