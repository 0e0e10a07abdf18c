"""The brute-force exact back end: chunked ``||s||^2 - 2 q.s`` ranking, selection, exact distances.

Every back end of :func:`shiftguard.neighbors.knn_search` ranks by the expansion on rows centred at
the support's mean (:func:`key_centre`): distances do not change under a common shift, but the
expansion's rounding grows with ``||s||^2``, so on a support far from the origin (1e3 away, spread
1) uncentred keys pick a wrong nearest neighbour for some draws (``tests/test_heads_knn.py``). The
centred copy of the support is the one extra ``O(Ns D)`` allocation. The returned distances are
recomputed exactly as ``||q - s_i||^2`` (raw rows) for the selected neighbours
(:func:`exact_sq_dist`), so a duplicate of the query has distance exactly 0, and the rows are
re-sorted by these exact values (:func:`resort`).
"""

from __future__ import annotations

from typing import Optional

import torch

from shiftguard.neighbors.select import smallest_k

__all__ = [
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "default_chunk_size",
    "exact_sq_dist",
    "key_centre",
    "key_rows",
    "resort",
    "torch_knn",
]

#: Memory the torch back end may spend on one block of query-to-support distances (32 MiB).
#: Blocks of this size are recycled by the C allocator from chunk to chunk; much larger ones are
#: mapped fresh from the kernel for every chunk, and their page faults then cost more than the matmul.
DEFAULT_MEMORY_BUDGET_BYTES = 32 * 2**20


def default_chunk_size(
    n_support: int, dtype: torch.dtype = torch.float32, memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES
) -> int:
    """Number of query rows whose ``(rows, n_support)`` distance block of ``dtype`` fits
    ``memory_budget_bytes`` (at least 1).

    Examples:
        >>> default_chunk_size(1024, torch.float32, memory_budget_bytes=2**20)
        256
    """
    bytes_per_row = max(1, n_support) * torch.empty((), dtype=dtype).element_size()
    return max(1, int(memory_budget_bytes // bytes_per_row))


def exact_sq_dist(
    query: torch.Tensor,
    support: torch.Tensor,
    idx: torch.Tensor,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
) -> torch.Tensor:
    """``||q_i - s_{idx[i, j]}||^2`` for the selected neighbours only.

    Args:
        query: ``(Nq, D)`` float tensor. support: ``(Ns, D)`` of the same dtype and device.
        idx: ``(Nq, k)`` int64 rows of ``support``.
        memory_budget_bytes: the gathered ``(rows, k, D)`` differences are built a few query rows at
            a time within this budget; the values do not depend on it.

    Returns:
        ``(Nq, k)`` squared distances in the dtype of ``query``. Inputs are trusted (no validation).
    """
    n_q, k = idx.shape
    row_bytes = max(1, k * support.shape[1] * support.element_size())
    rows = max(1, int(memory_budget_bytes // row_bytes))
    out = torch.empty((n_q, k), dtype=query.dtype, device=query.device)
    for start in range(0, n_q, rows):
        sl = slice(start, start + rows)
        out[sl] = (query[sl].unsqueeze(1) - support[idx[sl]]).pow(2).sum(-1)
    return out


def resort(dist: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``(dist, idx)`` (both ``(Nq, k)``) stably sorted by ``dist``.

    The exact recomputation may swap two near-tied neighbours of the ranking; the result is kept
    sorted by the exact values, ties in their ranking order.
    """
    dist, order = dist.sort(dim=1, stable=True)
    return dist, idx.gather(1, order)


def key_centre(support: torch.Tensor) -> torch.Tensor:
    """The support's mean ``(D,)`` in its dtype: every back end ranks by keys of rows centred at it
    (module docstring). Computed in float64, so one support gives the same centre in every back end."""
    return support.mean(0, dtype=torch.float64).to(support.dtype)


def key_rows(
    support: torch.Tensor, centre: Optional[torch.Tensor] = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(centre (D,), support - centre (Ns, D), ||support - centre||^2 (Ns,))``: what the torch back
    end ranks with; callers that search one support many times build it once."""
    centre = key_centre(support) if centre is None else centre
    sc = support - centre
    return centre, sc, sc.pow(2).sum(1)


def torch_knn(
    query: torch.Tensor, support: torch.Tensor, k: int, self_index: Optional[torch.Tensor], chunk_size: int, keys=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked exact kNN on trusted input (``query`` of the support's dtype and device, ``1 <= k`` and
    enough candidate rows).

    Args:
        self_index: ``(Nq,)`` int64, the support row to leave out for each query, or None.
        chunk_size: query rows per ``(chunk, Ns)`` ranking block.
        keys: :func:`key_rows` of ``support`` if the caller has them.

    Returns:
        ``(distances, indices)``, both ``(Nq, k)``, as :func:`shiftguard.neighbors.knn_search`.
    """
    n_q = query.shape[0]
    centre, sc, s_sq = key_rows(support) if keys is None else keys
    out_d = torch.empty((n_q, k), dtype=query.dtype, device=query.device)
    out_i = torch.empty((n_q, k), dtype=torch.long, device=query.device)
    for start in range(0, n_q, chunk_size):
        q = query[start : start + chunk_size]
        # ||s||^2 - 2 q.s ranks the support rows like ||q - s||^2 (||q||^2 is constant per row);
        # the exact distances of the k winners are recomputed below.
        block = torch.addmm(s_sq.unsqueeze(0), q - centre, sc.t(), alpha=-2.0)
        if self_index is not None:
            rows = torch.arange(q.shape[0], device=q.device)
            block[rows, self_index[start : start + chunk_size]] = float("inf")
        _, idx = smallest_k(block, k)
        del block
        d = exact_sq_dist(q, support, idx)
        d, idx = resort(d, idx)
        out_d[start : start + chunk_size] = d
        out_i[start : start + chunk_size] = idx
    return out_d, out_i
