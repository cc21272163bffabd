# One obvious place for each command. `make test` is what CI runs (.ci/run).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv vllm-venv test test-long test-fast demo compare clean

# Idempotent: rebuilds only when requirements.txt is newer than the stamp.
$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

# vLLM (the generator fleet's engine) lives in its own venv, as a fleet image would.
vllm-venv:
	bash scripts/setup_vllm_venv.sh

test: venv vllm-venv
	SCALERL_REQUIRE_VLLM=1 $(VPY) -m pytest -q -n 4 --dist loadgroup --no-loadscope-reorder --timeout=900 --durations=25 -m "not long" tests

# Tests too long for CI's budget (marker `long`): the gs:// rehearsal.
test-long: venv
	$(VPY) -m pytest -q -m long --timeout=2400 tests

test-fast: venv
	$(VPY) -m pytest -q -x -m "not slow" tests

DEMO_DIR ?= runs/demo

# The tiny ScaleRL run end to end on CPU (SFT warm start, RL with PipelineRL-8 and the freshness
# bound rollout.max_ahead=1: configs/tiny.py:demo, docs/ROLLOUT.md "Demo stability"; Eq. 1 fit).
demo: venv
	$(VPY) -m scalerl_jax.main --config=configs/tiny.py:demo --workdir=$(DEMO_DIR)
	@echo ""
	@echo "Demo done. Curve + fit: $(DEMO_DIR)/fit/curves.png and $(DEMO_DIR)/fit/fit.json"
	@echo "Staleness (lag histogram, kl_k3 per step): $(DEMO_DIR)/fit/lag.png and lag.json"
	@echo "Metrics: $(DEMO_DIR)/metrics.jsonl; TensorBoard: tensorboard --logdir $(DEMO_DIR)/tb"

# ScaleRL vs another recipe on the same compute axis (table: runs/compare/compare/compare.md).
compare: venv
	$(VPY) -m scalerl_jax.compare --config=configs/tiny.py --recipes=scalerl,qwen_dapo --workdir=runs/compare

clean:
	rm -rf $(VENV) .pytest_cache
