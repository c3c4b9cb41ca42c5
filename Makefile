# Two set-up-free entry points: `make example` and `make test`. Each creates .venv and installs
# what it needs. torch 2.13.0 is installed first, on its own, so no CUDA build gets pulled in.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: test example venv clean

$(STAMP):
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests $(PYTEST_ARGS)

example: $(STAMP)
	$(BIN)/torchrun --standalone --nproc_per_node=2 examples/train_plain.py

clean:
	rm -rf $(VENV) build *.egg-info
