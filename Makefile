# Each target does its own set-up: a virtual environment in .venv with the CPU build of
# torch pinned for this machine and CI (override TORCH_SPEC on GPU machines, e.g.
# TORCH_SPEC='torch>=2.4'), then ddpkit installed in editable mode. Two steps, so the first
# command stays quick: `make train` installs only what the default job needs (torch, ddpkit
# and its progress bar); `make test` (and lint, docs, setup) adds the extras the test suite needs.
# --no-compile: Python compiles the modules a run imports when it first imports them, not
# every file of torch and the extras at install time (most of the set-up's CPU time). That
# needs Python allowed to write its bytecode caches: with PYTHONDONTWRITEBYTECODE set (some
# machines and CI images set it) every process would compile torch's modules again (importing
# torch: 4.1 s of CPU instead of 1.6 s here, in each of the hundreds of processes a test run
# starts), so the targets below run without it.
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# the S3 chain pinned for the tests: s3fs's aiobotocore accepts a narrow botocore, moto takes any
# boto3, and pip left free walks back through hundreds of boto3 releases (a fresh install did not
# resolve in 8 minutes; pinned, 30 s). The package's own s3 extra stays a range.
TEST_PINS ?= boto3==1.43.117 botocore==1.43.117 aiobotocore==3.10.0 s3fs==2026.9.0 fsspec==2026.9.0
PYTEST_ARGS ?=
ARGS ?=
BIN = $(VENV)/bin
PIP = $(BIN)/python -m pip install -q --disable-pip-version-check --no-compile
CORE_STAMP = $(VENV)/.ddpkit-core
TEST_STAMP = $(VENV)/.ddpkit-test
# the extras of each step (pyproject.toml): a new extra the tests need is one more name here
CORE_EXTRAS = progress
TEST_EXTRAS = test,progress,plot,tensorboard,datasets,hf,docs,k8s,pytorchjob,ray,s3
# SkyPilot (the `sky` extra) in a venv of its own: its click<8.2 pin conflicts with the test
# extras' wandb (>=0.27 needs click>=8.2). The tests run its task loader there on what
# `ddpkit sky` writes (tests/unit/engines/test_skypilot.py); ~30 s to make
SKY_VENV ?= .venv-sky
SKY_SPEC ?= skypilot==0.14.1
SKY_STAMP = $(SKY_VENV)/.ddpkit-sky

.PHONY: train test test-cluster lint docs setup clean

unexport PYTHONDONTWRITEBYTECODE

$(CORE_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) -e ".[$(CORE_EXTRAS)]" "$(TORCH_SPEC)"
	touch $(CORE_STAMP)

$(TEST_STAMP): $(CORE_STAMP)
	$(PIP) -e ".[$(TEST_EXTRAS)]" "$(TORCH_SPEC)" $(TEST_PINS)
	touch $(TEST_STAMP)

$(SKY_STAMP): Makefile
	test -x $(SKY_VENV)/bin/python || $(PY) -m venv $(SKY_VENV)
	$(SKY_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-compile "$(SKY_SPEC)"
	touch $(SKY_STAMP)

setup: $(TEST_STAMP) $(SKY_STAMP)

train: $(CORE_STAMP)
	$(BIN)/ddpkit train $(ARGS)

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests benchmarks examples scripts

# the documentation site (mkdocs.yml) into site/, strict: a broken link or anchor, or a page
# missing from the nav, fails; offline (nothing fetched)
docs: $(TEST_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

test: lint docs $(SKY_STAMP)
	PYTHON=$(BIN)/python scripts/test.sh $(PYTEST_ARGS)

test-cluster: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m cluster $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) $(SKY_VENV) runs site .pytest_cache
