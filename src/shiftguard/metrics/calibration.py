"""Expected calibration error, top-label and marginal (classwise), with equal-width or equal-mass bins.

Definitions:
- top-label ECE (Guo et al. 2017; [NED, Sec. 3.1, eqs. (6)-(7)]): bin the confidence ``max_c p_ic``,
  ``ECE = sum_m |B_m|/N * |acc(B_m) - conf(B_m)|`` with acc the share of correct arg-max predictions.
- marginal ECE (Kumar et al. 2019, "Verified uncertainty calibration", the definition [QACT, Sec. 4]
  refers to): for every class c, the binary calibration error of ``p_ic`` against ``1[y_i = c]``;
  ``ECE_marginal = (mean_c CE_c^p)^(1/p)`` (their ``get_calibration_error(mode="marginal")``).
- general ``p``: ``CE = (sum_m |B_m|/N |acc - conf|^p)^(1/p)``; ``p = 1`` is the usual ECE.
- ``debiased=True`` (only ``p = 2``): Kumar et al.'s debiased estimator of the squared L2 error,
  per bin ``(acc - conf)^2 - acc (1 - acc) / (|B_m| - 1)``, clipped at 0 before the square root.

Binning (``binning=``):
- ``"width"``: ``n_bins`` equal intervals of [0, 1], left-closed ``[e_m, e_{m+1})``, the last one
  closed at 1 (torchmetrics uses the same intervals but gives a confidence of exactly 1.0 a bin of
  its own; the two agree whenever no confidence equals 1.0).
- ``"mass"``: Kumar et al.'s ``get_equal_bins``: sort the scores, split them into ``n_bins``
  near-equal groups (``numpy.array_split`` sizes), place each boundary half-way between the last
  score of a group and the first of the next, and assign a score ``s`` to the first boundary
  ``>= s`` (``searchsorted``, left); duplicate boundaries are merged.

One-vs-rest probabilities (``one_vs_rest=True``): a classifier trained with one binary
cross-entropy per class (the quantile classifier of [QACT, Sec. 3]) outputs one probability per class
whose row need not sum to 1. Kumar et al.'s definitions apply to them unchanged -- top-label uses
``max_c p_ic`` as the confidence of the arg-max prediction, marginal calibrates each ``p_ic``
against ``1[y_i = c]`` -- and this is how [QACT] reports the quantile classifier ("We do not perform
any additional calibration and use the probabilities", Sec. 4). Renormalising such rows to sum 1
first would measure a different, mis-scaled quantity.

Each function returns a Python float; empty bins contribute nothing.
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_positive
from shiftguard.metrics.classification import check_probs_labels

__all__ = ["ece", "calibration_error_1d", "bin_assignments", "binned_statistics"]

_KINDS = ("top-label", "marginal")
_BINNINGS = ("width", "mass")


def bin_assignments(scores: torch.Tensor, n_bins: int, binning: str = "width"):
    """Bin index of every score (``(N,)`` in [0, n_bins')) and the bin upper edges ``(n_bins',)``."""
    if binning == "width":
        edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=scores.device)
        idx = torch.bucketize(scores.double().contiguous(), edges, right=True) - 1
        return idx.clamp_(0, n_bins - 1), edges[1:]
    s = scores.double().contiguous()
    sorted_s, _ = torch.sort(s)
    n = sorted_s.numel()
    parts = min(n_bins, n)
    # numpy.array_split sizes: the first n % parts groups hold one extra element.
    sizes = torch.full((parts,), n // parts, dtype=torch.long)
    sizes[: n % parts] += 1
    ends = torch.cumsum(sizes, 0)[:-1].to(s.device)  # first index of groups 2..parts
    bounds = (sorted_s[ends - 1] + sorted_s[ends]) / 2.0
    bounds = torch.unique(torch.cat([bounds, torch.ones(1, dtype=s.dtype, device=s.device)]))
    idx = torch.searchsorted(bounds, s, right=False).clamp_(max=bounds.numel() - 1)
    return idx, bounds


def binned_statistics(scores: torch.Tensor, hits: torch.Tensor, n_bins: int, binning: str = "width"):
    """Per-bin ``(count, mean score, mean hit)`` as float64 tensors, plus the upper edges."""
    idx, upper = bin_assignments(scores, n_bins, binning)
    nb = upper.numel()
    count = torch.zeros(nb, dtype=torch.float64, device=scores.device).index_add_(
        0, idx, torch.ones_like(scores, dtype=torch.float64)
    )
    conf = torch.zeros_like(count).index_add_(0, idx, scores.double())
    acc = torch.zeros_like(count).index_add_(0, idx, hits.double())
    safe = count.clamp(min=1)
    return count, conf / safe, acc / safe, upper


def calibration_error_1d(
    scores: torch.Tensor,
    hits: torch.Tensor,
    n_bins: int = 15,
    binning: str = "width",
    p: int = 1,
    debiased: bool = False,
) -> float:
    """Binned calibration error of scores in [0, 1] against 0/1 outcomes (the ``ce_1d`` of Kumar et al.)."""
    count, conf, acc, _ = binned_statistics(scores, hits, n_bins, binning)
    return float(_error_from_bins(count, conf, acc, p, debiased))


def _error_from_bins(
    count: torch.Tensor, conf: torch.Tensor, acc: torch.Tensor, p: int, debiased: bool
) -> torch.Tensor:
    """The calibration error of each row of per-bin ``(count, mean score, mean hit)`` (``(..., bins)``):
    ``(sum_b w_b |acc_b - conf_b|^p)^(1/p)``, or Kumar et al.'s debiased L2 estimate."""
    weight = count / count.sum(-1, keepdim=True)
    if debiased:
        var = acc * (1 - acc) / (count - 1).clamp(min=1)
        err = torch.where(count >= 2, (acc - conf).pow(2) - var, torch.zeros_like(acc))
        return (weight * err).sum(-1).clamp(min=0).sqrt()
    return (weight * (acc - conf).abs().pow(p)).sum(-1).pow(1.0 / p)


def _marginal_width_errors(
    prob: torch.Tensor, onehot: torch.Tensor, n_bins: int, p: int, debiased: bool
) -> torch.Tensor:
    """:func:`calibration_error_1d` of every class's column with equal-width bins, ``(C,)``: the
    same bins (``bin_assignments`` of all the scores at once) and per-bin sums, one pass for all
    classes instead of one per class."""
    c = prob.shape[1]
    scores = prob.t().contiguous()  # class-major: each class's scores in image order, as one column would be
    idx, _ = bin_assignments(scores.reshape(-1), n_bins, "width")
    flat = (idx.view(c, -1) + torch.arange(c, device=prob.device).unsqueeze(1) * n_bins).reshape(-1)
    zeros = torch.zeros(c * n_bins, dtype=torch.float64, device=prob.device)
    count = zeros.index_add(0, flat, torch.ones(flat.numel(), dtype=torch.float64, device=prob.device))
    conf = zeros.index_add(0, flat, scores.reshape(-1).double())
    acc = zeros.index_add(0, flat, onehot.t().reshape(-1).double())
    safe = count.clamp(min=1)
    return _error_from_bins(
        count.view(c, n_bins), (conf / safe).view(c, n_bins), (acc / safe).view(c, n_bins), p, debiased
    )


def ece(
    probs,
    labels,
    n_bins: int = 15,
    kind: str = "top-label",
    binning: str = "width",
    p: int = 1,
    debiased: bool = False,
    one_vs_rest: bool = False,
    *,
    validate_args: bool = True,
) -> float:
    """Expected calibration error of ``probs (N, C)`` against ``labels (N,)`` (see module docstring).

    Args:
        n_bins: number of bins (default 15 as in Guo et al. 2017).
        kind: ``"top-label"`` [NED, eq. (6)] or ``"marginal"`` (Kumar et al. 2019, [QACT, Sec. 4]).
        binning: ``"width"`` (equal-width) or ``"mass"`` (equal-mass, Kumar et al.).
        p: 1 (ECE) or 2 (L2 calibration error).
        debiased: Kumar et al.'s debiased L2 estimator (needs ``p=2``).
        one_vs_rest: ``probs`` holds one-vs-rest probabilities (entries in [0, 1], rows need not
            sum to 1; module docstring).
        validate_args: check the values of ``probs`` and ``labels`` (finite, in range, rows on the
            simplex); ``False`` skips those checks (host synchronisations), not the shape checks.

    Examples:
        >>> probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.3, 0.7], [0.6, 0.4]])
        >>> round(ece(probs, torch.tensor([0, 0, 1, 1]), n_bins=10), 4)
        0.15
    """
    prob, y = check_probs_labels(probs, labels, simplex=not one_vs_rest, validate_args=validate_args)
    check_positive(n_bins, "n_bins", integer=True)
    if kind not in _KINDS:
        raise ValueError(f"kind: expected one of {_KINDS}, got {kind!r}")
    if binning not in _BINNINGS:
        raise ValueError(f"binning: expected one of {_BINNINGS}, got {binning!r}")
    if p not in (1, 2):
        raise ValueError(f"p: expected 1 or 2, got {p!r}")
    if debiased and p != 2:
        raise ValueError("debiased: the debiased estimator of Kumar et al. is defined for p=2 only")
    if kind == "top-label":
        conf, pred = prob.max(dim=1)
        return calibration_error_1d(conf, (pred == y), n_bins, binning, p, debiased)
    onehot = torch.nn.functional.one_hot(y, prob.shape[1]).bool()
    if binning == "width":
        per_class = _marginal_width_errors(prob, onehot, n_bins, p, debiased).pow(p)
    else:  # equal-mass bins are each class's own
        per_class = torch.tensor(
            [
                calibration_error_1d(prob[:, c], onehot[:, c], n_bins, binning, p, debiased) ** p
                for c in range(prob.shape[1])
            ],
            dtype=torch.float64,
        )
    return float(per_class.mean() ** (1.0 / p))
