# Quick start targets: each creates its own virtual environment and installs pinned dependencies.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_TEST := $(VENV)/.installed-test

.PHONY: test venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP_TEST): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test,fast]'
	touch $@

venv: $(STAMP_TEST)

test: $(STAMP_TEST)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
