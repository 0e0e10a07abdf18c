"""The ``Examples`` in the library's docstrings run, and say what they show.

Every module under ``src/shiftguard`` whose source holds a ``>>>`` example is imported and its examples
are run with :mod:`doctest` (``ELLIPSIS`` and ``NORMALIZE_WHITESPACE``; an example that cannot run
here, e.g. one that needs a file, is marked ``# doctest: +SKIP`` where it is written). The public entry
points listed below must each carry at least one example that runs.
"""

from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module with an example in its source, by dotted name.
MODULES_WITH_EXAMPLES = sorted(
    _module_name(path) for path in (SRC / "shiftguard").rglob("*.py") if ">>>" in path.read_text(encoding="utf-8")
)

#: Public entry points whose docstring must hold at least one example that runs (not all skipped).
ENTRY_POINTS = [
    "shiftguard.evaluate",
    "shiftguard.corruptions.corrupt",
    "shiftguard.data.as_tensors",
    "shiftguard.nn.convert_activations",
    "shiftguard.metrics.ece",
    "shiftguard.registry.Registry",
    "shiftguard.neighbors.knn_search",
]


def _resolve(dotted: str):
    module, _, attr = dotted.rpartition(".")
    return getattr(importlib.import_module(module), attr)


def _run(tests: list[doctest.DocTest]) -> tuple[doctest.TestResults, str]:
    """Run ``tests``; return the results and the report of the failures."""
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in tests:
        runner.run(test, out=report.append)
    return runner.summarize(verbose=False), "".join(report)


def test_the_library_has_examples():
    assert len(MODULES_WITH_EXAMPLES) >= len(ENTRY_POINTS)


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_examples_of_the_module_run(name):
    module = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(module, name) if t.examples]
    assert tests, f"{name}: its source holds '>>>' but doctest finds no example in it"
    results, report = _run(tests)
    assert results.failed == 0, report


@pytest.mark.parametrize("dotted", ENTRY_POINTS)
def test_public_entry_point_has_a_running_example(dotted):
    obj = _resolve(dotted)
    globs = dict(vars(importlib.import_module(obj.__module__)))
    tests = doctest.DocTestFinder(recurse=False).find(obj, dotted, globs=globs)
    runnable = [ex for t in tests for ex in t.examples if not ex.options.get(doctest.SKIP, False)]
    assert runnable, f"{dotted}: its docstring has no example that runs"
    results, report = _run(tests)
    assert results.failed == 0, report
