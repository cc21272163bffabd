"""Workdirs on object storage: a tiny run with --workdir=gs://BUCKET/run against a real GCS emulator
(gcp-storage-emulator, started here on 127.0.0.1) writes every output as an object in the bucket
and nothing under a local 'gs:' folder; kill -9 of the learner + the same command resumes from the
checkpoint in the bucket; analysis reads the gs:// run; bad gs:// workdirs fail at start-up with one
line and write nothing locally."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from gcs_emulator import free_port, emulator_in_this_process

from scalerl_jax import recipes
from scalerl_jax import storage

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("gcs")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "scalerl-test"
N, EVERY = 5, 2    # RL steps; checkpoint every EVERY steps; the learner is killed after step 3
# (N + 1 = 6 evaluations: analysis.fit needs 5 points after R0)


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  """gcp-storage-emulator on 127.0.0.1 (in memory) with one bucket; the standard variable set."""
  with emulator_in_this_process(tmp_path_factory.mktemp("emulator"), BUCKET) as url:
    yield url


def _cmd(workdir):
  return [sys.executable, "-m", "scalerl_jax.main", f"--config={ROOT}/configs/tiny.py",
          f"--workdir={workdir}", f"--config.total_steps={N}", "--config.sft.clean_steps=20",
          "--config.sft.steps=10", "--config.eval.every_steps=1",
          "--config.eval.samples_per_prompt=1", "--config.data.heldout=8",
          "--config.rollout.max_lag=0", f"--config.checkpoint.every_steps={EVERY}"]


def _env(emulator, tmp):
  # Only the standard emulator variable: the code derives tensorstore's and gcsfs' settings.
  env = {k: v for k, v in os.environ.items()
         if k not in ("TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
  return {**env, "PYTHONPATH": ROOT, "STORAGE_EMULATOR_HOST": emulator, "TMPDIR": str(tmp)}


def _lines(workdir):
  return [json.loads(l) for l in storage.read_text(storage.join(workdir, "metrics.jsonl"))
          .splitlines()]


def _local_gs_dirs(*roots):
  return [os.path.join(r, d) for root in roots for r, ds, _ in os.walk(root) for d in ds
          if d.startswith("gs:")]


def test_tiny_run_on_gs_writes_objects_and_resumes_after_kill(emulator, tmp_path):
  workdir = f"gs://{BUCKET}/run"
  cwd, tmp = tmp_path / "cwd", tmp_path / "tmp"
  cwd.mkdir()
  tmp.mkdir()
  env = _env(emulator, tmp)
  log = open(tmp_path / "first.log", "w")
  t0 = time.time()
  p = subprocess.Popen(_cmd(workdir), cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT)

  def logged(step):
    try:
      return any(l["kind"] == "train" and l["step"] == step for l in _lines(workdir))
    except (OSError, ValueError):
      return False
  # Step EVERY+1 trained and checkpoint EVERY finished in the bucket (saves are asynchronous: its
  # manifest is written after orbax commits, while the learner keeps stepping).
  while not (logged(EVERY + 1) and storage.exists(f"{workdir}/checkpoints/{EVERY}/manifest.json")):
    assert p.poll() is None, open(tmp_path / "first.log").read()[-4000:]
    assert time.time() - t0 < 900
    time.sleep(0.5)
  os.kill(p.pid, signal.SIGKILL)        # the learner dies without warning; children follow
  p.wait()
  t_first = time.time() - t0
  assert storage.exists(f"{workdir}/checkpoints/{EVERY}/manifest.json")
  r = subprocess.run(_cmd(workdir), cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stderr[-4000:]
  assert f"resuming from checkpoint {EVERY}" in r.stderr
  print(f"gs:// run: first (killed after step {EVERY + 1}) {t_first:.0f} s, "
        f"resumed to step {N} {time.time() - t0 - t_first:.0f} s")

  # Every output is an object in the bucket.
  files = set(storage.walk_files(workdir))
  for want in ("metrics.jsonl", "config.json", "learner_state.json", "resumes.jsonl",
               "npr_history.json", "base_policy/config.json", "base_policy/sft_info.json",
               "final_policy/config.json", f"checkpoints/{EVERY}/manifest.json",
               f"checkpoints/{N}/manifest.json", "logs/buffer.log", "logs/gen-0.log"):
    assert want in files, (want, sorted(files))
  # main's own fit (half-budget extrapolation) needs more points than 6 evaluations give it; it
  # says so in one warning. analysis.fit on the whole curve is checked below.
  assert "fit/fit.json" in files or "Eq. 1 fit skipped" in r.stderr, r.stderr[-2000:]
  assert any(f.startswith("tb/events.out.tfevents") for f in files)
  assert any(f.startswith("base_policy/") and f.endswith(".safetensors") for f in files)
  assert any(f.startswith("final_policy/") and f.endswith(".safetensors") for f in files)
  res = [json.loads(l) for l in storage.read_text(f"{workdir}/resumes.jsonl").splitlines()]
  assert len(res) == 1 and res[0]["checkpoint_step"] == EVERY and res[0]["redo_steps"] >= 1
  lines = _lines(workdir)
  assert [l["step"] for l in lines if l["kind"] == "train"] == list(range(1, N + 1))
  assert [l["step"] for l in lines if l["kind"] == "eval"] == list(range(0, N + 1))
  ls = json.loads(storage.read_text(f"{workdir}/learner_state.json"))
  assert ls["checkpoint_step"] == N
  # Nothing landed in a local 'gs:' folder; the local state (WAL, logs) is under TMPDIR.
  assert not _local_gs_dirs(cwd, ROOT, tmp)
  local = os.path.join(tmp, "scalerl-local", "gs", BUCKET, "run")
  assert os.path.isdir(os.path.join(local, "buffer_wal")), os.listdir(tmp)
  assert not os.path.exists(os.path.join(local, "checkpoints"))

  # analysis reads the gs:// run like a local one (5 RL steps give no rising curve to fit Eq. 1
  # to: the fit itself is checked on a synthetic gs:// run below).
  from analysis.metrics import read_run
  run = read_run(workdir)
  assert run.name == "run" and len(run.compute) == N + 1 and run.compute[0] == 0


def test_analysis_fits_a_gs_run(emulator, tmp_path):
  """analysis.synthetic writes a Table-1 run into the bucket (append_metrics / write_config through
  the path layer); fit_runs and the CLI read it from gs:// and write their fit back there."""
  from analysis.fit import fit_runs
  from analysis.synthetic import TABLE1, write_synthetic_run
  run_dir = f"gs://{BUCKET}/synthetic"
  name = sorted(TABLE1)[0]
  write_synthetic_run(run_dir, name, c_stop=3000.0)
  write_synthetic_run(tmp_path / "local", name, c_stop=3000.0)   # the same run on local disk
  out = fit_runs([run_dir], f"{run_dir}/fit", n_boot=20, progress=False)
  ref = fit_runs([tmp_path / "local"], tmp_path / "local_fit", n_boot=20, progress=False)
  assert out[0]["n_points"] == ref[0]["n_points"] == 30
  for k in ("A", "B", "C_mid", "r2"):       # gs:// reads exactly what a local directory gives
    assert out[0][k] == ref[0][k], k
  assert json.loads(storage.read_text(f"{run_dir}/fit/fit.json"))[0]["A"] == \
      pytest.approx(out[0]["A"])
  assert storage.isfile(f"{run_dir}/fit/curves.png")
  cli = subprocess.run([sys.executable, "-m", "analysis.fit", run_dir, "--out", f"{run_dir}/fit_cli",
                        "--n-boot=20", "--no-progress"], cwd=tmp_path, env=_env(emulator, tmp_path),
                       capture_output=True, text=True, timeout=300)
  assert cli.returncode == 0, cli.stderr[-2000:]
  assert storage.isfile(f"{run_dir}/fit_cli/fit.json")
  assert not _local_gs_dirs(tmp_path, ROOT)


def test_bad_gs_workdirs_fail_at_startup_with_one_line(emulator, tmp_path, monkeypatch):
  cwd = tmp_path / "cwd"
  cwd.mkdir()
  monkeypatch.chdir(cwd)
  # A bucket that does not exist (emulator up).
  with pytest.raises(recipes.ConfigError, match=r"bucket gs://no-such-bucket does not exist"):
    recipes.check_workdir("gs://no-such-bucket/run")
  # An emulator that is not there.
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{free_port()}")
  with pytest.raises(recipes.ConfigError, match=r"STORAGE_EMULATOR_HOST=.* is not reachable"):
    recipes.check_workdir(f"gs://{BUCKET}/run")
  # No emulator and no credentials.
  monkeypatch.delenv("STORAGE_EMULATOR_HOST")
  monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "home"))   # no gcloud application-default file
  monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "home" / "gcloud"))
  with pytest.raises(recipes.ConfigError, match=r"no Google Cloud credentials for gs://"):
    recipes.check_workdir(f"gs://{BUCKET}/run")
  with pytest.raises(recipes.ConfigError, match=r"only local paths and gs://"):
    recipes.check_workdir("s3://bucket/run")
  assert os.listdir(cwd) == []                        # nothing written locally
  # End to end: main exits with one 'config error' line before any process starts.
  r = subprocess.run(_cmd("gs://no-such-bucket/run"), cwd=cwd,
                     env=_env(emulator, tmp_path / "tmp"), capture_output=True, text=True, timeout=300)
  assert r.returncode == 1
  assert r.stderr.strip().splitlines()[-1] == (
      "config error: workdir gs://no-such-bucket/run: bucket gs://no-such-bucket does not exist "
      "(or this account cannot see it); create it or fix --workdir")
  assert os.listdir(cwd) == [] and not os.path.exists(tmp_path / "tmp" / "scalerl-local")


def test_wandb_sink_on_gs_workdir(emulator, tmp_path, monkeypatch):
  """config.wandb.project with a gs:// workdir: the run id and the offline run are objects in the
  bucket (W&B's own files go to the local dir and are uploaded at finish); nothing under `gs:`."""
  pytest.importorskip("wandb")
  import ml_collections
  from matplotlib.figure import Figure
  from scalerl_jax.training.tracking import MetricsLog
  from scalerl_jax.training.wandb_sink import read_offline_history
  monkeypatch.delenv("WANDB_API_KEY", raising=False)
  monkeypatch.setenv("WANDB_SILENT", "true")
  monkeypatch.chdir(tmp_path)
  workdir = f"gs://{BUCKET}/wandb_run"
  cfg = ml_collections.ConfigDict(dict(project="scalerl-test", entity="", name="", mode="auto"))
  log = MetricsLog(workdir, wandb_cfg=cfg, run_config={"lr": 3e-5},
                   local_dir=str(tmp_path / "local"))
  assert log.wandb.mode == "offline"
  log.write({"step": 0, "kind": "eval", "compute_hours": 0.0, "val_pass_rate": 0.25})
  log.write({"step": 1, "kind": "train", "compute_hours": 0.01, "loss": -0.5})
  png = tmp_path / "p.png"
  Figure(figsize=(1, 1)).savefig(png)
  storage.write_bytes(f"{workdir}/fit/curves.png", png.read_bytes())   # the fit's plot on gs://
  log.log_images({"fit/curves": f"{workdir}/fit/curves.png"}, step=2)
  log.close()
  log.finish()
  run_id = storage.read_text(f"{workdir}/wandb_id.txt").strip()
  assert run_id and any(f.endswith(".wandb") and run_id in f
                        for f in storage.walk_files(f"{workdir}/wandb"))
  rows = read_offline_history(workdir)
  assert [r.get("trainer_step") for r in rows][:2] == [0, 1], rows
  assert any("fit/curves" in r for r in rows), rows
  assert not glob.glob(str(tmp_path / "**" / "gs:"), recursive=True)
  assert not os.path.exists(os.path.join(ROOT, "gs:"))


def test_compare_on_gs_run_dirs(emulator, tmp_path):
  """analysis.fit_runs over several gs:// runs (scalerl_jax.compare's last step) writes
  compare.md / fit.json into the bucket, equal to the same comparison of local copies."""
  from analysis.fit import fit_runs
  from analysis.synthetic import TABLE1, write_synthetic_run
  names = sorted(TABLE1)[:2]
  gs_dirs, local_dirs = [], []
  for n in names:
    gs_dirs.append(f"gs://{BUCKET}/cmp/{n}")
    local_dirs.append(str(tmp_path / n))
    write_synthetic_run(gs_dirs[-1], n, c_stop=3000.0)
    write_synthetic_run(local_dirs[-1], n, c_stop=3000.0)
  got = fit_runs(gs_dirs, f"gs://{BUCKET}/cmp/compare", n_boot=10, progress=False, names=names)
  ref = fit_runs(local_dirs, str(tmp_path / "compare"), n_boot=10, progress=False, names=names)
  assert [(r["A"], r["B"], r["C_mid"]) for r in got] == [(r["A"], r["B"], r["C_mid"]) for r in ref]
  assert storage.read_text(f"gs://{BUCKET}/cmp/compare/compare.md") == open(
      tmp_path / "compare" / "compare.md").read()
  assert storage.exists(f"gs://{BUCKET}/cmp/compare/fit.json")
  assert not os.path.exists(os.path.join(ROOT, "gs:"))


def test_final_policy_export_to_gs_is_bit_identical(emulator):
  """models/hf_export.py into a gs:// workdir: each process's file staged and uploaded, then
  config.json last; loads back bit for bit (one process, numpy params: one file, no index)."""
  import jax
  import numpy as np
  from scalerl_jax import models
  from scalerl_jax.models import hf_export, hf_io
  cfg = models.get_preset("tiny_llama4", num_layers=4, vocab_size=96, d_model=64, head_dim=16,
                          ffn_dim=96, expert_ffn_dim=32)
  params = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(1)))
  path = f"gs://{BUCKET}/export/final_policy"
  st = hf_export.save_hf_sharded(cfg, params, path)
  assert storage.walk_files(path) == ["config.json", hf_io.SINGLE_FILE]
  assert st.written_bytes == sum(a.nbytes for a in jax.tree.leaves(params))
  with storage.local_copy(path) as d:
    _, got = hf_io.load_hf(d)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(params)):
    assert a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))
