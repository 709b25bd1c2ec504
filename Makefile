# Bootstraps .venv (Python 3.12 from pyenv) idempotently, then runs the main job or the tests.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

.PHONY: train test venv torch-env clean-cache

$(STAMP): pyproject.toml scripts/bootstrap_venv.sh scripts/find_python.sh
	bash scripts/bootstrap_venv.sh $(VENV)
	@touch $(STAMP)

venv: $(STAMP)

## make train: trains configs/cpu_tiny.yaml on the CPython standard-library corpus (ARGS="key=value ...").
train: $(STAMP)
	$(VENV)/bin/minicpm4 train --config configs/cpu_tiny.yaml $(ARGS)

## make test: the whole suite CI runs, then the kernels' lowering and the imports on the oldest supported JAX (0.11.2,
## the GPU machines' version) without grain / tensorboardX, and gpu_check.sh's dry run (scripts/test_jax_min.sh, ~2.5 min).
test: $(STAMP)
	bash scripts/run_tests.sh $(PY)
	bash scripts/test_jax_min.sh

## make torch-env: the Python 3.11 CPU PyTorch environment used by parity tests and benchmarks.
torch-env:
	bash scripts/bootstrap_torch_env.sh

clean-cache:
	rm -rf .cache
