"""Retrieval metrics on embeddings: every sample queries all the others (itself excluded).

For query q with R_q other samples of its class, ranked neighbours n_1, n_2, ... (increasing
squared Euclidean distance) and rel_j = 1[y_{n_j} = y_q]:

- ``recall@K`` (002 Sec. 5.3 "r@k"): 1 if any of the first K neighbours is relevant, averaged.
- ``precision@1``: rel_1 averaged (= recall@1; 003's R@1; 004's 1NN accuracy).
- ``r_precision`` (Musgrave et al. 2020): ``(1/R_q) sum_{j<=R_q} rel_j``.
- ``map@r`` (Musgrave et al. 2020): ``(1/R_q) sum_{j<=R_q} P@j rel_j`` with ``P@j`` the precision of
  the first j neighbours.
- ``map@K``: 000 Sec. 4 reports "mean average precision at K" without a formula; we use the
  standard truncated AP normalised by the best achievable value,
  ``AP@K = (1/min(K, R_q)) sum_{j<=K} P@j rel_j``, so a perfect ranking scores 1 and
  ``map@K`` at ``K = R_q`` equals ``map@r``.

Queries with ``R_q = 0`` (no other sample of their class) are left out of every average, as in
pytorch-metric-learning's ``AccuracyCalculator``; their number is reported as ``n_lone_queries``.
MAP@R, R-precision and precision@1 agree with ``AccuracyCalculator`` (tested).

Memory: queries are processed in chunks; each chunk needs its kNN list up to
``max(max(ks), max R_q in the chunk)`` and one ``(chunk, N)`` distance block (``knn_search``),
so 100k x 100k never materialises an N x N matrix. The support is prepared once for all chunks
(``shiftguard.neighbors.KNNIndex``). For many samples per class the chunk's
kNN list (chunk x max R) is the dominant cost; the chunk size adapts to keep it under the budget.
"""

from __future__ import annotations

import operator
from typing import Sequence

import torch

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.neighbors import DEFAULT_MEMORY_BUDGET_BYTES, KNNIndex, check_backend, default_chunk_size

__all__ = ["retrieval_metrics"]


def _per_query(rel: torch.Tensor, r: torch.Tensor, ks: Sequence[int],
               r_metrics: bool = True) -> dict[str, torch.Tensor]:
    """Per-query metric values from the relevance matrix ``rel (Q, L)`` (bool) and ``R_q (Q,)``;
    ``r_metrics=False`` leaves out MAP@R and R-precision (``L`` may then be just ``max(ks)``)."""
    q, length = rel.shape
    relf = rel.double()
    pos = torch.arange(1, length + 1, device=rel.device, dtype=torch.float64)
    cum = relf.cumsum(1)
    prec_at_j = cum / pos
    rd = r.double()
    out = {"precision@1": relf[:, 0]}
    if r_metrics:
        within_r = pos.unsqueeze(0) <= r.unsqueeze(1)
        out["r_precision"] = (relf * within_r).sum(1) / rd
        out["map@r"] = (prec_at_j * relf * within_r).sum(1) / rd
    for k in ks:
        out[f"recall@{k}"] = (cum[:, k - 1] > 0).double()
        out[f"map@{k}"] = (prec_at_j[:, :k] * relf[:, :k]).sum(1) / torch.clamp(rd, max=k)
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


def retrieval_metrics(embeddings, labels, ks: Sequence[int] = (1, 2, 4, 8), backend: str = "torch",
                      memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES, r_metrics: bool = True,
                      return_nearest: bool = False):
    """Recall@K, MAP@K, MAP@R, R-precision and precision@1 of ``embeddings (N, D)`` (see module doc).

    Args:
        embeddings: ``(N, D)`` float tensor.
        labels: ``(N,)`` integer classes.
        ks: cut-offs for recall@K and map@K.
        backend: kNN back end for ``knn_search`` (``"torch"``, ``"faiss"``, ``"pruned"``, ``"auto"``;
            the pruned index is built once for all query chunks).
        memory_budget_bytes: bound on each chunk's distance block and neighbour list.
        r_metrics: also MAP@R and R-precision, which need every query's neighbour list up to its
            class size R_q (~N / classes); without them the lists stop at ``max(ks)``, far cheaper
            when classes are large. The K metrics are the same either way, except where neighbours
            at exactly the same distance straddle a cut-off (the search may break such ties
            differently for different list lengths).
        return_nearest: also return the ``(N,)`` index of every query's nearest other sample (the
            first entry of its neighbour list), for callers that need per-query Recall@1 hits (e.g.
            the R-AUROC target of 003) without a second search.

    Returns:
        dict of floats: ``recall@K`` and ``map@K`` for every K, ``map@r`` and ``r_precision`` (with
        ``r_metrics``), ``precision@1``, plus ``n_queries`` (used) and ``n_lone_queries`` (skipped);
        with ``return_nearest`` the tuple ``(dict, nearest)``.
    """
    emb = check_tensor(embeddings, "embeddings", ndim=2, floating=True, finite=True, nonempty=True)
    y = check_labels(labels, "labels")
    check_backend(backend)
    check_same_length([("embeddings", emb), ("labels", y)])
    y = y.to(emb.device)
    ks = _check_ks(ks)
    n = emb.shape[0]
    if max(ks) > n - 1:
        raise ValueError(f"ks: cut-off {max(ks)} exceeds the {n - 1} other samples")
    r_all = torch.bincount(y)[y] - 1                                        # R_q per query
    sums: dict[str, float] = {}
    n_used = 0
    nearest = torch.empty(n, dtype=torch.long, device=emb.device) if return_nearest else None
    block_rows = default_chunk_size(n, emb.dtype, memory_budget_bytes)
    index = KNNIndex(emb, backend)  # what every query chunk searches against, built once
    start = 0
    while start < n:
        # Rows whose neighbour list and per-query temporaries (rows x L, ~8 float64 tensors,
        # 64 bytes per entry) also fit the budget.
        rows = min(block_rows, n - start)
        while True:
            length = max(max(ks), int(r_all[start:start + rows].max())) if r_metrics else max(ks)
            if rows == 1 or rows * length * 64 <= memory_budget_bytes:
                break
            rows = max(1, rows // 2)
        sl = slice(start, start + rows)
        self_index = torch.arange(start, start + rows, device=emb.device)
        _, idx = index.search(emb[sl], length, exclude=self_index, chunk_size=block_rows)
        if nearest is not None:
            nearest[sl] = idx[:, 0]
        rel = y[idx] == y[sl].unsqueeze(1)
        r = r_all[sl]
        keep = r > 0
        if bool(keep.any()):
            vals = _per_query(rel[keep], r[keep], ks, r_metrics)
            for key, v in vals.items():
                sums[key] = sums.get(key, 0.0) + float(v.sum())
            n_used += int(keep.sum())
        start += rows
    if n_used == 0:
        raise ValueError("labels: every class has a single sample; no query has a relevant neighbour")
    order = ([f"recall@{k}" for k in ks] + [f"map@{k}" for k in ks]
             + (["map@r", "r_precision"] if r_metrics else []) + ["precision@1"])
    out = {key: sums[key] / n_used for key in order}
    out["n_queries"] = n_used
    out["n_lone_queries"] = n - n_used
    return (out, nearest) if return_nearest else out
