# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test test-fast serve lint docs bench clean

install: $(STAMP)

# torch first and pinned (constraints.txt): any later resolver step then keeps the CPU build.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch==2.13.0
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test]"
	@if $(PY) -m pip list 2>/dev/null | grep -qi '^nvidia'; then \
		echo "error: CUDA packages were installed; torch is not pinned" >&2; exit 1; fi
	touch $(STAMP)

# The slowest tests are named at the end: the whole suite must stay under 15 minutes on 2 cores.
test: install
	$(PY) -m pytest -q --durations=15

# The suite without the slow tiers (live servers, benchmark smoke runs, AOT, packaging).
test-fast: install
	$(PY) -m pytest -q -m "not slow"

serve: install
	$(VENV)/bin/octavo serve

lint: install
	$(VENV)/bin/ruff check engine kernels server tests benchmarks tools octavo/__init__.py octavo/__main__.py octavo/bench
	$(VENV)/bin/ruff format --check engine kernels server tests benchmarks tools octavo/bench
	$(VENV)/bin/mypy

# The docs site (docs/ -> site/): the docs extra, the reference pages regenerated from the
# code, then a strict build (a broken link or an orphan page fails).
docs: install
	$(PY) -m pip install --quiet -c constraints.txt -e ".[docs]"
	$(PY) -m tools.gen_docs
	$(VENV)/bin/mkdocs build --strict

# The benchmarks run from the repository root as modules (python -m benchmarks.NAME): the
# checkout's benchmarks/ beside the installed octavo package.
bench: install
	$(PY) -m benchmarks.offline_throughput

clean:
	rm -rf $(VENV) build site *.egg-info
