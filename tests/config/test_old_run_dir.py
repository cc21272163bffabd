"""Old runs still work under the config layer (issue #47): a run directory written before it
(tests/data/run_38d6b1d: a 2-step tiny run of main at commit 38d6b1d, 2026-12-07, its config.json,
learner-state file, checkpoint 2 and buffer WAL, ~300 KB; made with
`python -m scalerl_jax.main --config=configs/tiny.py --workdir=W --config.total_steps=2
--config.model.d_model=32 --config.model.num_layers=1 ...`, the command in its config.json's _meta)
resolves, resumes and replays: its run file resolves to what its command resolves to now, the
learner finds and verifies its checkpoint, the prompt export and the buffer process (the new
command line: the run file + process-local flags) read it and the buffer replays its WAL."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

from scalerl_jax import config

ROOT = pathlib.Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "data" / "run_38d6b1d"


def test_old_run_file_resolves_to_what_its_command_resolves_to():
  saved = json.loads((FIXTURE / "config.json").read_text())
  argv = saved["_meta"]["argv"]
  preset = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
  again = config.resolve(str(ROOT / preset), config.split_overrides(argv[1:])[1])
  assert config.resolve(str(FIXTURE / "config.json")) == again
  assert again.model.arch["d_model"] == 32 and again.total_steps == 2


def test_old_run_dir_resumes_and_its_buffer_replays(tmp_path):
  from scalerl_jax.training import job
  wd = tmp_path / "run"
  shutil.copytree(FIXTURE, wd)
  run = config.resolve(str(wd / "config.json"))
  info = job.prepare_resume(run, str(wd))              # the learner's resume: checkpoint 2, verified
  assert info is not None and info["checkpoint_step"] == 2 and info["skipped_checkpoints"] == []
  state = json.loads((wd / "learner_state.json").read_text())
  assert state["checkpoint_step"] == 2 and state["resume"]["step"] == 2

  env = {**os.environ, "PYTHONPATH": str(ROOT), "SCALERL_BUFFER_TOKEN": "old-run"}
  prompts = wd / "train_prompts.jsonl"
  subprocess.run([sys.executable, "-m", "scalerl_jax.data.export",
                  f"--config={wd / 'config.json'}", f"--out={prompts}"],
                 cwd=ROOT, env=env, check=True, capture_output=True, timeout=120)
  p = subprocess.Popen([sys.executable, "-m", "scalerl_jax.buffer.server",
                        f"--run-config={wd / 'config.json'}", "--port=0", f"--prompts={prompts}",
                        f"--wal-dir={wd / 'buffer_wal'}", f"--learner-state={wd / 'learner_state.json'}",
                        "--no-tune-malloc"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True)
  try:
    line = p.stdout.readline()
  finally:
    p.terminate()
    _, err = p.communicate(timeout=30)
  assert line, err[-2000:]
  wal = json.loads(line)["wal"]
  assert wal["weights_version"] == 2 and wal["restored"], wal       # the old WAL, replayed
  assert wal["resume"]["step"] == 2, wal                            # rewound to checkpoint 2
  assert "run config (buffer): rollout.max_lag=0" in err
