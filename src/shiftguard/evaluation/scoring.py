"""The metrics of one evaluation cell: one head's probabilities on one (shifted) test set."""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch

from shiftguard import metrics as M
from shiftguard.metrics.classification import check_probs_labels

__all__ = ["score_cell", "calibration_view", "score_retrieval", "reliability_bins", "CELL_METRICS"]

#: Per-cell metrics of :func:`score_cell`, in report order.
CELL_METRICS = (
    "accuracy",
    "nll",
    "brier",
    "ece_top_label",
    "ece_marginal",
    "r_auroc",
    "auroc_error",
    "aurc",
    "mean_confidence",
)


def score_cell(
    probs: torch.Tensor,
    labels: torch.Tensor,
    miss: Optional[torch.Tensor],
    n_bins: int = 15,
    one_vs_rest: Optional[torch.Tensor] = None,
) -> dict:
    """Classification, calibration and uncertainty metrics of one head on one test set.

    The head's uncertainty is ``1 - max probability``. ``r_auroc`` [Kirchhof, URL Alg. 1] is
    its AUROC for predicting a Recall@1 miss of the embedding (``miss`` from
    :func:`score_retrieval`, computed once per cell; ``None`` when the model has no embedding);
    ``auroc_error`` its AUROC for predicting the head's own errors; ``aurc`` the area under its
    risk-coverage curve (Geifman & El-Yaniv 2017).

    ``probs`` rows are normalised to sum to 1 (heads whose rows sum to 1 only up to rounding).
    ``one_vs_rest``: the head's one-vs-rest probabilities (quantile classifier). When given, the
    ECEs and the confidence are computed on them, as [QACT, Sec. 4] reports the quantile classifier
    (``metrics.ece(one_vs_rest=True)``); accuracy, NLL and Brier use the normalised ``probs``.
    """
    probs, calib = calibration_view(probs, one_vs_rest)
    ovr = one_vs_rest is not None
    # the values checked once here (finite, rows on the simplex, labels in range), not by every metric
    check_probs_labels(probs, labels)
    if ovr:
        check_probs_labels(calib, labels, probs_name="one_vs_rest", simplex=False)
    conf, pred = calib.max(1)
    uncertainty = 1.0 - conf
    wrong = probs.argmax(1) != labels
    return {
        "accuracy": float(M.accuracy(probs, labels, validate_args=False)),
        "nll": float(M.nll(probs, labels, validate_args=False)),
        "brier": float(M.brier(probs, labels, validate_args=False)),
        "ece_top_label": float(
            M.ece(calib, labels, n_bins=n_bins, kind="top-label", one_vs_rest=ovr, validate_args=False)
        ),
        "ece_marginal": float(
            M.ece(calib, labels, n_bins=n_bins, kind="marginal", one_vs_rest=ovr, validate_args=False)
        ),
        "r_auroc": None if miss is None else _or_none(lambda: M.auroc_error(uncertainty, miss)),
        "auroc_error": _or_none(lambda: M.auroc_error(uncertainty, pred != labels)),
        "aurc": _or_none(lambda: M.aurc(uncertainty, wrong)),
        "mean_confidence": float(conf.mean()),
    }


def calibration_view(
    probs: torch.Tensor, one_vs_rest: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs, calib)``: the head's probabilities with rows normalised to sum to 1, and the
    probabilities its calibration is judged on (the one-vs-rest ones when given, else ``probs``)."""
    probs = probs.float().clamp_min(0)
    probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-12)
    return probs, (probs if one_vs_rest is None else one_vs_rest.float().clamp(0, 1))


def score_retrieval(emb: torch.Tensor, labels: torch.Tensor, ks: Sequence[int]) -> tuple[dict, torch.Tensor]:
    """MAP@K and Recall@K of the test embeddings, each querying all the others ([QACT, Sec. 4] MAP@K),
    and the Recall@1 misses -- the nearest other embedding has another class (the target of
    R-AUROC [Kirchhof]) -- read off the same neighbour lists (one search)."""
    r, nearest = M.retrieval_metrics(emb, labels, ks=tuple(ks), r_metrics=False, return_nearest=True)
    out = {}
    for k in ks:
        out[f"map_at_{k}"] = _finite(r[f"map@{k}"])
        out[f"recall_at_{k}"] = _finite(r[f"recall@{k}"])
    return out, labels[nearest] != labels


def reliability_bins(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int = 15) -> dict:
    """Equal-width confidence bins (the reliability diagram of [NED, Sec. 3 / Fig. 1]):
    per bin the mean confidence, the accuracy and the count; empty bins hold ``None``."""
    conf = confidence.double().clamp(0, 1)
    idx = torch.clamp((conf * n_bins).long(), max=n_bins - 1)
    count = torch.bincount(idx, minlength=n_bins)
    s_conf = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, conf)
    s_acc = torch.zeros(n_bins, dtype=torch.float64).index_add_(0, idx, correct.double())
    nz = count > 0
    return {
        "edges": torch.linspace(0, 1, n_bins + 1).tolist(),
        "confidence": [float(s_conf[i] / count[i]) if nz[i] else None for i in range(n_bins)],
        "accuracy": [float(s_acc[i] / count[i]) if nz[i] else None for i in range(n_bins)],
        "count": count.tolist(),
    }


def _or_none(fn: Callable[[], float]) -> Optional[float]:
    """A metric that is undefined for this cell (e.g. AUROC with no errors at all) is ``None``."""
    try:
        return _finite(fn())
    except ValueError:
        return None


def _finite(v) -> Optional[float]:
    v = float(v)
    return v if math.isfinite(v) else None
