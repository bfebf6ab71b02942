# `make demo` and `make test` each set up the virtual environment they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
EXTRAS ?= test,plot,progress,http,metrics

.PHONY: demo test bench campaign system-deps clean

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

bench: $(STAMP)
	$(PY) benchmarks/overhead.py

campaign: $(STAMP)
	$(PY) -m replicheck campaign --out docs/results

clean:
	rm -rf $(VENV) build *.egg-info
