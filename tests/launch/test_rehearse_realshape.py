"""`python -m launch.rehearse DIR --real-shape`: a rendered variant run with its REAL learner shape.

The plain rehearsal swaps the variant's mesh for fsdp=-1 (tests/launch/test_rehearse.py), so it
never sees the layout. Here the variant is rendered as a user does (`launch.gke.render` with
`--data` / `--checkpoint` on gs:// and ONE `--override rollout.max_lag=3`), then rehearsed with its
learner processes x devices per process (simulated CPU devices, jax.distributed over gloo) and its
layout's mesh (8b-gb200: 4 x 4, fsdp 4 x tensor 4), starting from a miniature real-format
checkpoint whose widths divide that mesh (launch/miniature.py: random Llama-3.1 / Llama-4, bf16,
index + >= 3 shards, Llama-3-style tokenizer) in an emulated gs:// bucket, with Polaris-style
parquet from the same bucket. It must pass the preflight, reach step 3, and every pod (4 learner
processes, 2 JAX generators, the buffer and its prompt export) must log the one override.

8b-gb200 (4 processes x 4 devices) runs in the normal suite (~3.5 min here); every other
committed variant runs under `long` (`make test-long`): 8b-h100 (2 x 8, tensor 8; rendered with its
own generator.decode_batch=16, launch/gke/render.py VARIANTS), 8b-tpu-v5p and scout-gb200.
8b-tpu-v5p is a TPU slice JobSet (`distributed.auto=True`): --real-shape replaces the
auto-detection by the GPU variants' coordinator env (pod 0, 4 processes, the completion index) and
keeps its 4 chips per pod as 4 CPU devices; the ICI topology and the auto-detection itself are not
exercised. Measured here (2 shared cores, a full suite running alongside): 8b-h100 3 steps in
168 s of rehearsal (test 194 s), 8b-tpu-v5p
(4 x 4) 3 steps in 196 s (test 229 s)."""
import json
import os
import subprocess
import sys
import time

import pytest
from gcs_emulator import running_emulator
from helpers import with_test_compile_flags

from scalerl_jax import config as run_config
from scalerl_jax import xla_env

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RENDERED = os.path.join(ROOT, "launch", "gke", "rendered")
BUCKET = "scalerl-realshape"
# variant: (config, learner platform, generator platform, learner processes, devices each, mesh,
# layout)
VARIANTS = {
    "8b-gb200": ("configs/8b.py", "gpu-gb200", "gpu-gb200", 4, 4,
                 "(('data', 1), ('fsdp', 4), ('tensor', 4), ('expert', 1))", "gb200_16"),
    "8b-h100": ("configs/8b.py", "gpu-h100", "gpu-h100", 2, 8,
                "(('data', 1), ('fsdp', 2), ('tensor', 8), ('expert', 1))", "h100_16"),
    "8b-tpu-v5p": ("configs/8b.py", "tpu-v5p", "gpu-gb200", 4, 4,
                   "(('data', 1), ('fsdp', 4), ('tensor', 4), ('expert', 1))", "tpu_v5p_16"),
    "scout-gb200": ("configs/scout.py", "gpu-gb200", "gpu-gb200", 4, 4,
                    "(('data', 1), ('fsdp', 1), ('tensor', 1), ('expert', 16))", "gb200_16"),
}


def _variant_overrides(name):
  """The committed variant's own settings (launch/gke/render.py VARIANTS: 8b-h100's
  generator.decode_batch=16, without which its render preflight refuses the vLLM KV cache)."""
  from launch.gke import render
  return list(render.VARIANTS[name][3].get("config_overrides", ()))


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  with running_emulator(tmp_path_factory.mktemp("emulator")) as url:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    env["STORAGE_EMULATOR_HOST"] = url
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    # The pods compile at the tests' level (tests/conftest.py): a 3-step rehearsal is mostly
    # compiles; alone here 295 -> 266 CPU-s (the rehearsal keeps inherited flags for every pod)
    env["XLA_FLAGS"] = with_test_compile_flags(env.get("XLA_FLAGS"))
    subprocess.run([sys.executable, "-c", "from scalerl_jax import storage; "
                    "storage.configure_emulator(); import fsspec; "
                    f"fsspec.filesystem('gs').mkdir('{BUCKET}')"],
                   cwd=ROOT, env=env, check=True, timeout=120)
    yield env


def _run(argv, env, timeout):
  t0 = time.time()
  r = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                     timeout=timeout)
  print(f"{' '.join(argv[:3])}: rc {r.returncode} in {time.time() - t0:.0f} s")
  return r


def _rehearse_real_shape(name, tmp_path, env, steps=3, timeout=840):
  config, lplat, gplat, procs, devs, mesh, layout = VARIANTS[name]
  mini = tmp_path / "mini"
  # the miniature checkpoint + data that fit the committed variant's layout, uploaded to gs://
  r = _run(["-m", "launch.miniature", os.path.join(RENDERED, name), f"--out={mini}"], env, 300)
  assert r.returncode == 0, r.stderr[-2000:]
  made = json.loads(r.stdout.strip().splitlines()[-1])
  ck, data = f"gs://{BUCKET}/{name}/ckpt", f"gs://{BUCKET}/{name}/polaris.parquet"
  r = _run(["-c", "import sys; from scalerl_jax import storage; "
            "storage.copy_tree(sys.argv[1], sys.argv[2], last=('config.json',)); "
            "storage.write_bytes(sys.argv[4], open(sys.argv[3], 'rb').read())",
            made["checkpoint"], ck, made["data"], data], env, 300)
  assert r.returncode == 0, r.stderr[-2000:]
  # rendered as a user does: gs:// data and checkpoint, ONE override (+ the variant's own settings)
  out = tmp_path / name
  own = [a for o in _variant_overrides(name) for a in ("--override", o)]
  r = _run(["-m", "launch.gke.render", f"--config={config}", f"--learner_platform={lplat}",
            f"--generator_platform={gplat}", f"--out={out}", f"--data={data}",
            f"--checkpoint={ck}", "--override", "rollout.max_lag=3", *own], env, 300)
  assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-2000:])
  state = tmp_path / "state"
  r = _run(["-m", "launch.rehearse", str(out), "--real-shape", f"--steps={steps}",
            f"--state-dir={state}", f"--tokenizer={made['tokenizer']}",
            f"--timeout={timeout - 60}"], env, timeout)
  assert r.returncode == 0, (r.stderr[-4000:])
  s = json.loads(r.stdout.strip().splitlines()[-1])
  print(json.dumps({k: s[k] for k in ("wall_s", "steps", "learner_processes", "evals")}))
  # the preflight ran first and passed; the run reached its last step with no restart
  assert s["preflight"] == [] and s["steps"] == steps and s["jobset_restarts"] == 0
  lp = s["learner_processes"]
  assert sorted((v["process"], v["of"]) for v in lp.values()) == [(i, procs) for i in range(procs)]
  comps = {p: v["component"] for p, v in s["pods"].items()}
  assert sorted(comps.values()).count("generator") == 2
  for pod, comp in comps.items():
    k = s["knobs"][pod]
    roles = {"learner": ["learner"], "generator": ["generator"], "buffer": ["buffer", "export"]}
    for role in roles[comp]:
      assert k[role]["rollout.max_lag"] == "3", (pod, role, k)       # the one override, everywhere
      if role != "buffer":
        assert k[role]["model.hf_checkpoint"] == ck and k[role]["data.path"] == data, k[role]
    if comp == "learner":   # the variant's shape, not the fsdp=-1 swap
      assert k["devices"] == {"local": devs, "global": procs * devs, "processes": procs}, k
      assert k["learner"]["mesh.shape"] == mesh, k
      assert k["learner"]["layout"] == layout, k
  w = s["weights"]
  assert all(w["served_chunks"][p] > 0 for p in lp), w
  # the learner started from the checkpoint in the bucket (job.py's start line)
  log = open(state / "pods" / sorted(lp)[0] / "learner.log").read()
  assert ck in log
  metrics = [json.loads(l) for l in open(state / "workdir" / "metrics.jsonl")]
  assert [l["step"] for l in metrics if l["kind"] == "train"] == list(range(1, steps + 1))
  return s


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.xdist_group("rehearse")
def test_real_shape_8b_gb200(tmp_path, emulator):
  s = _rehearse_real_shape("8b-gb200", tmp_path, emulator)
  assert "optim.microbatches=4" in s["overrides"]       # 16 rows, the variant's 4 rows / micro-batch


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.timeout(2400)
@pytest.mark.xdist_group("rehearse")
@pytest.mark.parametrize("name", ["8b-h100", "8b-tpu-v5p", "scout-gb200"])
def test_real_shape_long(name, tmp_path, emulator):
  _rehearse_real_shape(name, tmp_path, emulator, timeout=2340)


def test_real_shape_tpu_slice_gets_the_explicit_coordinator(tmp_path):
  """8b-tpu-v5p's learner asks jax.distributed to auto-detect the slice; --real-shape runs it as
  the GPU variants run: coordinator env (pod 0, port 8476), 4 processes, the completion index,
  4 simulated CPU devices per pod (its google.com/tpu limit). The tiny rehearsal still refuses."""
  from launch import rehearse
  d = os.path.join(RENDERED, "8b-tpu-v5p")
  with pytest.raises(rehearse.RehearsalError, match="TPU slice"):
    rehearse.Rehearsal(d, steps=3, workdir="", state_dir=str(tmp_path / "tiny"))
  x = rehearse.Rehearsal(d, steps=3, workdir="", state_dir=str(tmp_path / "real"), real_shape=True)
  learners = [p for p in x.pods if p.component == "learner"]
  assert len(learners) == 4
  for i, p in enumerate(learners):
    argv, env = x.command(p, p.spec["containers"][0])
    assert rehearse.TPU_AUTO_ARG in p.spec["containers"][0]["command"]
    assert not any("distributed.auto" in a for a in argv), argv
    assert env["SCALERL_COORDINATOR"] == "scalerl-learner-learner-0-0.scalerl-learner:8476"
    assert (env["SCALERL_NUM_PROCESSES"], env["SCALERL_PROCESS_ID"]) == ("4", str(i))
    assert xla_env.device_count(env["XLA_FLAGS"]) == 4     # the test's other flags kept
    assert x.hosts["scalerl-learner-learner-0-0.scalerl-learner"] == learners[0].ip


def test_real_shape_refuses_a_shape_that_does_not_fit():
  """The job-start preflight arithmetic: a mesh for other devices, an uneven micro-batch split."""
  import ml_collections
  from launch.spec import load_config
  from scalerl_jax import topologies
  cfg = load_config(os.path.join(ROOT, "configs", "8b.py"), "gb200_16")
  cfg = run_config.apply_recipe(cfg, set())
  assert topologies.run_shape_failures(cfg, 4, 16) == []
  assert "needs 16 devices" in topologies.run_shape_failures(cfg, 4, 4)[0]
  bad = ml_collections.ConfigDict(cfg.to_dict())
  bad.optim.microbatches = 5
  assert "optim.microbatches" in topologies.run_shape_failures(bad, 4, 16)[0]
