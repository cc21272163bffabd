"""SIGTERM / preemption: a generator process sent SIGTERM gives its leased groups back to the buffer
at once (not after lease_ttl_s) and exits 0.

The lease is held by force, not by timing: the generator runs the scripted backend with every
sample boxing a hostile math answer, guards off and a 600 s grading deadline, so no group it leased
can finish; the buffer's lease TTL is an hour, so only the release can put the groups back."""
import json
import os
import signal
import subprocess
import sys
import time

import jax
import pytest

from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax import models
from scalerl_jax.buffer.server import BufferServer
from scalerl_jax.data import build_dataset
from scalerl_jax.data.tiny_hf_tokenizer import write_llama3_style_tokenizer
from scalerl_jax.protocol.client import BufferClient
from scalerl_jax.config import apply_overrides
from scalerl_jax.weights.stream import StreamPublisher

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKEN = "preemption-test-token-0123456789"

pytestmark = pytest.mark.xdist_group("preemption")


def _held(srv, prefix: str) -> list:
  """(group_id, prompt_id) of the incomplete training groups leased to a `prefix`* generator."""
  with srv.state.cv:
    return sorted((gid, g.view.prompt_id) for gid, g in srv.state._groups.items()
                  if g.generator_id.startswith(prefix) and not g.complete)


def test_sigterm_releases_the_leases_at_once_and_exits_zero(tmp_path):
  write_llama3_style_tokenizer(str(tmp_path / "tok"), vocab_size=512)
  rows = [{"problem": f"What is {a} + {b}?", "answer": str(a + b)} for a in range(3, 7) for b in (11, 12)]
  (tmp_path / "math.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  overrides = [
      "--config.data.kind=polaris", "--config.data.heldout=2", f"--config.data.path={tmp_path / 'math.jsonl'}",
      f"--config.data.tokenizer_path={tmp_path / 'tok'}", "--config.data.template=reasoning_instruct",
      "--config.generator.backend=scripted", "--config.generator.continuous=True",
      "--config.generator.decode_batch=8", "--config.generator.groups_per_lease=2",
      "--config.generator.heartbeat_s=0.2", "--config.generator.scripted_hostile_every=1",
      "--config.rewards.grade_timeout_s=600", "--config.rewards.grade_guard=False",
      "--config.rewards.grade_processes=1",
      "--config.rewards.log=False", "--config.model.vocab_size=512", "--config.model.num_layers=1",
      "--config.model.d_model=64", "--config.model.num_heads=1", "--config.model.ffn_dim=128",
      "--config.rollout.max_prompt_len=96", "--config.rollout.think_budget_min=8",
      "--config.rollout.think_budget_max=16", "--config.rollout.answer_budget=32"]
  c = tiny.get_config()
  apply_overrides(c, overrides)
  ds = build_dataset(c.data, c.rollout.max_prompt_len)
  params = jax.device_get(models.init_params(model_sections.model_config(c), jax.random.PRNGKey(0)))
  srv = BufferServer(ds.train, token=TOKEN, prompts_per_step=2, group_size=4, max_lag=1,
                     lease_ttl_s=3600.0).start()
  StreamPublisher(BufferClient(srv.address, TOKEN, retries=3), 0, params).publish()
  env = dict(os.environ, **{c.buffer.auth_token_env: TOKEN, "PYTHONPATH": ROOT,
                            "JAX_PLATFORMS": "cpu"})
  err = open(tmp_path / "gen.err", "w")
  proc = subprocess.Popen(
      [sys.executable, "-m", "scalerl_jax.generation.worker", "--run_config=configs/tiny.py",
       f"--buffer={srv.address}", "--generator_id=gen-term", f"--workdir={tmp_path}", *overrides],
      cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
  try:
    deadline = time.monotonic() + 240
    while not _held(srv, "gen-term@") and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    held = _held(srv, "gen-term@")
    assert held, (proc.poll(), (tmp_path / "gen.err").read_text()[-3000:])
    time.sleep(1.0)        # heartbeats have extended the leases: they are live, not lapsing
    held = _held(srv, "gen-term@")
    expired0 = srv.state.expired_groups
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=30)
  finally:
    if proc.poll() is None:
      proc.kill()
    err.close()
  log = (tmp_path / "gen.err").read_text()
  assert rc == 0, log[-3000:]
  # Buffer state, not time: nothing is held by the generator any more, every group it held went
  # back (counted as expiries; the TTL is an hour, so none lapsed), and its prompts are at the
  # queue front, ready for the next lease.
  # (a lease on its way when the signal came lands after the first release: given back at exit)
  assert _held(srv, "gen-term@") == [], held
  released = srv.state.expired_groups - expired0
  assert released >= len(held), (held, released)
  assert {p for _, p in held} <= set(list(srv.state._queue)[:released]), held
  assert "SIGTERM: released" in log, log[-2000:]
  # Another generator leases those very prompts now, without waiting.
  other = BufferClient(srv.address, TOKEN, retries=3)
  got = other.lease_response("gen-other", max_groups=len(held), wait_timeout_s=0.0).assignments
  assert {a.prompt_id for a in got} == {p for _, p in held}
  srv.stop()


class _Clock:
  def __init__(self):
    self.t = 1000.0

  def __call__(self) -> float:
    return self.t


@pytest.mark.parametrize("elapsed_s, written", [(0.0, True), (74.9, True), (75.1, False), (200.0, False)])
def test_learner_final_checkpoint_only_when_the_grace_period_allows(tmp_path, caplog, elapsed_s, written):
  """grace 100 s, last save 10 s: needed = 1.5 * 10 + 10 = 25 s. Answered with >= 25 s left
  (<= 75 s after the SIGTERM) the checkpoint is written; with less, nothing is written and one
  line names the checkpoint that stands. The clock is a fake: the condition is forced."""
  from scalerl_jax.training import preemption
  clock = _Clock()
  p = preemption.Preemption(100.0, clock=clock)
  assert not p.requested and p.left_s() == 100.0
  p.on_sigterm()
  clock.t += elapsed_s
  need = preemption.SAFETY * 10.0 + preemption.MARGIN_S
  assert need == 25.0
  target = tmp_path / "ckpt-7"
  with caplog.at_level("WARNING", logger="scalerl.preemption"):
    saved = p.final_checkpoint(lambda: target.write_text("state"), last_save_s=10.0, last_step=5)
  assert saved is written and target.exists() is written
  assert (100.0 - elapsed_s >= need) is written
  lines = [r.getMessage() for r in caplog.records if "final checkpoint" in r.getMessage()]
  assert len(lines) == 1
  if not written:
    assert lines[0].startswith("SIGTERM: no final checkpoint") and "(step 5) stands" in lines[0]


def test_learner_without_a_timed_save_never_starts_a_final_one(tmp_path, caplog):
  from scalerl_jax.training import preemption
  p = preemption.Preemption(1e6, clock=_Clock())
  p.on_sigterm()
  target = tmp_path / "ckpt"
  with caplog.at_level("WARNING", logger="scalerl.preemption"):
    assert not p.final_checkpoint(lambda: target.write_text("x"), last_save_s=None, last_step=None)
  assert not target.exists()
  assert any("unknown needed" in r.getMessage() and "(step None) stands" in r.getMessage()
             for r in caplog.records)
