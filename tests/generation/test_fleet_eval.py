"""Fleet evaluation agrees with learner-local evaluation (issue 15 item 4), in one process: a real
buffer server, a real generator `Worker` (JAX backend, tiny model) on a thread, the learner side's
`FleetEvaluator`, and the trainer's local `evaluate` on the same params, prompts and seeds.

The evaluation is pinned: version 1 (other weights) is published and installed in the worker's
training sampler before version 0 is evaluated, and the version-0 evaluation still equals the
learner's evaluation of version 0's params."""
import collections
import dataclasses
import os
import threading
import time

import jax
import numpy as np
import pytest

from scalerl_jax.generation import interruption
from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax import config as common
from scalerl_jax import models
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.data import build_dataset
from scalerl_jax.generation.continuous import ContinuousDecoder
from scalerl_jax.generation.sampler import JaxSampler
from scalerl_jax.generation.slots import requests_for
from scalerl_jax.training.fleet_eval import FleetEvaluator, eval_prompts
from scalerl_jax.generation.worker import Worker
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.training.sft import train_sft
from scalerl_jax.training.evaluation import evaluate
from scalerl_jax.weights.stream import StreamPublisher

TOKEN = "fleet-eval-test-token"
SAMPLES = 8


def _binomial_agree(p1, n1, p2, n2):
  """|p1 - p2| within the 95 % interval of the difference of two binomial proportions."""
  p = (p1 * n1 + p2 * n2) / (n1 + n2)
  half = 1.96 * np.sqrt(max(p * (1 - p), 1e-12) * (1 / n1 + 1 / n2))
  return abs(p1 - p2) <= half, half


# One worker runs the module: its module-scoped fixture is costly and runs once per worker.
pytestmark = pytest.mark.xdist_group("fleet_eval")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  wd = tmp_path_factory.mktemp("fleet_eval")
  c = tiny.get_config()
  c.eval.mode = "fleet"
  c.eval.samples_per_prompt = SAMPLES
  c.eval.num_prompts = 40               # a seeded subset of the 64 held-out prompts
  c.rollout.think_budget_min, c.rollout.think_budget_max = 3, 5
  c.generator.groups_per_lease = 2
  c.generator.heartbeat_s = 2.0       # keeps the evaluation leases alive under load
  # Evaluation leases as one static batch, as the learner's local evaluation samples them (the
  # exact comparison below); the continuous lane (the default, 64 slots) is the last test's.
  c.generator.eval_decode_batch = 0
  c.rewards.log = False
  ds = build_dataset(c.data, c.rollout.max_prompt_len)
  mcfg = model_sections.model_config(c)
  p1 = models.init_params(mcfg, jax.random.PRNGKey(1))    # version 1: untrained
  # 60 SFT steps: held-out pass rate 0.09 (120 steps: 0.11), enough for "not 0 == 0" below at
  # half the CPU (in-process SFT compiled at the tests' level 0 runs ~1.3 CPU-s a step here)
  p0, _ = train_sft(mcfg, models.init_params(mcfg, jax.random.PRNGKey(0)),
                    [(*ds.sft_batch(1024, seed=0, step_noise=0.0), 60)], batch_size=64, lr=1e-3,
                    progress=False)
  p0, p1 = jax.device_get(p0), jax.device_get(p1)
  srv = BufferServer(ds.train, token=TOKEN, prompts_per_step=8, group_size=8, max_lag=2).start()
  os.environ[c.buffer.auth_token_env] = TOKEN
  client = BufferClient(srv.address, TOKEN, retries=3)
  StreamPublisher(client, 0, p0).publish()
  worker = Worker(common.RunConfig.from_config(c), srv.address, "gen-0", "jax", str(wd))
  th = threading.Thread(target=worker.run, daemon=True)
  th.start()
  StreamPublisher(client, 1, p1).publish()
  t0 = time.time()
  while worker.held_versions() != [0, 1] or worker.gen.version != 1:
    worker.gen.apply_pending()
    assert time.time() - t0 < 120, worker.held_versions()
    time.sleep(0.05)
  yield dict(c=c, ds=ds, mcfg=mcfg, params={0: p0, 1: p1}, client=client, worker=worker)
  worker.stop()
  th.join(30)
  worker.close()
  client.close()
  srv.stop()


@pytest.mark.parametrize("version", [0, 1])
def test_fleet_equals_local_at_the_pinned_version(setup, version):
  c, ds = setup["c"], setup["ds"]
  prompts = eval_prompts(ds.heldout, int(c.eval.num_prompts), int(c.seed))
  spec = interruption.sampling_spec(c, ds, seed=12345, temperature=float(c.eval.temperature),
                               top_p=float(c.eval.top_p))
  fe = FleetEvaluator(setup["client"], prompts, num_prompts=0, samples_per_prompt=SAMPLES,
                      seed=spec.seed, temperature=spec.temperature, top_p=spec.top_p,
                      timeout_s=300)
  t0 = time.time()
  fe.submit(step=version, version=version, snapshot={"compute_hours": 0.0})
  (e, res), = fe.poll(block=True)
  fleet_s = time.time() - t0
  assert res is not None and all(g.version == version for g in res.results)
  fleet = fe.record(e, res)
  local = evaluate(setup["mcfg"], setup["params"][version], ds, spec, SAMPLES, prompts=prompts)
  n = len(prompts) * SAMPLES
  assert fleet["val_samples"] == local["val_samples"] == n
  ok, half = _binomial_agree(fleet["val_pass_rate"], n, local["val_pass_rate"], n)
  print(f"version {version}: fleet {fleet['val_pass_rate']:.4f} local "
        f"{local['val_pass_rate']:.4f} (95% half-width {half:.4f}); fleet eval {fleet_s:.1f} s, "
        f"{fleet['eval_group_device_s']:.2f} generator device-s")
  assert ok, (fleet, local)
  # Same params, prompts, seeds and 64-prompt chunks: the samples are the same, not only close.
  assert fleet["val_pass_rate"] == pytest.approx(local["val_pass_rate"], abs=1e-9)
  assert fleet["val_len"] == pytest.approx(local["val_len"], abs=1e-9)
  if version == 0:
    assert local["val_pass_rate"] > 0.05     # a trained policy: the comparison is not 0 == 0
  assert setup["worker"].gen.version == 1    # training sampling stayed on the newest version


def test_continuous_evaluation_lane_agrees_with_local(setup):
  """The same worker with its evaluation leases decoded through 16 slots (fewer than the 320
  samples: freed slots take waiting samples; generation/eval_lane.py `_eval_sample`): every
  group's rewards equal those of a ContinuousDecoder run here on version 0's params with the
  lease's seed (the eval seed + its first group id, as `serve_eval` sets it), graded by the
  dataset; each sample draws its own random stream, so the pass rate agrees with the local
  (static batch) evaluation within the binomial interval, not to the bit; every group is the
  pinned version's, and training sampling stays on the newest version."""
  c, ds, worker = setup["c"], setup["ds"], setup["worker"]
  prompts = eval_prompts(ds.heldout, int(c.eval.num_prompts), int(c.seed))
  spec = interruption.sampling_spec(c, ds, seed=777, temperature=float(c.eval.temperature),
                               top_p=float(c.eval.top_p))
  c2 = c.copy_and_resolve_references()
  c2.generator.eval_decode_batch = 16
  static_config, worker.config = worker.config, common.RunConfig.from_config(c2)
  try:
    fe = FleetEvaluator(setup["client"], prompts, num_prompts=0, samples_per_prompt=SAMPLES,
                        seed=spec.seed, temperature=spec.temperature, top_p=spec.top_p,
                        timeout_s=300)
    fe.submit(step=0, version=0, snapshot={"compute_hours": 0.0})
    (e, res), = fe.poll(block=True)
  finally:
    worker.config = static_config
  assert res is not None and all(g.version == 0 for g in res.results)
  lease_spec = dataclasses.replace(spec, seed=spec.seed + min(g.group_id for g in res.results))
  dec = ContinuousDecoder(JaxSampler(setup["mcfg"], setup["params"][0], version=0), 16, lease_spec,
                          max_prompt_len=int(c.rollout.max_prompt_len))
  ref = collections.defaultdict(lambda: [0.0] * SAMPLES)
  for r, comp in dec.run(requests_for(prompts, SAMPLES, lease_spec)):
    ref[r.prompt.prompt_id][r.sample_index] = ds.grade(comp.tokens, r.prompt.answer, r.prompt.task).reward
  assert {g.prompt_id: list(g.rewards) for g in res.results} == dict(ref)
  fleet = fe.record(e, res)
  local = evaluate(setup["mcfg"], setup["params"][0], ds, spec, SAMPLES, prompts=prompts)
  n = len(prompts) * SAMPLES
  assert fleet["val_samples"] == n
  ok, half = _binomial_agree(fleet["val_pass_rate"], n, local["val_pass_rate"], n)
  print(f"continuous lane: fleet {fleet['val_pass_rate']:.4f} local {local['val_pass_rate']:.4f} "
        f"(95% half-width {half:.4f}); {fleet['eval_group_device_s']:.2f} generator device-s")
  assert ok, (fleet, local)
  assert fleet["val_pass_rate"] > 0.05
  assert worker.gen.version == 1
