"""Per-sample uncertainty scores. Sign convention: every function returns ``(N,)`` where a HIGHER
value means MORE uncertain, so all of them plug into ``metrics.auroc_error`` / ``r_auroc`` / ``aurc``.

| score | formula | source |
|---|---|---|
| ``max_probability_uncertainty`` | ``1 - max_c p_c`` | Hendrycks & Gimpel 2017; [NED], conf. p-hat |
| ``entropy_uncertainty`` | ``-sum_c p_c log p_c`` | Shannon entropy of the prediction |
| ``margin_uncertainty`` | ``1 - (p_(1) - p_(2))`` (top-2 gap) | margin sampling |
| ``knn_distance_uncertainty`` | mean squared distance to the k nearest support embeddings | [NED, Sec. 2] (a) |
| ``ned_uncertainty`` | ``1 - max_c p_NED(c|z)`` | [NED, eq. (3)] |
| ``embedding_norm_uncertainty`` | ``-||z||`` | kappa = ||z||, vMF concentration [Kirchhof, Ch. 2 and URL Sec. 4] (b) |
| ``kappa_uncertainty`` | ``-kappa`` | predicted vMF concentration [Kirchhof] |

(a) [NED, Sec. 2]: "the magnitude of this distance can represent the confidence".
(b) [Kirchhof, Ch. 2 and URL Sec. 4] call this score the "embedding norm".
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_positive, check_probabilities, check_tensor
from shiftguard.neighbors import knn_search

__all__ = [
    "max_probability_uncertainty",
    "entropy_uncertainty",
    "margin_uncertainty",
    "knn_distance_uncertainty",
    "ned_uncertainty",
    "embedding_norm_uncertainty",
    "kappa_uncertainty",
]


def max_probability_uncertainty(probs) -> torch.Tensor:
    """``1 - max_c p_c`` for ``probs (N, C)``."""
    p = check_probabilities(probs, "probs")
    return 1.0 - p.max(dim=1).values


def entropy_uncertainty(probs) -> torch.Tensor:
    """Predictive entropy ``-sum_c p_c log p_c`` (nats; 0 log 0 = 0)."""
    p = check_probabilities(probs, "probs")
    return -torch.special.xlogy(p, p).sum(dim=1)


def margin_uncertainty(probs) -> torch.Tensor:
    """``1 - (p_(1) - p_(2))``: one minus the gap between the two largest probabilities."""
    p = check_probabilities(probs, "probs")
    if p.shape[1] < 2:
        raise ValueError("probs: the margin needs at least 2 classes")
    top2 = p.topk(2, dim=1).values
    return 1.0 - (top2[:, 0] - top2[:, 1])


def knn_distance_uncertainty(
    embeddings, support, k: int = 1, backend: str = "torch", exclude_self: bool = False
) -> torch.Tensor:
    """Mean squared Euclidean distance to the ``k`` nearest ``support`` embeddings [NED, Sec. 2]."""
    check_positive(k, "k", integer=True)
    d, _ = knn_search(embeddings, support, k, backend=backend, exclude_self=exclude_self)
    return d.mean(dim=1)


def ned_uncertainty(ned_head, embeddings) -> torch.Tensor:
    """``1 - max_c p(c|z)`` under a fitted :class:`shiftguard.heads.NED` [NED, eq. (3)]."""
    return 1.0 - ned_head.predict_proba(embeddings).max(dim=1).values


def embedding_norm_uncertainty(embeddings) -> torch.Tensor:
    """``-||z||_2``: in [Kirchhof] the un-normalised embedding norm is the vMF concentration kappa, large
    for confident inputs ([Kirchhof, Ch. 2; URL Sec. 4]: OOD inputs get smaller norms)."""
    z = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True)
    return -z.norm(dim=1)


def kappa_uncertainty(kappa) -> torch.Tensor:
    """``-kappa`` for predicted vMF concentrations ``(N,)`` [Kirchhof]."""
    k = check_tensor(kappa, "kappa", ndim=1, floating=True, finite=True)
    return -k
