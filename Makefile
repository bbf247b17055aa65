# Every target creates (or reuses) the local virtualenv in .venv and installs under
# constraints.txt, so a fresh machine with only Python needs nothing else.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL ?=

.PHONY: test run bench lint clean

# ExecuTorch (the `executorch` extra) is installed with --no-deps: its own requirements
# would pull ~20 packages it never imports here and must not move torch/torchao; the extra
# holds what it does import (see setup.cfg). The `coreml` extra (coremltools) lets the
# suite lower with ExecuTorch's Core ML partitioner on Linux.
$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip -c constraints.txt
	$(PIP) install --quiet -c constraints.txt torch==2.13.0
	$(PIP) install --quiet -c constraints.txt -e '.[test,executorch,coreml]'
	$(PIP) install --quiet -c constraints.txt --no-deps executorch
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -n auto --maxprocesses 4

run: $(STAMP)
	$(PY) -m passes run $(MODEL)

bench: $(STAMP)
	$(PIP) install --quiet -c constraints.txt -e '.[test,bench]'
	$(PY) -m benchmarks

lint: $(STAMP)
	$(PIP) install --quiet -c constraints.txt ruff
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
