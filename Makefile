# The two set-up commands: `make quickstart` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test test-all install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/mmalign quickstart

test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu and not slow" -q

# also the `slow` tests: costly ones whose property a cheaper test already checks
test-all: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -q

clean:
	rm -rf runs .pytest_cache
