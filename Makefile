# Two commands do everything on a fresh machine:
#   make serve   -> creates .venv, installs batchpilot, serves the embedded MiniLM on 127.0.0.1:8000
#   make test    -> creates .venv, installs batchpilot + dev tools, runs lint, types and the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=
# The suite runs on two pytest workers (pytest-xdist): its tests never assert speed, and two workers
# sharing the cores is the loaded machine the suite must pass on anyway.
WORKERS ?= 2
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: serve test lint bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	@# Keep a torch that is already there (a GPU user's build); otherwise take the CPU build 2.13.0.
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(VENV)/torch-pin.txt
	$(BIN)/python -m pip install -q -c $(VENV)/torch-pin.txt -e '.[all,dev]'
	touch $@

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/batchpilot serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/mypy

test: $(STAMP) lint
	$(BIN)/python -m pytest -q -ra -n $(WORKERS) $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
