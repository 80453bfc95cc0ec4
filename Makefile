# The README's two commands, `make book` and `make test`, plus `make test-fast`, `make lint` and `make lab`.
# Each installs what it needs first (scripts/setup.sh) into the Python it runs with, once: the installer
# runs again only when pyproject.toml, requirements.txt or scripts/setup.sh changed, or the environment
# did.  `make setup` always runs it.
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

.PHONY: setup book test test-fast lint lab clean

$(STAMP): pyproject.toml requirements.txt scripts/setup.sh
	bash scripts/setup.sh
	@mkdir -p $(@D) && echo "$(ENV_PREFIX)" > $@

setup:
	bash scripts/setup.sh
	@mkdir -p $(dir $(STAMP)) && echo "$(ENV_PREFIX)" > $(STAMP)

# Build the book with every notebook executed, into _build/html.
book: $(STAMP)
	$(JUPYTER_BOOK) build . --keep-going

# Everything: fa_lab, the grader, every notebook under nbval, and the rendered book in headless Chromium.
test: $(STAMP)
	$(PYTHON) -m pytest tests book exercises --nbval-lax --nbval-current-env -q

# The package's tests without the slow ones, the notebooks or the browser.
test-fast: $(STAMP)
	$(PYTHON) -m pytest tests -m "not slow" -q -p no:randomly --ignore=tests/test_book_browser.py

lint: $(STAMP)
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install -q -e ".[lint]"
	$(PYTHON) -m ruff check fa_lab tests scripts

lab: $(STAMP)
	$(PYTHON) -m jupyterlab $(LAB_FLAGS)

clean:
	rm -rf _build
