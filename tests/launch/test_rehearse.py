"""`python -m launch.rehearse`: a rendered GKE variant (launch/gke/rendered/8b-h100: 2 learner hosts)
run as local processes from its own YAML (launch/README.md "Rehearsal"): 2 learner pods in one
jax.distributed job (gloo), the buffer pod (init container first) and 2 generator pods (JAX), the
tiny model swapped in by config overrides, Service names through $SCALERL_HOSTS.

The slow tests each run a rehearsal: a local workdir with a kill -9 of the buffer pod (5 steps, killed at step 2);
a gs:// workdir on gcp-storage-emulator with a kill -9 of a learner pod once a checkpoint finished
(6 steps, `long`; the JobSet restarts both; the run resumes from the checkpoint in the bucket); a
local workdir with a kill -9 of a learner pod before any checkpoint finished (3 steps: the learners
start over and the running buffer rewinds to step 0)."""
import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from helpers import publish_params
from gcs_emulator import running_emulator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VARIANT = os.path.join(ROOT, "launch", "gke", "rendered", "8b-h100")
BUCKET = "scalerl-rehearse"


def _rehearse(args, env=None, timeout=840):
  """Runs the rehearsal; one that would run past `timeout` stops itself 60 s earlier (--timeout)
  and prints where each pod stands, instead of being killed silently (by pytest-timeout, 900 s)."""
  if any(a.startswith("--steps") for a in args):
    args = [*args, f"--timeout={timeout - 60}"]
  env = dict(os.environ if env is None else env)
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  t0 = time.time()
  r = subprocess.run([sys.executable, "-m", "launch.rehearse", *args], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=timeout)
  print(f"rehearse {' '.join(args)}: rc {r.returncode} in {time.time() - t0:.0f} s")
  return r


def _summary(r):
  assert r.returncode == 0, r.stderr[-3000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


def _one_line_error(r, *needles):
  assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
  lines = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(lines) == 1 and lines[0].startswith("rehearse: error: "), r.stderr
  assert "Traceback" not in r.stderr
  for n in needles:
    assert n in lines[0], lines[0]
  return lines[0]


def _no_local_gs(*dirs):
  for d in dirs:
    found = glob.glob(os.path.join(d, "**", "gs:"), recursive=True) + glob.glob(
        os.path.join(d, "gs:"))
    assert not found, found


@pytest.fixture(scope="module")
def emulator(tmp_path_factory):
  """gcp-storage-emulator on 127.0.0.1 (in memory) with one bucket (tests/gcs_emulator.py)."""
  with running_emulator(tmp_path_factory.mktemp("emulator")) as url:
    env = {k: v for k, v in os.environ.items()
           if k not in ("TENSORSTORE_GCS_HTTP_URL", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT")}
    env["STORAGE_EMULATOR_HOST"] = url
    subprocess.run([sys.executable, "-c", "from scalerl_jax import storage; storage.configure_emulator()"
                    f"; import fsspec; fsspec.filesystem('gs').mkdir('{BUCKET}')"],
                   cwd=ROOT, env=dict(env, PYTHONPATH=ROOT), check=True, timeout=120)
    yield env


# ---- bad input: one line at start-up, nothing written ---------------------------------------------
def test_missing_secret_is_one_line(tmp_path):
  d = tmp_path / "variant"
  shutil.copytree(VARIANT, d)
  os.remove(d / "secret.yaml")
  state = tmp_path / "state"
  r = _rehearse([str(d), "--steps=1", f"--state-dir={state}"])
  _one_line_error(r, "Secret 'scalerl-buffer-token'", "SCALERL_BUFFER_TOKEN")
  assert not state.exists()


def test_missing_run_config_map_is_one_line(tmp_path):
  d = tmp_path / "variant"
  shutil.copytree(VARIANT, d)
  os.remove(d / "run-config.yaml")
  state = tmp_path / "state"
  r = _rehearse([str(d), "--steps=1", f"--state-dir={state}"])
  _one_line_error(r, "ConfigMap 'run-config' is not in")
  assert not state.exists()


def test_tpu_variant_and_bad_dir_are_one_line(tmp_path):
  state = tmp_path / "state"
  r = _rehearse([os.path.join(ROOT, "launch", "gke", "rendered", "8b-tpu-v5p"), f"--state-dir={state}"])
  _one_line_error(r, "TPU slice")
  r = _rehearse([str(tmp_path / "nope"), f"--state-dir={state}"])
  _one_line_error(r, "not a directory")
  assert not state.exists()


def test_gs_without_credentials_is_one_line(tmp_path):
  env = {k: v for k, v in os.environ.items()
         if k not in ("STORAGE_EMULATOR_HOST", "GOOGLE_APPLICATION_CREDENTIALS",
                      "TENSORSTORE_GCS_HTTP_URL")}
  env.update(GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9", NO_GCE_CHECK="True",
             HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
  state = tmp_path / "state"
  r = _rehearse([VARIANT, "--workdir=gs://some-bucket/run", f"--state-dir={state}"], env=env,
                timeout=300)
  _one_line_error(r, "no Google Cloud credentials for gs://some-bucket/run")
  assert not state.exists()
  _no_local_gs(ROOT, str(tmp_path))


@pytest.mark.xdist_group("rehearse")
def test_gs_bucket_missing_is_one_line(tmp_path, emulator):
  state = tmp_path / "state"
  r = _rehearse([VARIANT, "--workdir=gs://no-such-bucket/run", f"--state-dir={state}"],
                env=emulator, timeout=300)
  _one_line_error(r, "bucket gs://no-such-bucket does not exist")
  assert not state.exists()
  _no_local_gs(ROOT, str(tmp_path))


# ---- the rehearsals ------------------------------------------------------------------------------
def _common_checks(s, steps=6, fit=True, npr_history=True):
  assert s["steps"] == steps
  lp = s["learner_processes"]
  assert sorted((v["process"], v["of"]) for v in lp.values()) == [(0, 2), (1, 2)], lp
  w = s["weights"]
  learners = sorted(lp)
  assert all(w["served_chunks"][p] > 0 for p in learners), w      # both learner pods serve
  gens = [p for p, v in s["pods"].items() if v["component"] == "generator"]
  assert len(gens) == 2
  for g in gens:                                                    # both generators fetch from both
    assert sorted(w["fetched_chunks_by_source"][g]) == learners, w
  b = s["buffer"]
  assert b["npr_threshold"] == "0.9"                 # the 8b recipe's threshold, as the buffer resolved it
  assert b["npr_state"]["threshold"] == 0.9, b                      # the buffer's state
  assert bool(b["npr_state"]["history"]) == npr_history, b   # empty: snapshot after a start-over
  assert b["wal_records"].get("npr", 0) + b["wal_records"].get("npr_state", 0) > 0
  assert any(f.startswith("wal-") for f in b["wal_files"]) and b["wal_bytes"] > 0
  if fit:   # the end-of-run Eq. 1 fit exists iff an evaluation rose above R0 (else it is skipped,
    # "never exceeds R0"): 6 noisy evaluations of a 6-step run need not rise (issue #28)
    ev = dict((st, v) for st, v in s["evals"])
    assert sorted(ev) == list(range(steps + 1)), s["evals"]
    rose = max(v for st, v in ev.items() if st > 0) > ev[0]
    assert s["fit_exists"] == rose, (s["fit"], s["evals"])


def _learner_kill_checks(s):
  """tools/audit.py's ledger (rehearse's learner-kill check): every acknowledged rollout trained
  once in the final timeline, dropped by the rewind with a reason, or still in the buffer."""
  a = s["kill"]["audit"]
  assert a["acked"] > 0 and a["fate"]["lost"] == 0, a
  assert a["duplicated"] == 0 and a["trained_not_acked"] == 0 and not a["steps_logged_twice"], a
  assert a["trained_ids"] == a["fate"]["trained"], a
  return a


@pytest.mark.slow
@pytest.mark.xdist_group("rehearse")
def test_rehearse_local_kill_buffer(tmp_path):
  state = tmp_path / "state"
  # 5 steps (5 evaluations after step 0: the fewest an Eq. 1 fit takes), killed at step 2
  r = _rehearse([VARIANT, "--steps=5", f"--state-dir={state}", "--kill=buffer",
                 "--kill-at-step=2"])
  s = _summary(r)
  print(json.dumps({k: s[k] for k in ("wall_s", "steps", "weights", "kill")}, indent=1))
  _common_checks(s, steps=5)
  buf = [p for p, v in s["pods"].items() if v["component"] == "buffer"][0]
  assert s["pods"][buf]["restarts"] == 1 and s["pods"][buf]["exit_codes"] == [-9]
  k = s["kill"]
  assert k["acked_at_kill"] > 0 and k["lost_count"] == 0 and not k["trained_twice"], k
  assert k["delivered_steps"] == list(range(5))
  # the restarted pod replayed its WAL: its second start line reports the records it read
  log = open(state / "pods" / buf / "buffer.log").read()
  replays = [json.loads(l) for l in log.splitlines() if l.startswith('{"port"')]
  assert len(replays) == 2 and replays[1]["wal"]["records"], replays[-1]
  metrics = [json.loads(l) for l in open(state / "workdir" / "metrics.jsonl")]
  assert [l["step"] for l in metrics if l["kind"] == "train"] == [1, 2, 3, 4, 5]
  if s["fit_exists"]:
    assert json.load(open(state / "workdir" / "fit" / "fit.json"))


@pytest.mark.slow
@pytest.mark.long      # > 15 min inside the full suite since fleet eval + async saves (2026-12-01, commit db549ee, 2-core machine)
@pytest.mark.timeout(2400)
@pytest.mark.xdist_group("rehearse")
def test_rehearse_gcs_kill_learner_resumes_from_bucket(tmp_path, emulator):
  state = tmp_path / "state"
  workdir = f"gs://{BUCKET}/run"
  r = _rehearse([VARIANT, "--steps=6", f"--state-dir={state}", f"--workdir={workdir}",
                 "--kill=learner", "--kill-at-step=3"], env=emulator, timeout=2340)
  s = _summary(r)
  print(json.dumps({k: s[k] for k in ("wall_s", "steps", "jobset_restarts", "kill")}, indent=1))
  _common_checks(s)
  assert s["jobset_restarts"] == 1
  # killed once checkpoint 2 (or 4) had its manifest; the restarted learner resumed from it
  assert s["kill"]["checkpoint_at_kill"] in (2, 4), s["kill"]
  a = _learner_kill_checks(s)
  assert a["resumed_from"] == [s["kill"]["checkpoint_at_kill"]] and a["started_over"] == 0, a
  env = dict(emulator, PYTHONPATH=ROOT)
  probe = subprocess.run(
      [sys.executable, "-c", f"""
import json
from scalerl_jax import storage
w = {workdir!r}
out = {{n: storage.exists(storage.join(w, n)) for n in (
    "metrics.jsonl", "config.json", "learner_state.json", "resumes.jsonl", "fit/fit.json",
    "base_policy/config.json", "final_policy/config.json", "checkpoints", "tb")}}
out["resumes"] = [json.loads(l) for l in storage.read_text(storage.join(w, "resumes.jsonl")).splitlines()]
out["train"] = [json.loads(l)["step"] for l in storage.read_text(storage.join(w, "metrics.jsonl")).splitlines()
                if json.loads(l)["kind"] == "train"]
print(json.dumps(out))
"""], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert probe.returncode == 0, probe.stderr[-2000:]
  got = json.loads(probe.stdout.strip().splitlines()[-1])
  missing = [k for k, v in got.items() if v is False and (k != "fit/fit.json" or s["fit_exists"])]
  assert not missing, missing                                  # every output is an object
  # (no logs/: with an external buffer the learner starts no child processes; pod logs are the
  # pods' own, STATE_DIR/pods/ here, `kubectl logs` on a cluster)
  assert [x["checkpoint_step"] in (2, 4) for x in got["resumes"]] == [True], got["resumes"]
  assert got["train"] == [1, 2, 3, 4, 5, 6], got["train"]
  _no_local_gs(ROOT, str(tmp_path), str(state))


@pytest.mark.slow
@pytest.mark.xdist_group("rehearse")
def test_rehearse_kill_learner_before_any_checkpoint_starts_over(tmp_path):
  """kill -9 of a learner pod at step 1, before the first checkpoint (step 2) exists: the
  restarted learners find no checkpoint and start over; their start-over request makes the
  running buffer (holding versions up to 2) restart and rewind to step 0 instead of refusing
  version 0; the run reaches its last step with no acknowledged rollout lost or trained twice."""
  state = tmp_path / "state"
  r = _rehearse([VARIANT, "--steps=3", f"--state-dir={state}", "--kill=learner",
                 "--kill-at-step=1", "--kill-before-checkpoint"])
  s = _summary(r)
  print(json.dumps({k: s[k] for k in ("wall_s", "steps", "jobset_restarts", "kill")}, indent=1))
  # 3 evaluations: too few for the fit (it says so); the buffer's NPR history was reset with the
  # start-over (its WAL snapshot holds the fresh one, the updates since are NPR records)
  _common_checks(s, steps=3, fit=False, npr_history=False)
  assert s["jobset_restarts"] == 1
  assert s["kill"]["checkpoint_at_kill"] is None, s["kill"]
  a = _learner_kill_checks(s)
  assert a["started_over"] == 1 and a["resumed_from"] == [], a
  assert a["buffer_rewinds"] == ["learner started over from step 0"], a
  buf = [p for p, v in s["pods"].items() if v["component"] == "buffer"][0]
  assert s["pods"][buf]["exit_codes"] == [75], s["pods"][buf]      # RESTART_EXIT, then replayed
  metrics = [json.loads(l) for l in open(state / "workdir" / "metrics.jsonl")]
  assert [l["step"] for l in metrics if l["kind"] == "train"] == [1, 2, 3]
  assert glob.glob(str(state / "workdir" / "previous-*" / "metrics.jsonl"))   # set aside


# ---- the pieces the rehearsal relies on (fast) ---------------------------------------------------
def test_hosts_override_table():
  from scalerl_jax import hosts
  env = {"SCALERL_HOSTS": "svc.ns.svc.cluster.local=127.9.9.1, 0.0.0.0=127.9.9.2,pod-0.sub=::1"}
  assert hosts.resolve("svc.ns.svc.cluster.local:50051", env) == "127.9.9.1:50051"
  assert hosts.resolve("0.0.0.0:50052", env) == "127.9.9.2:50052"
  assert hosts.resolve("[::]:50052", env) == "127.9.9.2:50052"          # any wildcard
  assert hosts.resolve("pod-0.sub:8476", env) == "[::1]:8476"
  assert hosts.resolve("other:1", env) == "other:1"
  assert hosts.resolve("svc.ns.svc.cluster.local:50051", {}) == "svc.ns.svc.cluster.local:50051"
  with pytest.raises(ValueError, match="NAME=ADDRESS"):
    hosts.table({"SCALERL_HOSTS": "nonsense"})


def test_buffer_asks_for_restart_when_the_learner_resumed(tmp_path):
  """A running buffer that gets a pull for an earlier step / an older published version from a
  learner whose resume request it has not applied stops (UNAVAILABLE to the caller) so that its
  restart replays the WAL and rewinds (the rehearsal's learner-kill path)."""
  import grpc
  import numpy as np
  from scalerl_jax.buffer.replay import write_learner_state
  from scalerl_jax.buffer.server import BufferServer
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.types import PromptSpec
  prompts = [PromptSpec(i, np.arange(3, dtype=np.int32) + i, "1") for i in range(8)]
  srv = BufferServer(prompts, token="t" * 32, prompts_per_step=2, group_size=2, max_lag=1,
                     wal_dir=str(tmp_path / "wal")).start()
  ls = str(tmp_path / "learner_state.json")
  srv.learner_state_path = ls
  c = BufferClient(srv.address, "t" * 32, retries=0)
  try:
    publish_params(c, 0)
    publish_params(c, 1)
    with pytest.raises(grpc.RpcError) as e:          # no resume announced: the plain error
      publish_params(c, 1, tag=1)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert not srv.restart_requested.is_set()
    write_learner_state(ls, 0, 0, dict(id="r1", step=0, npr=None))
    with pytest.raises(grpc.RpcError) as e:
      publish_params(c, 0, retries=0)             # the resumed learner republishes
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert srv.restart_requested.is_set()
  finally:
    c.close()
    srv.stop(0)


def test_start_over_after_a_previous_run_makes_the_running_buffer_rewind(tmp_path):
  """A learner that finds no valid checkpoint in a used workdir starts over with a start-over
  request (a resume from step 0): a buffer still holding the previous run's versions restarts
  (instead of refusing version 0) and its restart rewinds to step 0 from the WAL. A first run in
  an empty workdir announces nothing."""
  import grpc
  import ml_collections
  import numpy as np
  from scalerl_jax.training import job
  from scalerl_jax.buffer.replay import read_learner_state
  from scalerl_jax.buffer.server import BufferServer
  from scalerl_jax.protocol.client import BufferClient
  from scalerl_jax.types import PromptSpec
  cfg = ml_collections.ConfigDict(dict(resume="auto", local_dir="", checkpoint=dict(verify="metadata"),
                                       rl=dict(npr_threshold=0.9)))
  wd = tmp_path / "run"
  wd.mkdir()
  ls = str(wd / "learner_state.json")
  assert job.prepare_resume(cfg, str(wd)) is None
  assert read_learner_state(ls)["resume"] is None             # first run: nothing to rewind
  prompts = [PromptSpec(i, np.arange(3, dtype=np.int32) + i, "1") for i in range(8)]
  kw = dict(token="t" * 32, prompts_per_step=2, group_size=2, max_lag=1,
            wal_dir=str(tmp_path / "wal"))
  srv = BufferServer(prompts, learner_state=read_learner_state(ls), **kw).start()
  srv.learner_state_path = ls
  c = BufferClient(srv.address, "t" * 32, retries=0)
  try:
    for v in range(3):
      publish_params(c, v)
    (wd / "metrics.jsonl").write_text('{"step": 1, "kind": "train"}\n')
    assert job.prepare_resume(cfg, str(wd)) is None           # no checkpoint: start over
    res = read_learner_state(ls)["resume"]
    assert res["start_over"] and res["step"] == 0 and res["npr"]["threshold"] == 0.9, res
    assert list(wd.glob("previous-*/metrics.jsonl"))          # the previous run, set aside
    with pytest.raises(grpc.RpcError) as e:
      publish_params(c, 0, retries=0)             # not FAILED_PRECONDITION: restart to rewind
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert srv.restart_requested.is_set()
  finally:
    c.close()
    srv.stop(0)
  srv = BufferServer(prompts, learner_state=read_learner_state(ls), **kw).start()
  c = BufferClient(srv.address, "t" * 32, retries=0)
  try:
    rep = srv.wal_report["resume"]
    assert rep["step"] == 0 and rep["from_version"] == 2, rep
    assert srv.state.version == 0 and srv.state.resumes[-1] == res["id"]
    publish_params(c, 0)                # the started-over learner's version 0
  finally:
    c.close()
    srv.stop(0)
