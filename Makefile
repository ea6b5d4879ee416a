# Every install step lives here: `make test` on a fresh machine creates .venv and installs .[test].
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-test

.PHONY: test venv bench-load clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch==2.13.0 (CPU build) is pinned in the test extra; reinstall when pyproject changes.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

bench-load: $(STAMP)
	$(BIN)/python benchmarks/load.py

clean:
	rm -rf $(VENV) build *.egg-info
