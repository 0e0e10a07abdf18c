"""Conformal prediction sets as a part of every evaluation cell (``evaluate(conformal=...)``).

Every head's probabilities are calibrated once, on clean held-out data the head was never fitted
on, with each conformal method of :mod:`shiftguard.conformal` at level ``1 - alpha``; every cell
then records, per head and method, the coverage of the sets (the fraction of test images whose set
holds the label) and their mean size: ``coverage_<method>`` and ``set_size_<method>`` in the rows.
With ``weighted``, the weighted split conformal of Tibshirani et al. (2019) is scored beside the
plain one (``coverage_<method>_weighted``, ``set_size_<method>_weighted``): the likelihood ratio
of each cell's inputs against the calibration inputs is estimated from the model's embeddings (its
logits when it has no embedding) by a logistic regression between the calibration set and the
unlabelled cell -- transductive: a cell's sets depend on the other images of the cell.

Calibration data: ``calibration=`` when given; otherwise the validation data is split in two halves
(a seeded permutation): one fits what reads validation data (temperature scaling, NED's
temperature), the other calibrates the sets (``results["conformal"]["calibration"]`` says which).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shiftguard.conformal import METHODS, SplitConformal, WeightedSplitConformal, likelihood_ratio_weights
from shiftguard.metrics.conformal import coverage

__all__ = ["ConformalSpec", "conformal_spec", "fit_calibrators", "set_metrics", "split_validation"]


@dataclass(frozen=True)
class ConformalSpec:
    """What ``evaluate(conformal=..., alpha=..., conformal_weighted=...)`` asks for."""

    methods: tuple[str, ...]
    alpha: float = 0.1
    weighted: bool = False

    def describe(self, calibration: str, n: int) -> dict:
        return {
            "methods": list(self.methods),
            "alpha": self.alpha,
            "target_coverage": 1.0 - self.alpha,
            "weighted": self.weighted,
            "calibration": calibration,
            "n_calibration": n,
            "randomized": True,
            "note": "coverage_<method>: fraction of test images whose set holds the label; set_size_<method>: "
            "mean set size"
            + (
                "; *_weighted: weighted split conformal (Tibshirani et al. 2019), "
                "likelihood ratio estimated on each unlabelled cell (transductive)"
                if self.weighted
                else ""
            ),
        }


def conformal_spec(conformal, alpha: float, weighted: bool) -> Optional[ConformalSpec]:
    """The validated request (None when no method is asked for); errors name the argument."""
    if conformal is None:
        return None
    methods = [conformal] if isinstance(conformal, str) else list(conformal)
    for m in methods:
        if m not in METHODS:
            raise ValueError(f"conformal: unknown method {m!r}; expected some of {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise ValueError(f"conformal: a method is listed twice in {methods}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 < float(alpha) < 1.0:
        raise ValueError(f"alpha: expected a miscoverage level in (0, 1), got {alpha!r}")
    if not isinstance(weighted, bool):
        raise TypeError(f"conformal_weighted: expected a bool, got {type(weighted).__name__}")
    if not methods:
        if weighted:
            raise ValueError("conformal_weighted: given without conformal methods")
        return None
    return ConformalSpec(tuple(methods), float(alpha), weighted)


def split_validation(
    validation: tuple[torch.Tensor, torch.Tensor], seed: int
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(fit half, calibration half)`` of the validation data, by a permutation seeded with ``seed``."""
    x, y = validation
    n = int(y.numel())
    if n < 4:
        raise ValueError(
            f"validation: {n} images cannot be split into a fitting and a calibration half; give "
            "calibration= data or more validation data"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed + 17))
    a, b = perm[: n // 2].sort().values, perm[n // 2 :].sort().values
    return (x[a], y[a]), (x[b], y[b])


def fit_calibrators(spec: ConformalSpec, probs: torch.Tensor, labels: torch.Tensor, seed: int) -> dict:
    """``{method: calibrator}`` fitted on one head's calibration probabilities."""
    cls = WeightedSplitConformal if spec.weighted else SplitConformal
    return {m: cls(m, spec.alpha, seed=seed).fit(probs, labels) for m in spec.methods}


def set_metrics(
    spec: ConformalSpec,
    calibrators: dict,
    probs: torch.Tensor,
    labels: torch.Tensor,
    uniform: torch.Tensor,
    weights: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
) -> dict:
    """The row fields of one head on one cell: coverage and mean set size per method (and of the
    weighted variant when ``weights = (w_cal, w_test)`` over all calibration rows are given)."""
    out: dict = {}
    for m in spec.methods:
        conf = calibrators[m]
        sets = SplitConformal.predict_sets(conf, probs, uniform=uniform)
        out[f"coverage_{m}"] = coverage(sets, labels)
        out[f"set_size_{m}"] = float(sets.sum(1).double().mean())
        if spec.weighted:
            assert weights is not None
            w_cal, w_test = weights
            wsets = conf.predict_sets(
                probs, uniform=uniform, cal_weights=w_cal[conf.kept_.to(w_cal.device)], test_weights=w_test
            )
            out[f"coverage_{m}_weighted"] = coverage(wsets, labels)
            out[f"set_size_{m}_weighted"] = float(wsets.sum(1).double().mean())
    return out


def cell_weights(
    cal_features: torch.Tensor, test_features: torch.Tensor, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The likelihood ratios of the calibration and the cell's inputs (module docstring)."""
    return likelihood_ratio_weights(cal_features, test_features, seed=seed)


def cell_uniform(n: int, seed: int, cell: int) -> torch.Tensor:
    """The uniform draws of the randomised APS / RAPS sets of one cell, fixed by ``seed`` and the
    cell's index (the same for every model, arm and head on that cell)."""
    return torch.rand(
        n, generator=torch.Generator().manual_seed(seed * 1_000_003 + 7919 * (cell + 1)), dtype=torch.float64
    )


def conformal_fields(spec: Optional[ConformalSpec]) -> Sequence[str]:
    """The row fields a spec adds."""
    if spec is None:
        return ()
    base = [f"{k}_{m}" for m in spec.methods for k in ("coverage", "set_size")]
    return base + ([f"{f}_weighted" for f in base] if spec.weighted else [])
