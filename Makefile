# Each target does its own set-up: a virtual environment in .venv with the CPU build of
# torch pinned for this machine and CI (override TORCH_SPEC on GPU machines, e.g.
# TORCH_SPEC='torch>=2.4'), then ddpkit installed in editable mode.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=
ARGS ?=
BIN = $(VENV)/bin
STAMP = $(VENV)/.ddpkit-installed

.PHONY: train test test-cluster lint setup clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q --disable-pip-version-check -e ".[test,progress,plot,tensorboard,datasets,hf]" "$(TORCH_SPEC)"
	touch $(STAMP)

setup: $(STAMP)

train: $(STAMP)
	$(BIN)/ddpkit train $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts

test: lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-cluster: $(STAMP)
	$(BIN)/python -m pytest -q -m cluster $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache
