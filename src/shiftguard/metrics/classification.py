"""Plain classification metrics on predicted probabilities: accuracy, NLL, Brier score.

``validate_args=False`` skips the input checks that read values (finite probabilities in [0, 1],
rows summing to 1, labels in ``[0, C)``), each a wait for the device, e.g. for a metric logged every
training step on inputs known good; the shape and dtype checks stay.
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_labels, check_probabilities, check_same_length

__all__ = ["accuracy", "nll", "brier", "check_probs_labels"]


def check_probs_labels(
    probs,
    labels,
    probs_name: str = "probs",
    labels_name: str = "labels",
    simplex: bool = True,
    validate_args: bool = True,
):
    """Validate ``probs (N, C)`` (rows on the simplex unless ``simplex=False``) and ``labels (N,)`` in ``[0, C)``
    (the value checks only with ``validate_args``; the shapes always)."""
    p = check_probabilities(probs, probs_name, simplex=simplex, check_values=validate_args)
    y = check_labels(labels, labels_name, num_classes=p.shape[1], check_values=validate_args)
    check_same_length([(probs_name, p), (labels_name, y)])
    if p.shape[0] == 0:
        raise ValueError(f"{probs_name}: expected at least one row")
    return p, y.to(p.device)


def accuracy(probs, labels, *, validate_args: bool = True) -> float:
    """Share of rows whose arg-max class equals the label ([QACT, Sec. 4] "ACC"; [NED, Sec. 3.1])."""
    p, y = check_probs_labels(probs, labels, validate_args=validate_args)
    return float((p.argmax(1) == y).double().mean())


def nll(probs, labels, eps: float = 1e-12, *, validate_args: bool = True) -> float:
    """Mean negative log-likelihood ``-log p(y_i)`` (probabilities floored at ``eps``)."""
    p, y = check_probs_labels(probs, labels, validate_args=validate_args)
    py = p.gather(1, y.unsqueeze(1)).squeeze(1).double()
    return float(-torch.log(py.clamp(min=eps)).mean())


def brier(probs, labels, *, validate_args: bool = True) -> float:
    """Multiclass Brier score ``mean_i sum_c (p_ic - 1[y_i = c])^2`` (Brier 1950), in [0, 2]."""
    p, y = check_probs_labels(probs, labels, validate_args=validate_args)
    onehot = torch.nn.functional.one_hot(y, p.shape[1]).to(torch.float64)
    return float((p.double() - onehot).pow(2).sum(1).mean())
