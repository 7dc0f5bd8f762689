# The two set-up commands: `make quickstart` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test test-all install clean

install: $(STAMP)

# pip's own progress is shown (no -q): a fresh install is minutes of downloads and unpacking,
# and a silent terminal for that long reads as a hang.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || { echo "mmalign: creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "mmalign: installing mmalign and its dependencies (torch, DeepSpeed, open_clip, transformers, ...) into $(VENV):"
	@echo "mmalign:   about 6.6 GB on disk; 1-4 min on 2 cores with the wheels cached locally, longer when downloading them. pip's progress follows."
	@start=$$(date +%s) \
	  && $(BIN)/python -m pip install --progress-bar on --upgrade pip \
	  && $(BIN)/python -m pip install --progress-bar on -e '.[test]' \
	  && echo "mmalign: installed in $$(( $$(date +%s) - start )) s; $(VENV) takes $$(du -sh $(VENV) | cut -f1)"
	@touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/mmalign quickstart

# two pytest processes over two halves of the files (tests/run_halves.py: much of the suite
# waits on timeouts and other processes); MMALIGN_TEST_SERIAL=1 runs one
test: $(STAMP)
	$(BIN)/python tests/run_halves.py -m "not gpu and not slow" -q --durations=15

# also the `slow` tests: costly ones whose property a cheaper test already checks
test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -q

clean:
	rm -rf runs .pytest_cache
