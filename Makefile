# The README's two commands, `make book` and `make test`, plus `make test-fast`, `make lint` and `make lab`;
# `make` alone (`make help`) lists them and installs nothing.  Each installs what it needs first
# (scripts/setup.sh) into the Python it runs with, once: the installer runs again only when
# pyproject.toml, setup.py, requirements.txt or scripts/setup.sh changed, or the environment did.
# `make setup` always runs it.
PYTHON ?= python3
export PYTHON
# jupyter-book 1.x has no `python -m jupyter_book`: call its entry point with this Python
JUPYTER_BOOK = $(PYTHON) -c "from jupyter_book.cli.main import main; main()"

# the stamp records which environment it was made for: another venv installs again
ENV_PREFIX := $(shell $(PYTHON) -c "import sys; print(sys.prefix)" 2>/dev/null)
STAMP := _build/.setup-stamp
ifneq ($(shell cat $(STAMP) 2>/dev/null),$(ENV_PREFIX))
.PHONY: $(STAMP)
endif

# JupyterLab refuses to start as root unless told
LAB_FLAGS := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: help setup book test test-fast lint lab clean
.DEFAULT_GOAL := help

# every target with a `## what it does` comment, in the Makefile's order
help:  ## list these targets (installs nothing)
	@echo "FlashAttention Lab: make TARGET (the first target that needs it installs fa_lab and its tools, once)"
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z-]+:.*## / {printf "  make %-10s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(STAMP): pyproject.toml setup.py requirements.txt scripts/setup.sh
	bash scripts/setup.sh
	@mkdir -p $(@D) && echo "$(ENV_PREFIX)" > $@

setup:  ## run the installer again (scripts/setup.sh), whatever the stamp says
	bash scripts/setup.sh
	@mkdir -p $(dir $(STAMP)) && echo "$(ENV_PREFIX)" > $(STAMP)

book: $(STAMP)  ## build the book, every notebook executed, into _build/html
	$(JUPYTER_BOOK) build . --keep-going

test: $(STAMP)  ## everything: fa_lab, the grader, every notebook under nbval, the book in headless Chromium
	$(PYTHON) -m pytest tests book exercises --nbval-lax --nbval-current-env -q

test-fast: $(STAMP)  ## the package's tests without the slow ones, the notebooks or the browser
	$(PYTHON) -m pytest tests -m "not slow" -q -p no:randomly --ignore=tests/test_book_browser.py

lint: $(STAMP)  ## ruff on fa_lab, tests and scripts
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q -e ".[lint]"
	$(PYTHON) -m ruff check fa_lab tests scripts

lab: $(STAMP)  ## JupyterLab on the book and the exercises (as root too)
	$(PYTHON) -m jupyterlab $(LAB_FLAGS)

clean:  ## remove _build (the built book, its notebook cache and the setup stamp)
	rm -rf _build
