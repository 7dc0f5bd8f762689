# The two set-up commands: `make quickstart` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TOOLS := .venv-tools

.PHONY: quickstart test test-fast test-all lint docs install clean

install: $(STAMP)

# pip's own progress is shown (no -q): a fresh install is minutes of downloads and unpacking,
# and a silent terminal for that long reads as a hang.
$(STAMP): pyproject.toml requirements/tools.txt requirements/test-nodeps.txt
	@test -x $(BIN)/python || { echo "mmalign: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "mmalign: installing mmalign and its dependencies (torch, DeepSpeed, open_clip, transformers, ...) into $(VENV):"
	@echo "mmalign:   about 6.6 GB on disk; 1-4 min on 2 cores with the wheels cached locally, longer when downloading them. pip's progress follows."
	@start=$$(date +%s) \
	  && $(BIN)/python -m pip install --progress-bar on --upgrade pip \
	  && $(BIN)/python -m pip install --progress-bar on -e '.[search,export,report,test]' \
	  && $(BIN)/python -m pip install --progress-bar on --no-deps -r requirements/test-nodeps.txt \
	  && echo "mmalign: the field's tools (img2dataset, autofaiss) into their own venv, $(TOOLS):" \
	  && { test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS); } \
	  && $(TOOLS)/bin/python -m pip install --progress-bar on -r requirements/tools.txt \
	  && echo "mmalign: installed in $$(( $$(date +%s) - start )) s; $(VENV) takes $$(du -sh $(VENV) | cut -f1)"
	@touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/mmalign quickstart

# pytest-xdist, one worker per core of a 2-core machine (a third worker measured slower: it adds
# start-up and contention, not throughput); each worker's torch and the processes its tests start
# get their share of the cores, and tests that share a host resource run in one xdist group
# (tests/conftest.py). TEST_WORKERS=0 runs one process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)
test: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not gpu and not slow" -q --durations=15

# the inner loop: no integration test (multi-process, DeepSpeed, end to end)
test-fast: $(STAMP)
	$(BIN)/python -m pytest $(XDIST) -m "not gpu and not slow and not integration" -q

# also the `slow` tests: costly ones whose property a cheaper test already checks
test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -q

# ruff (lint and format) and mypy, configured in pyproject.toml; .ci/run runs this before the tests
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# the manual as a site (mkdocs.yml); --strict fails on a broken link or a page missing from the nav
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir .site

clean:
	rm -rf runs .pytest_cache
