"""Multi-host learner: 2 JAX processes on localhost (2 CPU devices each, gloo collectives) train
the tiny Llama for 3 steps on a fixed synthetic batch — every host feeding only its own rows via
make_array_from_process_local_data — and end with the same parameters as ONE process with the
same 4-device mesh, and as one process without a mesh (≤ 1e-5).

This file is also the worker: `python tests/e2e/test_multihost.py MODE OUT.npz`, MODE = multi | single.
"""
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # also run as a script
from helpers import finish, free_port, start, xla_flags  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOL = 1e-5
STEPS = 3


def _batches(vocab):
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import rl_reference as ref
  rng = np.random.default_rng(0)
  out = []
  for _ in range(STEPS):
    batch, _ = ref.make_batch(rng, num_prompts=4, gens=4, seq=32)
    batch["tokens"] = rng.integers(0, vocab, batch["tokens"].shape).astype(np.int32)
    glp = np.full(batch["tokens"].shape, -np.log(vocab), np.float32)
    glp += (0.3 * rng.standard_normal(glp.shape)).astype(np.float32)
    batch["gen_logprobs"] = np.minimum(glp, -1e-3)
    out.append(batch)
  return out


def _worker(mode, out_path):
  from scalerl_jax import distributed
  spec = distributed.initialize()          # env SCALERL_* (multi) or a no-op (single)
  import jax
  from configs import tiny
  from scalerl_jax import config as common
  from scalerl_jax import models, sharding
  from scalerl_jax.learner import Learner

  replicated = os.environ.get("TEST_MESH") == "replicated"   # tensor 2 splits the vocab: even
  cfg = models.get_preset("tiny_llama3", num_layers=2, vocab_size=98 if replicated else 97,
                          d_model=64, head_dim=16, ffn_dim=128)
  config = tiny.get_config()
  config.optim.microbatches = 2
  config.optim.lr, config.optim.warmup_steps = 3e-4, 1   # explicit: independent of tiny.py tuning
  config.mesh.shape = (("data", 2), ("fsdp", 2), ("tensor", 1), ("expert", 1))
  if replicated:
    # tensor major: each process holds one tensor half of BOTH fsdp shards, so both processes
    # feed every row (a batch replicated across processes, as in sequence-parallel layouts)
    config.mesh.shape = (("data", 1), ("tensor", 2), ("fsdp", 2), ("expert", 1))
  config.model.logits_chunk = 8   # log-probs over 4 sequence chunks of the 32 positions
  apply_fn = lambda p, t, pos: models.forward_hidden(p, cfg, t, pos)   # (hidden, head kernel)
  batches = _batches(cfg.vocab_size)
  t0 = time.perf_counter()
  init = jax.tree.map(np.asarray, models.init_params(cfg, jax.random.PRNGKey(0)))
  if mode == "nomesh":
    learner = Learner.for_run(apply_fn, jax.tree.map(np.array, init),
                              common.RunConfig.from_config(config), vocab_size=cfg.vocab_size)
    metrics = [learner.step(b) for b in batches]
  else:
    assert jax.device_count() == 4, jax.devices()
    mesh = sharding.make_mesh(config.mesh.shape)
    params, shardings = sharding.sharded_init(cfg, jax.random.PRNGKey(0), mesh, config.mesh.rules)
    learner = distributed.MultiHostLearner.for_run(apply_fn, params,
                                                   common.RunConfig.from_config(config), mesh=mesh,
                                           params_sharding=shardings, vocab_size=cfg.vocab_size)
    rows = learner.local_rows(batches[0]["tokens"].shape[0])
    if jax.process_index() == 1:   # a slower host: its first step starts TEST_SKEW_S late
      time.sleep(float(os.environ.get("TEST_SKEW_S", 0)))
    metrics = [learner.step({k: v[rows] for k, v in b.items()}) for b in batches]
  # The parity gate's learner log-probs (trainer._parity): every process passes the global tokens;
  # sharded over the batch, chunked over the sequence (no [B,T,V] logits), a collective.
  logp = learner.token_logprobs(batches[0]["tokens"])
  params = distributed.gather_to_host(learner.state.params)
  from scalerl_jax.training.trainer import learner_token_logprobs   # one host, whole logits: the reference
  ref_lp = learner_token_logprobs(cfg, params, batches[0]["tokens"])
  bcast = None
  if mode == "multi":   # process 0's batch reaches every host byte for byte (bool / int64 kept)
    src = dict(b=np.array([[True, False, True]]), i=np.arange(4, dtype=np.int64) << 40,
               f=np.linspace(-1, 1, 7, dtype=np.float32), e=np.zeros((0, 3), np.int32))
    got = distributed.broadcast_from_main(src if jax.process_index() == 0 else None)
    bcast = all(got[k].dtype == v.dtype and got[k].shape == v.shape and np.array_equal(got[k], v)
                for k, v in src.items()) and list(got) == list(src)
  flat = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
  if jax.process_index() == 0:
    np.savez(out_path, **flat)
  print(json.dumps(dict(mode=mode, process=jax.process_index(), processes=spec.num_processes,
                        local_devices=jax.local_device_count(), devices=jax.device_count(),
                        bcast=bcast, rows=[rows.start, rows.stop] if mode != "nomesh" else None,
                        steps=int(np.asarray(distributed.gather_to_host(learner.state.step))),
                        losses=[m["loss"] for m in metrics],
                        logp_shape=list(logp.shape), logp_sum=float(np.sum(logp)),
                        logp_vs_full_logits=float(np.abs(logp - ref_lp).max()),
                        max_update=max(float(np.abs(a - b).max()) for a, b in
                                       zip(jax.tree.leaves(params), jax.tree.leaves(init))), seconds=time.perf_counter() - t0)))


def _fail_worker():
  """Process 0 fails once both joined while process 1 waits for it in a collective."""
  from scalerl_jax import distributed
  spec = distributed.initialize()
  try:
    import jax
    if jax.process_index() == 0:
      time.sleep(1)
      raise RuntimeError("process 0 fails on purpose")
    distributed.broadcast_from_main(None)
  except BaseException as e:
    distributed.exit_on_error(spec, e)
    raise


def _env(devices, **extra):
  env = dict(os.environ, XLA_FLAGS=xla_flags(devices),
             JAX_PLATFORMS="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.update({k: str(v) for k, v in extra.items()})
  return env


def _last_json(text):
  return json.loads(text.strip().splitlines()[-1])


def test_spec_from_config_and_env():
  import importlib
  from scalerl_jax.distributed import DistributedSpec
  c = importlib.import_module("configs.8b").get_config()
  assert DistributedSpec.from_config(c, {}).num_processes == 1          # single host: no-op
  env = dict(SCALERL_COORDINATOR="10.0.0.1:1234", SCALERL_NUM_PROCESSES="4", SCALERL_PROCESS_ID="3")
  s = DistributedSpec.from_config(c, env)
  assert (s.coordinator_address, s.num_processes, s.process_id) == ("10.0.0.1:1234", 4, 3)
  c.distributed.process_id = 1                                           # config wins over env
  assert DistributedSpec.from_config(c, env).process_id == 1
  c.distributed.num_processes, c.distributed.process_id = 2, -1
  with pytest.raises(ValueError, match="need a coordinator address"):
    DistributedSpec.from_config(c, {})
  with pytest.raises(ValueError, match=r"process_id 5 not in \[0, 4\)"):
    DistributedSpec.from_config(None, dict(env, SCALERL_PROCESS_ID="5"))


def _two_processes(cmd, log, devices, **extra_env):
  """`cmd` as the 2 processes of one jax.distributed job (`devices` CPU devices each); output to
  files `log`0 / `log`1 (.out/.err)."""
  port = free_port()
  return [start(cmd, f"{log}{i}", cwd=ROOT,
                env=_env(devices, SCALERL_COORDINATOR=f"127.0.0.1:{port}", SCALERL_NUM_PROCESSES=2,
                         SCALERL_PROCESS_ID=i, **extra_env)) for i in range(2)]


def _start_two(me, tmp_path, **extra_env):
  """This file's "multi" mode as 2 processes of one jax.distributed job (2 CPU devices each)."""
  return _two_processes([sys.executable, me, "multi", str(tmp_path / "multi.npz")],
                        str(tmp_path / "multi"), 2, **extra_env)


def _collect_two(procs) -> list:
  """Each process's last JSON line (each must exit 0)."""
  outs = []
  for rc, so, se in finish(procs, timeout=600):
    assert rc == 0, se[-4000:]
    outs.append(_last_json(so))
  return outs


@pytest.mark.slow
def test_two_processes_equal_one(tmp_path):
  me = os.path.abspath(__file__)
  # Process 1 starts its first step 45 s late (more than gloo's 30 s connect timeout), as a slower
  # host would: CI failed "Gloo context initialization failed ... Connect timeout" on such a skew.
  procs = _start_two(me, tmp_path, TEST_SKEW_S=45)
  single = subprocess.run([sys.executable, me, "single", str(tmp_path / "single.npz")], cwd=ROOT,
                          env=_env(4), capture_output=True, text=True, timeout=300)
  nomesh = subprocess.run([sys.executable, me, "nomesh", str(tmp_path / "nomesh.npz")], cwd=ROOT,
                          env=_env(1), capture_output=True, text=True, timeout=300)
  outs = _collect_two(procs)
  assert single.returncode == 0, single.stderr[-4000:]
  assert nomesh.returncode == 0, nomesh.stderr[-4000:]
  s, n = _last_json(single.stdout), _last_json(nomesh.stdout)
  print(f"\n[multihost] {outs}\n[single] {s}\n[nomesh] {n}")
  # two processes, each with 2 local devices of 4, each feeding its own half of the 16 rows
  assert [o["process"] for o in outs] == [0, 1]
  assert all(o["processes"] == 2 and o["local_devices"] == 2 and o["devices"] == 4 for o in outs)
  assert sorted(tuple(o["rows"]) for o in outs) == [(0, 8), (8, 16)]
  assert all(o["bcast"] is True for o in outs), outs
  assert all(o["steps"] == STEPS for o in outs + [s, n])
  for o in outs:                          # every host sees the same (global) metrics
    np.testing.assert_allclose(o["losses"], s["losses"], rtol=1e-5, atol=1e-7)
  # parity-gate log-probs: multi-host sharded + chunked == one-host whole-logits reference
  for o in outs + [s, n]:
    assert o["logp_shape"] == [16, 32] and o["logp_vs_full_logits"] <= 1e-5, o
    assert abs(o["logp_sum"] - n["logp_sum"]) <= 1e-5 * abs(n["logp_sum"]), (o, n)
  multi, one, flat = (np.load(tmp_path / f"{m}.npz") for m in ("multi", "single", "nomesh"))
  assert set(multi.files) == set(one.files) == set(flat.files) and len(multi.files) > 5
  assert n["max_update"] > 1e-4, n          # the 3 steps really moved the parameters
  for ref, name in ((one, "single"), (flat, "nomesh")):
    diff = max(float(np.abs(multi[k].astype(np.float64) - ref[k]).max()) for k in multi.files)
    print(f"max |multi - {name}| = {diff:.3g}")
    assert diff <= TOL, (name, diff)


@pytest.mark.slow
@pytest.mark.long      # a second 2-process job + a reference (~300 s in the suite); make test-long
def test_batch_replicated_across_processes(tmp_path):
  """Both processes feed the whole batch (their devices hold all batch shards): an even split
  (topologies.even_process_split), trained as one process with the same mesh. Before, a process
  slice longer than rows / processes was refused ("uneven batch split across 2 processes")."""
  me = os.path.abspath(__file__)
  procs = _start_two(me, tmp_path, TEST_MESH="replicated")
  single = subprocess.run([sys.executable, me, "single", str(tmp_path / "single.npz")], cwd=ROOT,
                          env=_env(4, TEST_MESH="replicated"), capture_output=True, text=True,
                          timeout=300)
  outs = _collect_two(procs)
  assert single.returncode == 0, single.stderr[-4000:]
  s = _last_json(single.stdout)
  assert [tuple(o["rows"]) for o in outs] == [(0, 16), (0, 16)]
  for o in outs:
    np.testing.assert_allclose(o["losses"], s["losses"], rtol=1e-5, atol=1e-7)
  multi, one = np.load(tmp_path / "multi.npz"), np.load(tmp_path / "single.npz")
  diff = max(float(np.abs(multi[k].astype(np.float64) - one[k]).max()) for k in multi.files)
  assert diff <= TOL, diff


@pytest.mark.slow
def test_failed_process_exits_at_once_and_so_do_the_others(tmp_path):
  """distributed.exit_on_error (main calls it): when process 0 fails, both processes exit 1 within
  seconds with a one-line error, not after jax.distributed's 5-min shutdown barrier (process 1
  blocked in a collective waiting for process 0 fails as soon as process 0 is gone)."""
  t0 = time.time()
  res = finish(_two_processes([sys.executable, os.path.abspath(__file__), "fail", "-"],
                              str(tmp_path / "fail"), 1), timeout=240)
  rcs, errs = [r[0] for r in res], [r[2] for r in res]
  took = time.time() - t0
  print(f"both exited in {took:.0f} s")
  assert rcs[0] == 1, errs[0][-2000:]
  lines = [[l for l in e.splitlines() if l.startswith("learner process ")] for e in errs]
  assert lines[0] == ["learner process 0 of 2 failed: RuntimeError: process 0 fails on purpose "
                      "(exiting now, without jax.distributed's shutdown barrier)"], errs[0][-2000:]
  # process 1: its collective fails (exit 1, our one line), or jax's coordination agent ends it
  # first when process 0's coordination service goes away (SIGABRT, jax's own fatal message)
  if rcs[1] == 1:
    assert len(lines[1]) == 1 and lines[1][0].startswith("learner process 1 of 2 failed: "), errs[1]
  else:
    assert rcs[1] == -6 and "another task died" in errs[1], errs[1][-2000:]
  assert took < 120, took          # jax's shutdown barrier alone waits 300 s


@pytest.mark.slow
def test_main_runs_as_two_processes(tmp_path):
  """`python -m scalerl_jax.main` as 2 JAX processes (1 CPU device each, mesh fsdp=2): process 0
  runs buffer + generator + evaluation, both train the sharded step, each streams its own shards,
  orbax saves collectively; metrics are written once per step. The params moved from the base policy
  exactly when a step was not skipped (3 steps of a 10-step SFT policy can all draw all-equal
  rewards: not assumed either way)."""
  import jax
  from scalerl_jax.training import checkpoint
  cmd = [sys.executable, "-m", "scalerl_jax.main", "--config=configs/tiny.py",
         f"--workdir={tmp_path}", "--config.total_steps=3", "--config.sft.clean_steps=20",
         "--config.sft.steps=10", "--config.eval.every_steps=3",
         "--config.eval.samples_per_prompt=1", "--config.data.heldout=8",
         "--config.rollout.max_lag=1", "--config.checkpoint.every_steps=3",
         "--config.pin_cpus=False", "--config.health.parity_gate=always"]
  res = finish(_two_processes(cmd, str(tmp_path / "main"), 1), timeout=800)
  for rc, _, err in res:
    assert rc == 0, err[-4000:]
  lines = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  train = [l for l in lines if l["kind"] == "train"]
  assert [l["step"] for l in train] == [1, 2, 3]               # once each: only process 0 logs
  assert [l["step"] for l in lines if l["kind"] == "eval"] == [0, 3]
  assert all(np.isfinite(l["loss"]) and 0 <= l["max_lag"] <= 1 for l in train)
  assert sum(l["policy_tokens"] for l in train) > 0
  # The parity gate runs multi-host (it was off for every multi-host learner): step 1 re-scored
  # the whole first batch with the sharded learner; an fp32 JAX generator matches it closely.
  assert train[0]["health/parity_tokens"] > 0 and train[0]["health/parity_alarm"] == 0
  assert train[0]["health/parity_mean_abs"] < 1e-3, train[0]
  step, meta, _ = checkpoint.find_valid(str(tmp_path))
  assert step == 3 and meta["consumed"]["step"] == 3
  # The collectively saved state restores in one process and moved away from the base policy.
  from scalerl_jax import models
  from scalerl_jax.models import sections as model_sections
  from scalerl_jax.training.checkpoint import RunCheckpointer
  from scalerl_jax.learner.optimizer import make_optimizer
  from scalerl_jax.learner.state import LearnerState
  from scalerl_jax import config as run_config
  config = run_config.resolve_config(str(tmp_path / "config.json"))
  cfg = model_sections.model_config(config)
  base = models.load_hf(str(tmp_path / "base_policy"))[1]
  abstract = jax.eval_shape(lambda p: LearnerState.create(p, make_optimizer(config.optim)),
                            models.init_params(cfg, jax.random.PRNGKey(0)))
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])   # saved over 2 processes' devices
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
  state, _ = RunCheckpointer(str(tmp_path)).restore(abstract, 3)
  applied = 3 - sum(int(l["skipped"]) for l in train)          # skipped: all-equal rewards
  assert int(state.step) == applied
  leaves = jax.tree.leaves(state.params)
  assert all(np.isfinite(np.asarray(x)).all() for x in leaves)
  assert jax.tree.structure(base) == jax.tree.structure(state.params)
  moved = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
              for a, b in zip(leaves, jax.tree.leaves(base)))
  assert (moved > 0) == (applied > 0), (moved, applied)   # moved iff an update was applied


if __name__ == "__main__":
  if sys.argv[1] == "fail":
    _fail_worker()
  else:
    _worker(sys.argv[1], sys.argv[2])
