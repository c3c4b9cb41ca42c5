# Two set-up-free entry points: `make example` and `make test`. Each creates .venv and installs
# what it needs. torch 2.13.0 is installed first, on its own, so no CUDA build gets pulled in.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test lint docs docs-serve test-matrix example venv clean

$(STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev,docs]"
	touch $(STAMP)

venv: $(STAMP)

# ruff (lint, format), import-linter (the layer rules of docs/architecture.md), mypy (the core).
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

# One cell of the version matrix in a scratch venv (.venv-matrix/): TORCH=2.15.0 [PINS="lightning==2.6.6"]
# [PYTEST_ARGS=...]. docs/compatibility.md ("Tested versions") lists the cells run and their pass counts.
test-matrix:
	TORCH="$(TORCH)" PINS="$(PINS)" PYTEST_ARGS="$(PYTEST_ARGS)" PYTEST_WORKERS="$(PYTEST_WORKERS)" PY="$(PY)" bash .ci/matrix

# Fine-tunes the embedded all-MiniLM-L6-v2 with Trainer(strategy="fsdp2") on 2 CPU processes
# (Lightning launches them), resumes, exports HF safetensors and reloads them (~2 minutes).
example: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python examples/lightning_finetune.py

clean:
	rm -rf $(VENV) .venv-matrix build site *.egg-info
