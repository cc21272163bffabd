# One obvious place for each command. `make test` is what CI runs (.ci/run).
PY ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test test-fast demo clean

# Idempotent: rebuilds only when requirements.txt is newer than the stamp.
$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -r requirements.txt
	$(VPY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(VPY) -m pip install -q --no-deps -e .
	touch $(STAMP)

venv: $(STAMP)

test: venv
	$(VPY) -m pytest -q -n 2 --timeout=900 tests

test-fast: venv
	$(VPY) -m pytest -q -x -m "not slow" tests

demo: venv
	@echo "make demo: the end-to-end run (issue 6) is not built yet; see README."; exit 1

clean:
	rm -rf $(VENV) .pytest_cache
