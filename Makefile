# The README's two commands: `make book` and `make test`.
PYTHON ?= python3
export PYTHON
# jupyter-book 1.x has no `python -m jupyter_book`: call its entry point with this Python
JUPYTER_BOOK = $(PYTHON) -c "from jupyter_book.cli.main import main; main()"

.PHONY: setup book test lab clean

setup:
	bash scripts/setup.sh

# Install, then build the book with every notebook executed, into _build/html.
book: setup
	$(JUPYTER_BOOK) build . --keep-going

# Install, then run the tests: fa_lab, the grader, and every notebook under nbval.
test: setup
	$(PYTHON) -m pytest tests book exercises --nbval-lax --nbval-current-env -q

lab: setup
	$(PYTHON) -m jupyterlab

clean:
	rm -rf _build
