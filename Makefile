# Two commands do all the set-up on a fresh machine: `make demo` and `make test`. `make demo`
# writes its benchmark to the git-ignored build/demo/, never over benchmarks/results/.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all lint docs types package-check install clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/train_digits.py
	$(PY) examples/quickstart.py
	$(PY) benchmarks/pooling_cpu.py --out build/demo/pooling_cpu.json

lint: $(STAMP)
	$(PY) -m ruff check jaxpool tests examples benchmarks

# `make test` = lint + the docstring examples + pytest + the docs site (warnings are errors) + mypy
# + the packaging check. Its pytest leaves out the tests marked slow (more configurations of
# checks that `make test` runs on fewer); `make test-all` runs them too, as does the GPU session
# (benchmarks/gpu_session.sh). --dist loadfile: one worker runs a test file, so that a module's
# fixture (test_sharding.py's 8-device subprocess) runs once; --no-loadscope-reorder: the workers
# take the files in the collection order, which starts the longest ones (tests/conftest.py).
# --file-progress (tests/conftest.py): a line when a file starts and when it is done, with the
# time since the start, since the first files' tests end only after minutes. About 12 minutes
# on 2 cores (pytest about 11).
test: PYTEST_MARKS = not gpu and not slow
test-all: PYTEST_MARKS = not gpu
# XLA_FLAGS: the tests compile many small programs and run each briefly, so XLA's CPU backend
# compiles them without LLVM's optimisations (about 20% less test time on 2 cores). That also
# keeps LLVM from fusing a multiply with the add after it in some loops only, which can move the
# last bit of an average-pool gradient between programs of different shapes, which the tests
# compare bit for bit (README, docs/sharding.md).
test test-all: $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider --doctest-modules jaxpool
	XLA_FLAGS="$$XLA_FLAGS --xla_backend_optimization_level=0" \
	  $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --file-progress \
	    -m "$(PYTEST_MARKS)" tests
	$(MAKE) docs types package-check

# check_links.py: every relative link and anchor of the built site resolves (the changelog page,
# which docs/hooks.py fills from CHANGELOG.md, and the API reference included).
docs: $(STAMP)
	$(PY) docs/make_figures.py
	$(VENV)/bin/mkdocs build --strict --quiet
	$(PY) docs/check_links.py site

types: $(STAMP)
	$(VENV)/bin/mypy

# Builds the sdist and the wheel, installs the wheel without extras into a new venv (in a temporary
# directory) and runs a max pool and its gradient there, then collects the sdist's tests and runs
# tests/ops/test_errors.py from it (tests/project/packaging_check.py).
package-check: $(STAMP)
	$(PY) tests/project/packaging_check.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache site
