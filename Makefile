# Set-up, demo, tests and benchmarks. Every target installs what it needs into .venv first: the tested set pinned in
# requirements/constraints.txt (pyproject.toml keeps the ranges users may install).
PYTHON ?= python3
TORCH_SPEC ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS := requirements/constraints.txt
LATEST_VENV := .venv-latest
LATEST := requirements/latest.txt
PYTEST := HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -n 2 --durations=20
FAST := -m "not slow and not matrix"
LINT := $(BIN)/ruff check peft_shardmerge tests examples bench && $(BIN)/ruff format --check peft_shardmerge tests examples bench

.PHONY: setup demo test test-all test-latest lock bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU build first, so that nothing below pulls a CUDA build of torch
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python examples/demo.py

# ruff check and ruff format --check first (a lint or format error fails the target), then the fast suite: no
# subprocess, kill, torchrun/DeepSpeed or docs-run tests, a seeded sample of the conformance matrix
test: $(STAMP)
	$(LINT)
	$(PYTEST) $(FAST)

# everything (what CI runs): ruff check and format, the slow tests and the whole conformance matrix too
test-all: $(STAMP)
	$(LINT)
	$(PYTEST)

# not in CI: the newest versions pyproject.toml allows, unpinned, in their own venv; the fast suite runs there and
# requirements/latest.txt records the set (make lock then adopts it)
test-latest:
	test -x $(LATEST_VENV)/bin/python || $(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	# no constraints: the newest allowed versions of everything (eager), torch held to TORCH_SPEC's build
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager "$(TORCH_SPEC)" -e '.[test]'
	$(LATEST_VENV)/bin/python -m pip freeze --exclude-editable > $(LATEST)
	HF_HUB_OFFLINE=1 $(LATEST_VENV)/bin/python -m pytest -q -n 2 --durations=20 $(FAST)

# how the pins move, on purpose: after a green make test-latest, its set becomes the tested set (review the diff)
lock:
	test -s $(LATEST) || { echo "run make test-latest first" >&2; exit 1; }
	{ grep '^#' $(CONSTRAINTS); sed -E 's/^([A-Za-z0-9_.-]+==[^+ ]+)\+[^ ]*$$/\1/' $(LATEST); } > $(CONSTRAINTS).new
	mv $(CONSTRAINTS).new $(CONSTRAINTS)

bench: $(STAMP)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[test,bench]'
	# GGUF first (bench_merge removes the models it built when it ends): one pass against merge, convert, quantize
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_gguf.py --sizes 0.5B,1B --types q8_0,q4_k_m --write docs/benchmarks.md
	# the push while merging against merge then upload_folder, on the tests' local Hub (1B, shards of 500 MB)
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_push.py --sizes 1B --max-shard-size 500MB --write docs/benchmarks.md
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_quantize.py --repeats 3 --pairs 3 --write docs/benchmarks.md
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_merge.py --sizes 0.5B,1B --write docs/benchmarks.md
	HF_HUB_OFFLINE=1 $(BIN)/python bench/bench_dist.py --write docs/benchmarks.md

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(LATEST) bench/_work .pytest_cache
