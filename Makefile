# Set-up, demo, tests and benchmarks. Every target installs what it needs into .venv first.
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-all bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build first, so that nothing below pulls a CUDA build of torch
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python examples/demo.py

# the suite with a seeded sample of the conformance matrix (tests/conformance); test-all runs the whole matrix
test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not matrix"

test-all: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_merge.py --sizes 0.5B,1B --write docs/benchmarks.md
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_dist.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) bench/_work .pytest_cache
