# Two entry points on a fresh machine (see README):  make demo   |   make test
# Both create .venv/ on first use, install into it, and are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONSTRAINTS := requirements/constraints-cpu.txt
STAMP  := $(VENV)/.installed
LINT_STAMP := $(VENV)/.installed-lint

.PHONY: demo test test-all lint bench install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

$(LINT_STAMP): $(STAMP)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[lint]'
	touch $(LINT_STAMP)

demo: $(STAMP)
	$(VENV)/bin/shiftguard run

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile -q

test-all: $(STAMP)
	$(PY) -m pytest -q

# Lint (configured in pyproject.toml): ruff's rules and its formatting (`ruff format` rewrites a file
# that fails the check), mypy on the typed packages, and the import contract of the layers.
lint: $(LINT_STAMP)
	$(VENV)/bin/ruff check src tests benchmarks studies examples scripts
	$(VENV)/bin/ruff format --check src tests benchmarks studies examples scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

bench: $(STAMP)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
