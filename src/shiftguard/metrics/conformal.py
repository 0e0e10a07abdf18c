"""Metrics of prediction sets ``(N, C)`` bool (``shiftguard.conformal``): do they contain the true
label as often as promised, and how large are they?

- :func:`coverage`: the fraction of images whose set holds the true label (the guarantee of split
  conformal prediction is ``coverage >= 1 - alpha`` on exchangeable data).
- :func:`set_sizes`: mean and median set size, and the fraction of empty sets.
- :func:`size_stratified_coverage`: coverage within strata of set size, and the size-stratified
  coverage violation SSCV = max over non-empty strata of ``|coverage - (1 - alpha)|``
  (Angelopoulos, Bates, Malik & Jordan, ICLR 2021, Sec. 4, "size-stratified coverage").
- :func:`class_coverage_gap`: CovGap, the mean over classes of ``|coverage_c - (1 - alpha)|``
  (Ding, Angelopoulos, Bates, Jordan & Tibshirani, NeurIPS 2023, Sec. 2), with the worst class.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from shiftguard._validation import check_labels, check_same_length, check_tensor

__all__ = ["coverage", "set_sizes", "size_stratified_coverage", "class_coverage_gap", "DEFAULT_SIZE_STRATA"]

#: The set-size strata of Angelopoulos et al. (2021, Table 4): 0-1, 2-3, 4-10, 11-100, 101-1000.
DEFAULT_SIZE_STRATA: tuple[tuple[int, int], ...] = ((0, 1), (2, 3), (4, 10), (11, 100), (101, 1000))


def _check_sets(sets, labels=None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    s = check_tensor(sets, "sets", ndim=2)
    if s.dtype != torch.bool:
        raise TypeError(f"sets: expected a bool tensor (N, C) of prediction sets, got dtype {s.dtype}")
    if labels is None:
        return s, None
    y = check_labels(labels, "labels", num_classes=s.shape[1])
    check_same_length([("sets", s), ("labels", y)])
    return s, y.to(s.device)


def _alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha: expected a miscoverage level in (0, 1), got {alpha!r}")
    return float(alpha)


def coverage(sets, labels) -> float:
    """The fraction of rows whose set contains the label (``nan`` for no rows)."""
    s, y = _check_sets(sets, labels)
    assert y is not None
    if s.shape[0] == 0:
        return math.nan
    return float(s[torch.arange(s.shape[0], device=s.device), y].double().mean())


def set_sizes(sets) -> dict:
    """``{"mean", "median", "empty"}``: the mean and median number of labels per set and the
    fraction of empty sets (``nan`` for no rows)."""
    s, _ = _check_sets(sets)
    if s.shape[0] == 0:
        return {"mean": math.nan, "median": math.nan, "empty": math.nan}
    size = s.sum(1).double()
    return {"mean": float(size.mean()), "median": float(size.median()), "empty": float((size == 0).double().mean())}


def size_stratified_coverage(
    sets, labels, alpha: float, strata: Sequence[tuple[int, int]] = DEFAULT_SIZE_STRATA
) -> dict:
    """Coverage within strata of set size and their worst deviation from ``1 - alpha``.

    Returns ``{"strata": [{"sizes": (lo, hi), "n": count, "coverage": float}], "sscv": float}``;
    strata with no set are listed with ``n`` 0 and coverage ``nan`` and left out of SSCV (``nan``
    when every stratum is empty). Sizes above the last stratum's upper end fall into no stratum."""
    a = _alpha(alpha)
    s, y = _check_sets(sets, labels)
    assert y is not None
    size = s.sum(1)
    hit = s[torch.arange(s.shape[0], device=s.device), y]
    out, worst = [], []
    for lo, hi in strata:
        if isinstance(lo, bool) or isinstance(hi, bool) or not (isinstance(lo, int) and isinstance(hi, int)) or lo > hi:
            raise ValueError(f"strata: expected (low, high) integer pairs with low <= high, got {(lo, hi)!r}")
        inside = (size >= lo) & (size <= hi)
        n = int(inside.sum())
        cov = float(hit[inside].double().mean()) if n else math.nan
        out.append({"sizes": (lo, hi), "n": n, "coverage": cov})
        if n:
            worst.append(abs(cov - (1.0 - a)))
    return {"strata": out, "sscv": max(worst) if worst else math.nan}


def class_coverage_gap(sets, labels, alpha: float) -> dict:
    """``{"gap": mean_c |coverage_c - (1 - alpha)|, "worst": max_c ..., "per_class": [coverage_c]}``
    over the classes present in ``labels`` (CovGap, Ding et al. 2023); absent classes are ``nan``
    in ``per_class`` and left out of both summaries."""
    a = _alpha(alpha)
    s, y = _check_sets(sets, labels)
    assert y is not None
    hit = s[torch.arange(s.shape[0], device=s.device), y].double()
    per = []
    for c in range(s.shape[1]):
        mask = y == c
        per.append(float(hit[mask].mean()) if bool(mask.any()) else math.nan)
    dev = [abs(c - (1.0 - a)) for c in per if not math.isnan(c)]
    return {"gap": sum(dev) / len(dev) if dev else math.nan, "worst": max(dev) if dev else math.nan, "per_class": per}
