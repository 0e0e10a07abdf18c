"""Retrieval metrics on embeddings: every sample queries all the others (itself excluded).

For query q with R_q other samples of its class, ranked neighbours n_1, n_2, ... (increasing
squared Euclidean distance) and rel_j = 1[y_{n_j} = y_q]:

- ``recall@K`` ([Patel, Sec. 5.3] "r@k"): 1 if any of the first K neighbours is relevant, averaged.
- ``precision@1``: rel_1 averaged (= recall@1; the R@1 of [Kirchhof]; the 1NN accuracy of [NED]).
- ``r_precision`` (Musgrave et al. 2020): ``(1/R_q) sum_{j<=R_q} rel_j``.
- ``map@r`` (Musgrave et al. 2020): ``(1/R_q) sum_{j<=R_q} P@j rel_j`` with ``P@j`` the precision of
  the first j neighbours.
- ``map@K``: [QACT, Sec. 4] reports "mean average precision at K" without a formula; we use the
  standard truncated AP normalised by the best achievable value,
  ``AP@K = (1/min(K, R_q)) sum_{j<=K} P@j rel_j``, so a perfect ranking scores 1 and
  ``map@K`` at ``K = R_q`` equals ``map@r``.

Queries with ``R_q = 0`` (no other sample of their class) are left out of every average, as in
pytorch-metric-learning's ``AccuracyCalculator``; their number is reported as ``n_lone_queries``.
MAP@R, R-precision and precision@1 agree with ``AccuracyCalculator`` (tested).

Memory and order: the search for one chunk of queries returns each query's neighbour list up to
``L = max(max(ks), R_q)`` (``max(ks)`` without ``r_metrics``); the chunk is sized so that its
``(rows, L)`` lists and per-query temporaries fit ``memory_budget_bytes``, and only per-query
scalars (one float64 per query and metric) outlive it. Queries are taken in increasing order of
``R_q``, so a chunk's lists are as long as its own queries need, not as long as the largest class.
The peak is the embeddings, the prepared support (a centred copy for torch, the faiss index), the
per-query scalars and a few budgets: 1.7 GB for the whole process with 1M x 128 float32 embeddings
and 1,000 classes (faiss), where one whole ``(N, R_max)`` int64 neighbour matrix would take 8 GB
(``docs/performance.md``, ``benchmarks/bench_retrieval.py``).
Every average is the correctly rounded sum (``math.fsum``) of the per-query values, so the result
does not depend on the chunking (bit-identical for any ``memory_budget_bytes`` wherever no two
candidates of a query are tied at its cut-off).
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import torch

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.neighbors import DEFAULT_MEMORY_BUDGET_BYTES, KNNIndex, check_backend

__all__ = ["retrieval_metrics"]

#: Bytes per neighbour-list entry one query chunk may hold at once: the search's distances and
#: indices, the relevance matrix and the running sums of ``_per_query`` (16 tensors of 8 bytes).
_BYTES_PER_ENTRY = 128


def _per_query(
    rel: torch.Tensor, r: torch.Tensor, ks: Sequence[int], r_metrics: bool = True
) -> dict[str, torch.Tensor]:
    """Per-query metric values ``(Q,)`` float64 from the relevance matrix ``rel (Q, L)`` (bool) and
    ``R_q (Q,)`` (``L >= R_q`` with ``r_metrics``; ``L >= max(ks)``).

    Every value is read off running sums (``cumsum``, sequential along each row) at the query's
    cut-off, so it does not depend on ``L`` or on the other rows of the chunk."""
    length = rel.shape[1]
    relf = rel.double()
    pos = torch.arange(1, length + 1, device=rel.device, dtype=torch.float64)
    cum = relf.cumsum(1)  # relevant among the first j (exact integers)
    ap_cum = (cum / pos * relf).cumsum(1)  # sum_{i<=j} P@i rel_i
    rd = r.double()
    out = {"precision@1": relf[:, 0]}
    if r_metrics:
        at_r = (r - 1).unsqueeze(1)
        out["r_precision"] = cum.gather(1, at_r).squeeze(1) / rd
        out["map@r"] = ap_cum.gather(1, at_r).squeeze(1) / rd
    for k in ks:
        out[f"recall@{k}"] = (cum[:, k - 1] > 0).double()
        out[f"map@{k}"] = ap_cum[:, k - 1] / torch.clamp(rd, max=k)
    return out


def _check_ks(ks) -> list[int]:
    """The cut-offs as a list of positive ints; non-integral values (``1.7``, ``True``) raise, never truncate."""
    if isinstance(ks, (str, bytes)) or not hasattr(ks, "__iter__"):
        raise TypeError(f"ks: expected a sequence of positive ints, got {type(ks).__name__}")
    out = []
    for k in ks:
        if isinstance(k, bool):
            raise TypeError(f"ks: expected positive ints, got the bool {k!r}")
        try:
            k_int = operator.index(k)  # ints and numpy integers; floats such as 1.7 or 2.0 raise
        except TypeError:
            raise TypeError(f"ks: expected positive ints, got {k!r} ({type(k).__name__})") from None
        check_positive(k_int, "ks", integer=True)
        out.append(k_int)
    if not out:
        raise ValueError("ks: expected at least one cut-off")
    return out


def retrieval_metrics(
    embeddings,
    labels,
    ks: Sequence[int] = (1, 2, 4, 8),
    backend: str = "auto",
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    r_metrics: bool = True,
    return_nearest: bool = False,
):
    """Recall@K, MAP@K, MAP@R, R-precision and precision@1 of ``embeddings (N, D)`` (see module doc).

    Args:
        embeddings: ``(N, D)`` float tensor.
        labels: ``(N,)`` integer classes.
        ks: cut-offs for recall@K and map@K.
        backend: kNN back end of ``knn_search``: ``"auto"`` (the pruned exact search for large CPU
            searches, exact torch otherwise: ``shiftguard.neighbors.resolve_backend``), ``"torch"``,
            ``"faiss"`` or ``"pruned"``; the search index is built once for all query chunks.
        memory_budget_bytes: bound on each query chunk's neighbour lists with their per-query
            temporaries, and on the torch back end's distance block (positive int).
        r_metrics: also MAP@R and R-precision, which need every query's neighbour list up to its
            class size R_q (~N / classes); without them the lists stop at ``max(ks)``, far cheaper
            when classes are large. The K metrics are the same either way, except where neighbours
            at exactly the same distance straddle a cut-off (the search may break such ties
            differently for different list lengths).
        return_nearest: also return the ``(N,)`` index of every query's nearest other sample (the
            first entry of its neighbour list), for callers that need per-query Recall@1 hits (e.g.
            the R-AUROC target of [Kirchhof]) without a second search.

    Returns:
        dict of floats: ``recall@K`` and ``map@K`` for every K, ``map@r`` and ``r_precision`` (with
        ``r_metrics``), ``precision@1``, plus ``n_queries`` (used) and ``n_lone_queries`` (skipped);
        with ``return_nearest`` the tuple ``(dict, nearest)``.

    Raises:
        TypeError: non-floating ``embeddings``, non-integer ``labels`` or ``ks``, a non-integer
            ``memory_budget_bytes``.
        ValueError: shapes that do not match, NaN/inf embeddings, a cut-off above ``N - 1``, an
            unknown ``backend``, a non-positive ``memory_budget_bytes``, or labels where every class
            has a single sample; each message names the argument.
    """
    emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels")
    check_backend(backend)
    check_same_length([("embeddings", emb), ("labels", y)])
    check_positive(memory_budget_bytes, "memory_budget_bytes", integer=True)
    y = y.to(emb.device)
    ks = _check_ks(ks)
    n = emb.shape[0]
    if max(ks) > n - 1:
        raise ValueError(f"ks: cut-off {max(ks)} exceeds the {n - 1} other samples")
    r_all = torch.bincount(y)[y] - 1  # R_q per query
    used = torch.nonzero(r_all > 0).squeeze(1)
    if used.numel() == 0:
        raise ValueError("labels: every class has a single sample; no query has a relevant neighbour")
    keys = (
        [f"recall@{k}" for k in ks]
        + [f"map@{k}" for k in ks]
        + (["map@r", "r_precision"] if r_metrics else [])
        + ["precision@1"]
    )
    # Per-query values of the non-lone queries, in the order of ``used``; nothing else is kept.
    per_query = {key: torch.empty(used.numel(), dtype=torch.float64, device=emb.device) for key in keys}
    index = KNNIndex(emb, backend)  # what every query chunk searches against, built once
    nearest = None
    if return_nearest:
        nearest = torch.empty(n, dtype=torch.long, device=emb.device)
        lone = torch.nonzero(r_all == 0).squeeze(1)
        if lone.numel():  # lone queries enter no average, but their nearest sample is still asked for
            _, idx = index.search(emb[lone], 1, exclude=lone, memory_budget_bytes=memory_budget_bytes)
            nearest[lone] = idx[:, 0]
    order = torch.argsort(r_all[used], stable=True)  # increasing R_q: each chunk's lists stay short
    r_sorted = r_all[used][order]

    def list_length(last: int) -> int:  # the list length a chunk ending at sorted position ``last`` needs
        return max(max(ks), int(r_sorted[last])) if r_metrics else max(ks)

    start, m = 0, used.numel()
    while start < m:
        # Rows whose (rows, L) neighbour lists and per-query temporaries (at most 16 tensors of
        # 8 bytes per entry) fit the budget; L is the chunk's last (largest) list length.
        rows = min(m - start, max(1, memory_budget_bytes // (_BYTES_PER_ENTRY * list_length(start))))
        while rows > 1 and rows * list_length(start + rows - 1) * _BYTES_PER_ENTRY > memory_budget_bytes:
            rows //= 2
        length = list_length(start + rows - 1)
        pos = order[start : start + rows]
        q_rows = used[pos]
        _, idx = index.search(emb[q_rows], length, exclude=q_rows, memory_budget_bytes=memory_budget_bytes)
        if nearest is not None:
            nearest[q_rows] = idx[:, 0]
        rel = y[idx] == y[q_rows].unsqueeze(1)
        for key, v in _per_query(rel, r_all[q_rows], ks, r_metrics).items():
            per_query[key][pos] = v
        start += rows
    out = {key: math.fsum(per_query[key].tolist()) / used.numel() for key in keys}
    out["n_queries"] = int(used.numel())
    out["n_lone_queries"] = n - int(used.numel())
    return (out, nearest) if return_nearest else out
