"""One cell of the evaluation grid: a shifted test set, named by what shifted it."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Cell"]


class Cell(NamedTuple):
    """``(corruption, severity, group)``: the test set under ``corruption`` at ``severity`` (the
    clean set is ``("clean", 0, "benchmark")``). ``group`` is ``"benchmark"`` (the suite's
    corruptions, in its means), ``"extra"`` (CIFAR-10-C's 4 held-out corruptions, reported apart)
    or ``"adversarial"`` (``corruption`` an attack name, ``severity`` the index of its budget).
    A tuple: it unpacks, compares and serialises as the plain ``(str, int, str)`` it replaces."""

    corruption: str
    severity: int
    group: str
