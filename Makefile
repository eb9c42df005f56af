# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test lint docs types install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_digits.py
	$(PY) examples/quickstart.py
	$(PY) benchmarks/cpu.py

lint: $(STAMP)
	$(PY) -m ruff check jaxpool tests examples benchmarks

# `make test` = lint + the docstring examples + pytest + the docs site (warnings are errors) + mypy.
test: $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules jaxpool
	$(PY) -m pytest -q -n 2 tests
	$(MAKE) docs types

docs: $(STAMP)
	$(PY) docs/make_figures.py
	$(VENV)/bin/mkdocs build --strict --quiet

types: $(STAMP)
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache site
