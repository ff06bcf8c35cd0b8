# Quick start targets: each creates its own virtual environment and installs pinned dependencies.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_TEST := $(VENV)/.installed-test
STAMP_DEMO := $(VENV)/.installed-demo

.PHONY: test demo venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP_TEST): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test,fast,viz,pretrained]'
	touch $@

# The demo needs the pictures and the progress bar (viz) and one BLAS thread on its tiny matrices (fast).
$(STAMP_DEMO): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[viz,fast]'
	touch $@

venv: $(STAMP_TEST)

test: $(STAMP_TEST)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/python -m pytest

# make demo DEMO_ARGS="--task reverse --steps 400" passes options on (see .venv/bin/attnkit demo --help).
demo: $(STAMP_DEMO)
	$(BIN)/attnkit demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache .hypothesis
