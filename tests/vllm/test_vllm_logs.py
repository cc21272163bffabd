"""vLLM's own stdout and stderr are kept where a restart keeps them (issue 46): the vllm backend's
engine (generation/vllm/engine.py) writes them to WORKDIR/logs/vllm-<generator id>.log, and a
restarted engine appends to it (generator pods mount the workdir as a volume that a container
restart keeps). The REAL worker process in .venv-vllm runs, with tests/vllm_stub_engine.py in place
of vLLM's AsyncLLM; the stub prints one line on each stream when it starts."""
import logging
import re

import jax
import numpy as np
import pytest

from scalerl_jax.models import sections as model_sections
from configs import tiny
from scalerl_jax.config import RunConfig
from scalerl_jax import models
from scalerl_jax.generation.vllm.engine import VLLMEngine
from test_vllm_worker import require_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.xdist_group("vllm")]


def test_engine_output_goes_to_the_workdir_and_a_restart_appends(tmp_path, caplog):
  require_vllm()
  c = tiny.get_config()
  model_cfg = model_sections.model_config(c)
  c.generator.vllm_args = dict(
      engine_factory="tests.vllm_stub_engine:StubEngine", startup_timeout=300,
      engine_args=dict(layers=model_cfg.num_layers, k=1, experts=1, vocab=model_cfg.vocab_size))
  run = RunConfig.from_config(c)
  params = jax.tree.map(np.asarray, models.init_params(model_cfg, jax.random.PRNGKey(0)))
  engine = VLLMEngine(run)
  engine.generator_id = "gen-7"
  with caplog.at_level(logging.INFO, logger="scalerl.export_cache"):
    for _ in range(2):                 # the first start, then a restart on the same weights
      gen = engine.make(model_cfg, params, 0, str(tmp_path), None)
      gen.close()
  log = (tmp_path / "logs" / "vllm-gen-7.log").read_text()
  assert gen.log_path == str(tmp_path / "logs" / "vllm-gen-7.log")
  starts = re.findall(r"--- vLLM engine start .* by pid \d+: (\S+) \(version 0\)", log)
  assert starts == [str(tmp_path / "vllm_export-gen-7")] * 2, log[-3000:]
  for stream in ("stdout", "stderr"):                  # both engines' own lines, in order
    assert len(re.findall(rf"stub engine up: pid \d+ \({stream}\)", log)) == 2, log[-3000:]
  first, second = log.index("stub engine up"), log.rindex("--- vLLM engine start")
  assert first < second < log.rindex("stub engine up")
  # The restart reused the export of the same weights (generation/export_cache.py).
  msgs = [r.getMessage() for r in caplog.records]
  assert sum("written" in m for m in msgs) == 1 and sum("reused" in m for m in msgs) == 1, msgs
