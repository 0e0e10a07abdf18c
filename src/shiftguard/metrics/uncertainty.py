"""How well an uncertainty score ranks errors: AUROC for errors, R-AUROC [Kirchhof], AURC.

All take an ``uncertainty`` per sample where *higher means more uncertain*.
"""

from __future__ import annotations

import torch

from shiftguard._validation import check_labels, check_same_length, check_tensor
from shiftguard.functional.scaling import normalize_rows
from shiftguard.neighbors import knn_search

__all__ = ["auroc_error", "r_auroc", "aurc", "excess_aurc", "one_nn_misses"]


def _check_scores_errors(uncertainty, is_error):
    u = check_tensor(uncertainty, "uncertainty", ndim=1, finite=True, nonempty=True)
    e = check_tensor(is_error, "is_error", ndim=1)
    check_same_length([("uncertainty", u), ("is_error", e)])
    if e.dtype != torch.bool:
        if not bool(((e == 0) | (e == 1)).all()):
            raise ValueError("is_error: expected booleans or 0/1 values")
        e = e.bool()
    return u, e.to(u.device)


def auroc_error(uncertainty, is_error) -> float:
    """AUROC of ``uncertainty`` for predicting ``is_error``: the probability that a random error gets a
    higher uncertainty than a random correct prediction (ties count 1/2). Raises ``ValueError`` unless
    both outcomes occur.

    Computed as the Mann-Whitney statistic (Hanley & McNeil 1982): with ``R`` the sum of the
    mid-ranks (ties share their average rank) of the errors' uncertainties among all ``N``,
    ``AUROC = (R - n_err (n_err + 1) / 2) / (n_err n_correct)`` -- the same number as
    ``sklearn.metrics.roc_auc_score``'s trapezoidal ROC area, ties included (tested), in one sort on
    the tensor's device. (``roc_auc_score`` is not called: its input validation alone costs more than
    this whole computation, and `shiftguard run` needs two AUROCs per head and cell.)
    """
    u, e = _check_scores_errors(uncertainty, is_error)
    n_err = int(e.sum())
    n = e.numel()
    if n_err == 0 or n_err == n:
        raise ValueError("is_error: AUROC needs both errors and correct predictions, got only one kind")
    order = torch.argsort(u.detach().double(), stable=True)
    _, inverse, counts = torch.unique_consecutive(u.detach().double()[order], return_inverse=True, return_counts=True)
    counts = counts.double()
    midrank = torch.cumsum(counts, 0) - (counts - 1.0) / 2.0  # 1-based average rank of each tie group
    rank_sum = float(midrank[inverse][e[order]].sum())
    return (rank_sum - n_err * (n_err + 1) / 2.0) / (n_err * (n - n_err))


def r_auroc(embeddings, labels, uncertainty, backend: str = "torch", metric: str = "cosine") -> float:
    """R-AUROC [Kirchhof, URL Sec. 3.1, Alg. 1]: AUROC of ``uncertainty`` for predicting that a
    sample's nearest other embedding (1-NN, itself excluded) has a different class (a Recall@1 miss).

    Args:
        embeddings: ``(N, D)`` float; labels: ``(N,)`` int; uncertainty: ``(N,)`` float, higher = more
            uncertain.
        backend: the ``shiftguard.neighbors.knn_search`` back end.
        metric: how the nearest neighbour is found. ``"cosine"`` (default): largest cosine similarity,
            i.e. the 1-NN of the L2-normalised embeddings, as the URL benchmark computes its Recall@1
            ([Kirchhof, URL Sec. 3.1]; its code normalises the embeddings before the search); a zero
            row normalises to zero (cosine 0 to every row). ``"euclidean"``: the 1-NN in Euclidean
            distance of the raw embeddings.

    Raises ``ValueError`` naming ``metric`` for another value, and as :func:`auroc_error` when the
    1-NN is always right or always wrong.
    """
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric: expected 'cosine' or 'euclidean', got {metric!r}")
    emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels")
    u = check_tensor(uncertainty, "uncertainty", ndim=1, finite=True)
    check_same_length([("embeddings", emb), ("labels", y), ("uncertainty", u)])
    return auroc_error(u, _one_nn_misses(emb, y, metric, backend))


def _one_nn_misses(emb: torch.Tensor, y: torch.Tensor, metric: str, backend: str) -> torch.Tensor:
    y = y.to(emb.device)
    if metric == "cosine":
        # Squared Euclidean distance between unit vectors is 2 - 2 cos: the same 1-NN as the largest cosine.
        emb = normalize_rows(emb)
    _, idx = knn_search(emb, emb, 1, backend=backend, exclude_self=True)
    return y[idx[:, 0]] != y


def one_nn_misses(embeddings, labels, metric: str = "cosine", backend: str = "torch") -> torch.Tensor:
    """``(N,)`` bool: whether each sample's nearest OTHER embedding has another label (a Recall@1
    miss, the event :func:`r_auroc` scores); ``metric`` as there. ``embeddings (N, D)`` float,
    ``N >= 2``; ``labels (N,)`` int. Raises ``ValueError`` / ``TypeError`` naming the argument."""
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric: expected 'cosine' or 'euclidean', got {metric!r}")
    emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels")
    check_same_length([("embeddings", emb), ("labels", y)])
    if emb.shape[0] < 2:
        raise ValueError("embeddings: Recall@1 needs at least 2 samples")
    return _one_nn_misses(emb, y, metric, backend)


def aurc(uncertainty, is_error) -> float:
    """Area under the risk-coverage curve (Geifman & El-Yaniv 2017; Geifman et al. 2019).

    Samples are accepted in order of increasing uncertainty; at coverage i/N the risk is the error
    rate of the i accepted samples; AURC is the mean risk over i = 1..N (lower is better). Tied
    uncertainties are accepted as a group: inside a tie group the expected error count over random
    tie-breaking (linear in the position) is used, so the result does not depend on sort order.
    """
    u, e = _check_scores_errors(uncertainty, is_error)
    order = torch.argsort(u.double(), stable=True)
    us, es = u[order].double(), e[order].double()
    n = us.numel()
    _, inverse, counts = torch.unique_consecutive(us, return_inverse=True, return_counts=True)
    group_err = torch.zeros(counts.numel(), dtype=torch.float64, device=us.device).index_add_(0, inverse, es)
    group_end = torch.cumsum(counts, 0)
    err_before = torch.cumsum(group_err, 0) - group_err  # errors in earlier groups
    start = group_end - counts  # accepted before the group
    pos = torch.arange(1, n + 1, device=us.device, dtype=torch.float64)  # coverage count i
    within = pos - start[inverse].double()  # 1..size inside the group
    expected_err = err_before[inverse] + group_err[inverse] * within / counts[inverse].double()
    return float((expected_err / pos).mean())


def excess_aurc(uncertainty, is_error) -> float:
    """E-AURC (Geifman et al. 2019): ``aurc(uncertainty) - aurc(oracle)``, where the oracle accepts
    every correct prediction before any error; 0 for a perfect ordering, larger is worse. Arguments
    and errors as :func:`aurc`."""
    _, e = _check_scores_errors(uncertainty, is_error)
    return aurc(uncertainty, e) - aurc(e.double(), e)
