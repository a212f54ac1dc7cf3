SHELL := /bin/bash

PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Written after a successful install; re-install only when pyproject.toml changes.
STAMP := $(VENV)/.installed
# Two pytest workers (pytest-xdist), each with its share of cores - 1 torch threads (conftest.py).
PYTEST_ARGS ?= -n 2
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: venv .venv test test-fast lint serve clean distclean

venv .venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# torch first and pinned, so the local CPU wheel is used instead of a CUDA build.
$(STAMP): pyproject.toml | $(VPY)
	@echo "installing torch 2.13 (CPU wheel), then dsv4[dev,server,train,rl]: a few minutes"
	$(PIP) install --progress-bar on torch==2.13.0
	$(PIP) install --progress-bar on -e '.[dev,server,train,rl]'
	touch $@

# Everything (what CI runs): ruff, then the whole suite (`slow` tests included) with mypy beside
# it: mypy is one single-threaded process of ~40 s, which run alone before the suite would leave a
# core idle. Fails if either fails; mypy's report follows the suite's.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	@$(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(VPY) -m pytest -q $(PYTEST_ARGS); tests=$$?; \
	wait $$mypy; types=$$?; echo "mypy (exit $$types):"; cat $(VENV)/mypy.log; \
	exit $$(( tests != 0 || types != 0 ))

# The inner loop: the suite without the `slow` tests (each over ~10 s on a 2-core CPU).
test-fast: $(STAMP)
	$(VPY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

# The embedded default model (dsv4-tiny, shipped in src/dsv4/assets/tiny); the server logs a curl example
# once it is ready.
serve: $(STAMP)
	$(VENV)/bin/dsv4 serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# ruff on all the Python, mypy on src/ (strict on the seams: pyproject.toml [tool.mypy]).
lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf build dist src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
	find src tests benchmarks -type d -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true

distclean: clean
	rm -rf $(VENV)
