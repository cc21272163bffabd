"""Start-up and bad input: a sandbox that cannot start stops the run with a clear error (never a
silent unsandboxed fallback); bad test JSON is a counted reason; "none" is explicit and loud."""
import dataclasses
import json
import os
import shutil
import tempfile
import uuid

import pytest

from scalerl_jax.config import base_config
from scalerl_jax import rewards
from scalerl_jax.rewards import sandbox

OK_PROGRAM = "</think>\n```python\nprint(int(input()) * 2)\n```"
OK_TESTS = json.dumps([{"input": "21\n", "output": "42\n"}])


@pytest.fixture(autouse=True)
def _restore_settings():
  saved = sandbox.settings()
  yield
  sandbox.configure(**dataclasses.asdict(saved))


def _fake_bwrap(tmp_path, body):
  """A stand-in bwrap script, world-readable (as root, bwrap is started as uid 65534)."""
  d = tempfile.mkdtemp(prefix="fake_bwrap_")
  os.chmod(d, 0o755)
  p = os.path.join(d, "bwrap")
  with open(p, "w") as f:
    f.write("#!/bin/sh\n" + body + "\n")
  os.chmod(p, 0o755)
  _CLEANUP.append(d)
  return p


_CLEANUP = []


@pytest.fixture(autouse=True, scope="module")
def _cleanup_fakes():
  yield
  for d in _CLEANUP:
    shutil.rmtree(d, ignore_errors=True)


def test_default_config_checks_and_uses_the_sandbox():
  c = base_config()
  assert (c.rewards.code_sandbox, c.rewards.code_bwrap, c.rewards.code_python) == (
      "bwrap", "", "")
  info = rewards.prepare_code_rewards(c)
  assert info["mode"] == "bwrap" and os.path.isfile(info["bwrap"]) and 0 < info["start_ms"] < 10_000
  g = rewards.grade("code", OK_PROGRAM, OK_TESTS)
  assert (g.reward, g.reason, g.sandboxed) == (1.0, "pass", True)


@pytest.mark.parametrize("kind,match", [
    ("missing", "missing or not executable"),
    ("false", "did not start.*user namespaces"),
    ("refuses", "did not start.*setting up uid map: Permission denied"),
    ("no_python", "interpreter '/nonexistent/python3' not found"),
])
def test_broken_sandbox_refuses_to_start(kind, match, tmp_path):
  c = base_config()
  if kind == "missing":
    c.rewards.code_bwrap = str(tmp_path / "no-such-bwrap")
  elif kind == "false":
    c.rewards.code_bwrap = "/bin/false"
  elif kind == "refuses":      # what bwrap prints where the kernel refuses user namespaces
    c.rewards.code_bwrap = _fake_bwrap(tmp_path, "echo 'bwrap: setting up uid map: Permission denied' >&2; exit 1")
  else:
    c.rewards.code_python = "/nonexistent/python3"
  with pytest.raises(rewards.SandboxUnavailable, match=match) as e:
    rewards.prepare_code_rewards(c)
  assert "code_sandbox='none'" in str(e.value)          # says how to opt out, explicitly


def test_broken_sandbox_never_falls_back(tmp_path):
  marker = tmp_path / f"ran-{uuid.uuid4().hex}"
  # a "bwrap" that would run the command unsandboxed if we ever passed it through; it fails first
  sandbox.configure(bwrap=_fake_bwrap(tmp_path, "echo 'bwrap: Creating new namespace failed' >&2; exit 1"))
  prog = f"</think>\n```python\nopen({str(marker)!r}, 'w').write('x')\nprint(42)\n```"
  g = rewards.grade("code", prog, OK_TESTS)
  assert (g.reward, g.reason, g.sandboxed) == (0.0, "sandbox_error", True)
  assert "Creating new namespace failed" in g.detail and not marker.exists()
  assert rewards.compute_reward("code", prog, OK_TESTS) == 0.0
  sandbox.configure(bwrap=str(tmp_path / "gone"))
  assert rewards.grade("code", prog, OK_TESTS).reason == "sandbox_error" and not marker.exists()


def test_unsandboxed_needs_explicit_none_and_warns():
  c = base_config()
  c.rewards.code_sandbox = "none"
  with pytest.warns(RuntimeWarning, match="UNSANDBOXED"):
    info = rewards.prepare_code_rewards(c)
  assert info["mode"] == "none"
  g = rewards.grade("code", OK_PROGRAM, OK_TESTS)
  assert (g.reward, g.reason, g.sandboxed) == (1.0, "pass", False)   # a reward log shows it
  c.rewards.code_sandbox = "off"
  with pytest.raises(ValueError, match="code_sandbox='off'"):
    rewards.prepare_code_rewards(c)


@pytest.mark.parametrize("answer,match", [
    ("{bad", "not JSON"),
    (json.dumps({"tests": []}), "non-empty list"),
    (json.dumps([{"in": "1"}]), "'input' and 'output'"),
    (json.dumps([{"input": "1", "output": "1", "testtype": "functional"}]), "no 'fn_name'"),
])
def test_bad_test_json_is_a_counted_reason(answer, match):
  g = rewards.grade("code", OK_PROGRAM, answer)
  assert (g.reward, g.reason, g.sandboxed) == (0.0, "bad_tests", False)
  assert match in g.detail
  with pytest.raises(ValueError, match=match):
    rewards.compute_reward("code", OK_PROGRAM, answer)


def test_other_rewards_grade_with_reasons():
  assert rewards.grade("synthetic", "1 2 </think> 7 <eos>", "7").reason == "pass"
  assert rewards.grade("synthetic", "1 2 </think> 3 <eos>", "7").reason == "wrong_answer"
  assert rewards.grade("synthetic", "1 2 3", "7").reason == "no_answer"


def test_code_job_refuses_to_start_without_sandbox(tmp_path):
  """job.run on a code dataset stops at start-up (before SFT, buffer or generators) when the
  sandbox cannot start."""
  from configs import tiny
  from scalerl_jax import recipes
  from scalerl_jax.training import job
  from scalerl_jax.data.tiny_hf_tokenizer import write_tiny_tokenizer
  rows = [{"problem": f"print {i}", "tests": [{"input": "", "output": f"{i}\n"}]} for i in range(8)]
  data = tmp_path / "code.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = tiny.get_config()
  c.data.kind, c.data.path, c.data.heldout = "deepcoder", str(data), 2
  c.data.tokenizer_path = write_tiny_tokenizer(str(tmp_path / "tok"))
  c.rewards.code_bwrap = "/bin/false"
  workdir = tmp_path / "run"
  recipes.check_workdir(str(workdir))      # what main's recipes.validate does first
  with pytest.raises(rewards.SandboxUnavailable, match="did not start"):
    job.run(c, str(workdir), progress=False)
  assert not (workdir / "config.json").exists() and not (workdir / "base_policy").exists()


def test_missing_seccomp_stops_the_start_and_names_the_knob(monkeypatch):
  from scalerl_jax.rewards import seccomp

  def unavailable(allow_ipc_memory):
    raise seccomp.SeccompUnavailable("Unable to find libseccomp: install the system library")
  monkeypatch.setattr(seccomp, "filter_bpf", unavailable)
  with pytest.raises(sandbox.SandboxUnavailable, match="code_seccomp=False"):
    sandbox.check_sandbox()
  r = sandbox.run_program("print('ran')")
  assert r.status == "sandbox_error" and "libseccomp" in r.detail and r.stdout == b""
  with pytest.raises(ValueError, match="rewards.code_cgroup='v3'"):
    sandbox.configure(cgroup="v3")


def test_a_sandbox_that_fails_to_start_once_is_tried_again(tmp_path, caplog):
  """A one-off start failure (seen once in CI under load: a code completion graded sandbox_error)
  costs nothing: run_program starts the sandbox again and the program's own result counts; the
  first failure is logged. A sandbox that fails every time still gives sandbox_error, with both
  details, and the program never runs."""
  real = sandbox.bwrap_path()
  flag_dir = tempfile.mkdtemp(prefix="fail_once_")
  os.chmod(flag_dir, 0o777)                       # the fake runs as uid 65534 when we are root
  _CLEANUP.append(flag_dir)
  once = _fake_bwrap(tmp_path, f'if [ -e {flag_dir}/failed ]; then exec {real} "$@"; fi\n'
                               f'touch {flag_dir}/failed\n'
                               "echo 'bwrap: Creating new namespace failed: Resource temporarily "
                               "unavailable' >&2; exit 1")
  saved = sandbox.settings()
  try:
    sandbox.configure(bwrap=once)
    with caplog.at_level("WARNING", logger=sandbox.__name__):
      r = sandbox.run_program("print(6 * 7)")
    assert (r.status, r.stdout, r.sandboxed) == ("ok", b"42\n", True)
    assert os.path.exists(f"{flag_dir}/failed")   # the first start really failed
    assert any("trying again" in m and "Resource temporarily" in m for m in caplog.messages)
    marker = tmp_path / "ran"
    sandbox.configure(bwrap=_fake_bwrap(tmp_path, "echo 'bwrap: Creating new namespace failed' >&2; exit 1"))
    r = sandbox.run_program(f"open({str(marker)!r}, 'w').write('x')")
    assert r.status == "sandbox_error" and f"failed {sandbox.SANDBOX_ATTEMPTS} times" in r.detail
    assert r.detail.count("Creating new namespace failed") == 2 and not marker.exists()
  finally:
    sandbox.configure(**dataclasses.asdict(saved))
