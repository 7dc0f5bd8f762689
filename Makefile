# The two set-up commands: `make quickstart` and `make test`. Both create .venv on first use.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: quickstart test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

quickstart: $(STAMP)
	$(BIN)/mmalign quickstart

test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -q

clean:
	rm -rf runs .pytest_cache
