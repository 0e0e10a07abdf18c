"""Documented conventions, each pinned by one exact test at its edge.

A convention that random inputs never reach (a score exactly on a bin edge, a size exactly at a
threshold) survives any test that draws its inputs at random; each test here puts its input on
the edge, so that the one-line hand mutation named in its docstring fails it.
"""

from __future__ import annotations

import pytest
import torch

from shiftguard.commands.config import ModelConfig
from shiftguard.evaluation import DEFAULT_HEADS
from shiftguard.heads import NED, build_head
from shiftguard.metrics import ece
from shiftguard.metrics.calibration import bin_assignments, calibration_error_1d
from shiftguard.neighbors import PRUNED_MIN_PRODUCTS, PRUNED_MIN_SUPPORT, resolve_backend


def test_ece_bins_are_left_closed_and_the_last_is_closed_at_one():
    """metrics/calibration.py: ``[e_m, e_{m+1})``, the last bin ``[e_{M-1}, 1]``. Kills
    ``bucketize(..., right=True)`` -> ``right=False`` and a dropped ``clamp_(0, n_bins - 1)``."""
    edges = torch.linspace(0, 1, 16, dtype=torch.float64)  # the very edges the binning uses
    idx, upper = bin_assignments(edges, 15)
    assert idx.tolist() == [*range(15), 14]
    assert torch.equal(upper, edges[1:])
    # two scores on the edge 0.5 with n_bins = 2: left-closed puts them in the upper bin
    # (|1 - 0.5| * 2/3 + |0 - 0.25| * 1/3 = 5/12); right-closed would pool all three (0.25)
    assert calibration_error_1d(torch.tensor([0.5, 0.5, 0.25]), torch.tensor([1, 1, 0]), n_bins=2) == pytest.approx(
        5 / 12, abs=1e-15
    )
    # the same edge through ece(), top-label and marginal (one-vs-rest scores; class 1 always scored 0
    # and right once: 1/3)
    probs = torch.tensor([[0.5, 0.0], [0.5, 0.0], [0.25, 0.0]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1])
    assert ece(probs, labels, n_bins=2, one_vs_rest=True) == pytest.approx(5 / 12, abs=1e-15)
    assert ece(probs, labels, n_bins=2, kind="marginal", one_vs_rest=True) == pytest.approx(
        (5 / 12 + 1 / 3) / 2, abs=1e-15
    )


def test_the_registered_ned_fits_its_temperature_on_a_holdout_of_the_support():
    """heads/registry.py: ``"ned"`` is ``NED(k, fit_mode="holdout")`` (the class's own default is
    ``"loo"``). Kills ``fit_mode="holdout"`` -> ``"loo"`` in the registry."""
    g = torch.Generator().manual_seed(0)
    support = torch.randn(120, 3, generator=g)
    labels = (support[:, 0] + 0.8 * torch.randn(120, generator=g) > 0).long()
    head = build_head("ned", 2, k=5)
    assert isinstance(head, NED) and head.fit_mode == "holdout" and head.k == 5
    head.fit(support, labels)
    holdout = NED(k=5, fit_mode="holdout", num_classes=2).fit(support, labels)
    loo = NED(k=5, fit_mode="loo", num_classes=2).fit(support, labels)
    assert head.temperature_ == holdout.temperature_ != loo.temperature_


def test_the_default_heads():
    """``shiftguard.evaluate`` scores ``DEFAULT_HEADS`` when no heads are named, a run config's
    model the logistic refit. Kills any change of either list."""
    assert DEFAULT_HEADS == ("softmax", "temperature", "logistic", "ned", "knn")
    assert ModelConfig(name="m", arch="lenet", activation="relu", loss="cross_entropy").heads == ["logistic"]


def test_the_auto_search_is_pruned_exactly_from_both_thresholds_on_the_cpu():
    """neighbors/search.py: ``"auto"`` is ``"pruned"`` on the CPU when the support holds at least
    24,000 rows and the search at least 4e7 distances, else ``"torch"``. Kills ``>=`` -> ``>`` in
    either comparison, a changed threshold, and ``and`` -> ``or``."""
    assert (PRUNED_MIN_SUPPORT, PRUNED_MIN_PRODUCTS) == (24_000, 40_000_000)
    n_at = -(-PRUNED_MIN_PRODUCTS // PRUNED_MIN_SUPPORT)  # the fewest queries reaching 4e7 distances
    assert resolve_backend("auto", PRUNED_MIN_SUPPORT, n_at) == "pruned"
    assert resolve_backend("auto", 40_000, 1_000) == "pruned"  # exactly 4e7 distances
    assert resolve_backend("auto", 40_000, 999) == "torch"
    assert resolve_backend("auto", PRUNED_MIN_SUPPORT - 1, 10**6) == "torch"  # support below, products far above
    assert resolve_backend("auto", PRUNED_MIN_SUPPORT, n_at - 1) == "torch"
    assert resolve_backend("auto", 10**6, 10**6, device="meta") == "torch"  # pruning is CPU-only
    assert resolve_backend("torch", 10**6, 10**6) == "torch"
