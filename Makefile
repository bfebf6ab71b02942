# `make demo` and `make test` each set up the virtual environment they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= test,plot,progress,lint,kubernetes,hyperpod,http,metrics,transformers,lightning,accelerate,torchft

.PHONY: demo test test-slow lint bench gpu-check campaign system-deps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned to the release this project is tested with (a local wheel here).
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

system-deps:
	bash scripts/system-deps.sh

demo: $(STAMP)
	$(PY) -m replicheck demo

test: $(STAMP) system-deps
	$(PY) -m pytest

# Style, types (strict on the guard, the contract and the controller) and the import layers.
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The slow set (e.g. the 5,000-input ingestion fuzz), excluded from `make test`.
test-slow: $(STAMP) system-deps
	$(PY) -m pytest -m slow

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

# The GPU check of issue 23 on one CUDA device (one H200): at most 5 minutes, the script's default
# --budget-s 300, most valuable parts first (parts that no longer fit are reported as skipped).
# Writes docs/results/gpu.md and gpu.json; exit status 1 if a part failed or was skipped.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py --out docs/results

campaign: $(STAMP)
	$(PY) -m replicheck campaign --out docs/results

clean:
	rm -rf $(VENV) build *.egg-info
