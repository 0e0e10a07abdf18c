# Two entry points on a fresh machine (see README):  make demo   |   make test
# Both create .venv/ on first use, install into it, and are idempotent.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
CONSTRAINTS := requirements/constraints-cpu.txt
STAMP  := $(VENV)/.installed

.PHONY: demo test test-all bench install clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/shiftguard run

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -n 2 --dist loadfile -q

test-all: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[bench]'
	for b in benchmarks/bench_*.py; do $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
