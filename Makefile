# One entry for users and CI. `make test` and `make demo` build .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION := 2.13.0
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

.PHONY: install test test-e2e demo bench gpu-check clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	# Pin torch first: an unpinned requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==$(TORCH_VERSION)
	$(PY) -m pip install -q -e ".[dev]"
	# LocalSandbox needs bubblewrap; install it where apt is available (sandbox tests skip with the reason otherwise).
	command -v bwrap >/dev/null || { command -v apt-get >/dev/null && $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq bubblewrap; } || echo "WARNING: bubblewrap not installed: sandbox tests will be skipped"
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q -m "not e2e" tests

test-e2e: install
	$(PY) -m pytest -q -m e2e tests

demo: install
	$(PY) tools/demo.py

bench: install
	$(PY) benchmarks/model_forward_backward.py

# Needs no .venv or network (GPU machines run it with their own python): see README "GPU check".
GPU_CHECK_OUT ?= gpu_check
gpu-check:
	bash benchmarks/gpu_check.sh $(GPU_CHECK_OUT)

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
