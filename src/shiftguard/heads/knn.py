"""Exact k-nearest-neighbour search in squared Euclidean distance.

``knn_search`` is the one place the library looks up neighbours (NED and the kNN baselines in
004 Sec. 2, the retrieval metrics of 002 Sec. 5.3 and the R-AUROC of 003 Sec. 4.3). Two exact back
ends return the same neighbours on tie-free data (three, with the pruned one):

- ``"torch"``: chunked ``||s||^2 - 2 q.s`` (the ranking part of ``||q - s||^2``) and ``topk``; the ``(chunk, N_support)``
  distance block is the only large temporary, its size set by ``memory_budget_bytes``. Any device.
- ``"faiss"``: ``faiss.IndexFlatL2`` (optional dependency ``faiss-cpu``, imported lazily), CPU only.
- ``"pruned"``: the torch back end's arithmetic, but whole (query block, support cluster) products
  that a provable lower bound rules out are skipped (``shiftguard.heads.knn_pruned``); same
  neighbours as ``"torch"``, several times fewer products on clustered embeddings, about the
  brute-force cost plus an index build where nothing can be pruned. Pass a prebuilt
  ``PrunedKNNIndex`` as ``index`` to search one support several times without rebuilding.

All back ends rank by the expansion on rows centred at the support's mean (``_key_centre``):
distances do not change under a common shift, but the expansion's rounding grows with
``||s||^2``, so on a support far from the origin (1e3 away, spread 1) the uncentred keys picked a
wrong nearest neighbour for 4 of 40 random draws. The centred copy of the support is the one extra
``O(Ns D)`` allocation. The returned distances are recomputed exactly as ``||q - s_i||^2`` (raw
rows) for the selected neighbours, so a duplicate of the query has distance exactly 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from shiftguard._validation import check_positive, check_tensor

__all__ = ["knn_search", "default_chunk_size"]

#: Memory the torch back end may spend on one block of query-to-support distances (32 MiB).
#: Blocks this size are recycled by the C allocator; larger ones (it was 256 MiB) are mapped fresh
#: from the kernel for every chunk, and the page faults cost more than the matmul: 10k x 10k x 84
#: took 0.51 s at 256 MiB vs 0.39 s at 32 MiB, 10k x 60k x 128 3.5 s vs 2.9 s (2-core CPU).
DEFAULT_MEMORY_BUDGET_BYTES = 32 * 2**20

_BACKENDS = ("torch", "faiss", "pruned", "auto")


def default_chunk_size(n_support: int, dtype: torch.dtype = torch.float32,
                       memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> int:
    """Number of query rows whose ``(rows, n_support)`` distance block fits the memory budget."""
    bytes_per_row = max(1, n_support) * torch.empty((), dtype=dtype).element_size()
    return max(1, int(memory_budget_bytes // bytes_per_row))


def _import_faiss():
    try:
        import faiss  # noqa: PLC0415 - optional dependency, imported only when asked for
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "backend='faiss' needs the optional dependency faiss-cpu (pip install 'shiftguard[faiss]')"
        ) from exc
    return faiss


def _faiss_available() -> bool:
    try:
        _import_faiss()
    except ImportError:
        return False
    return True


def _exact_sq_dist(query: torch.Tensor, support: torch.Tensor, idx: torch.Tensor,
                   memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES) -> torch.Tensor:
    """``||q_i - s_{idx[i, j]}||^2`` for the selected neighbours only, shape ``(Nq, k)``.

    The gathered ``(rows, k, D)`` differences are built a few rows at a time within the budget.
    """
    n_q, k = idx.shape
    row_bytes = max(1, k * support.shape[1] * support.element_size())
    rows = max(1, int(memory_budget_bytes // row_bytes))
    out = torch.empty((n_q, k), dtype=query.dtype, device=query.device)
    for start in range(0, n_q, rows):
        sl = slice(start, start + rows)
        out[sl] = (query[sl].unsqueeze(1) - support[idx[sl]]).pow(2).sum(-1)
    return out


def _resort(dist: torch.Tensor, idx: torch.Tensor):
    # Exact recomputation may swap two near-tied neighbours; keep rows sorted by the exact value.
    dist, order = dist.sort(dim=1, stable=True)
    return dist, idx.gather(1, order)


def _key_centre(support: torch.Tensor) -> torch.Tensor:
    """The support's mean in its dtype: every back end ranks by keys of rows centred at it (module
    docstring). Computed in float64, so the same support gives the same centre in every back end."""
    return support.mean(0, dtype=torch.float64).to(support.dtype)


def _key_rows(support: torch.Tensor, centre: Optional[torch.Tensor] = None):
    """``(centre, support - centre, ||support - centre||^2)``: what the torch back end ranks with;
    callers that search one support many times (the retrieval metrics' query chunks) build it once."""
    centre = _key_centre(support) if centre is None else centre
    sc = support - centre
    return centre, sc, sc.pow(2).sum(1)


def _torch_knn(query, support, k, self_index, chunk_size, keys=None):
    """Chunked exact kNN; ``self_index`` (Nq,) names a support row to exclude per query, or None;
    ``keys``: :func:`_key_rows` of ``support`` if the caller has them."""
    n_q = query.shape[0]
    centre, sc, s_sq = _key_rows(support) if keys is None else keys
    out_d = torch.empty((n_q, k), dtype=query.dtype, device=query.device)
    out_i = torch.empty((n_q, k), dtype=torch.long, device=query.device)
    for start in range(0, n_q, chunk_size):
        q = query[start:start + chunk_size]
        # ||s||^2 - 2 q.s ranks the support rows like ||q - s||^2 (||q||^2 is constant per row);
        # the exact distances of the k winners are recomputed below.
        block = torch.addmm(s_sq.unsqueeze(0), q - centre, sc.t(), alpha=-2.0)
        if self_index is not None:
            rows = torch.arange(q.shape[0], device=q.device)
            block[rows, self_index[start:start + chunk_size]] = float("inf")
        _, idx = torch.topk(block, k, dim=1, largest=False, sorted=True)
        del block
        d = _exact_sq_dist(q, support, idx)
        d, idx = _resort(d, idx)
        out_d[start:start + chunk_size] = d
        out_i[start:start + chunk_size] = idx
    return out_d, out_i


def _faiss_index(support: torch.Tensor):
    """``(centre, faiss.IndexFlatL2 of the centred support)``: what the faiss back end searches;
    callers that search one support many times (the retrieval metrics' query chunks) build it once."""
    faiss = _import_faiss()
    import numpy as np  # noqa: PLC0415

    centre = _key_centre(support)
    index = faiss.IndexFlatL2(support.shape[1])
    index.add(np.ascontiguousarray((support - centre).detach().cpu().numpy(), dtype=np.float32))
    return centre, index


def _faiss_knn(query, support, k, self_index, keys=None):
    """``keys``: :func:`_faiss_index` of ``support`` if the caller has it."""
    import numpy as np  # noqa: PLC0415

    centre, index = _faiss_index(support) if keys is None else keys
    q = np.ascontiguousarray((query - centre).detach().cpu().numpy(), dtype=np.float32)
    extra = 1 if self_index is not None else 0
    _, idx = index.search(q, k + extra)
    idx = torch.from_numpy(idx).to(query.device)
    if self_index is not None:
        # Drop the query's own row where faiss returned it, else the farthest of the k+1.
        is_self = idx == self_index.unsqueeze(1)
        no_self = ~is_self.any(1)
        is_self[no_self, -1] = True
        keep = torch.argsort(is_self.to(torch.int8), dim=1, stable=True)[:, :k]
        idx = idx.gather(1, keep)
    d = _exact_sq_dist(query, support, idx)
    return _resort(d, idx)


def _validate(query, support, k, backend):
    query = check_tensor(query, "query", ndim=2, floating=True, finite=True)
    support = check_tensor(support, "support", ndim=2, floating=True, finite=True, nonempty=True)
    if query.shape[1] != support.shape[1]:
        raise ValueError(
            f"query and support: embedding dimensions differ ({query.shape[1]} vs {support.shape[1]})"
        )
    if query.device != support.device:
        raise ValueError(f"query and support: on different devices ({query.device} vs {support.device})")
    if support.dtype != query.dtype:
        support = support.to(query.dtype)
    check_positive(k, "k", integer=True)
    _check_backend(backend)
    return query, support


def _check_backend(backend: str) -> None:
    """``ValueError`` naming ``backend`` unless it is one of the back ends ``knn_search`` takes."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")


def _resolve_backend(backend: str, query: torch.Tensor, n_support: int) -> str:
    if backend != "auto":
        return backend
    # FAISS pays a float32 copy to numpy; it wins only for large galleries on CPU.
    if query.device.type == "cpu" and n_support >= 50_000 and _faiss_available():
        return "faiss"
    return "torch"


def knn_search(
    query: torch.Tensor,
    support: torch.Tensor,
    k: int,
    backend: str = "torch",
    exclude_self: bool = False,
    chunk_size: Optional[int] = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    index=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest support rows of every query row, in squared Euclidean distance.

    Args:
        query: ``(Nq, D)`` float tensor.
        support: ``(Ns, D)`` float tensor on the same device (the gallery).
        k: neighbours per query, ``1 <= k <= Ns`` (``Ns - 1`` with ``exclude_self``).
        backend: ``"torch"`` (exact, chunked, any device), ``"faiss"`` (``IndexFlatL2``, CPU,
            needs ``faiss-cpu``), ``"pruned"`` (exact, torch arithmetic, skips products ruled out
            by a lower bound; see ``shiftguard.heads.knn_pruned``) or ``"auto"`` (faiss for CPU
            galleries of >= 50k rows when installed, torch otherwise).
        exclude_self: the query set *is* the support set (``query[i]`` is ``support[i]``);
            every query's own row is left out (leave-one-out, retrieval evaluation).
        chunk_size: query rows per distance block; default from ``memory_budget_bytes``.
        memory_budget_bytes: bytes one ``(chunk, Ns)`` distance block may use (torch back end;
            the pruned back end keeps its key blocks within the same budget).
        index: ``backend="pruned"`` only: a ``PrunedKNNIndex`` built on this very ``support``
            tensor (unchanged since), reused instead of building one for this call.

    Returns:
        ``(distances, indices)``, both ``(Nq, k)``, sorted by increasing distance; distances are
        squared Euclidean (exact for the selected pairs), indices are ``int64`` rows of ``support``.
    """
    query, support = _validate(query, support, k, backend)
    n_q, n_s = query.shape[0], support.shape[0]
    if exclude_self and n_q != n_s:
        raise ValueError(
            f"exclude_self: query and support must be the same set, got {n_q} and {n_s} rows"
        )
    available = n_s - (1 if exclude_self else 0)
    if k > available:
        raise ValueError(
            f"k: {k} neighbours requested but the support has only {available} candidate rows"
            + (" (its own row excluded)" if exclude_self else "")
        )
    if chunk_size is None:
        chunk_size = default_chunk_size(n_s, query.dtype, memory_budget_bytes)
    else:
        check_positive(chunk_size, "chunk_size", integer=True)
    self_index = torch.arange(n_q, device=query.device) if exclude_self else None
    if index is not None:
        if backend != "pruned":
            raise ValueError(f"index: only used by backend='pruned', got backend={backend!r}")
        if not index.matches(support):
            raise ValueError("index: built for a different support tensor (or the support changed since); "
                             "build PrunedKNNIndex(support) again")
    return _knn_dispatch(query, support, k, backend, self_index, chunk_size, index=index)


def _knn_dispatch(query, support, k, backend, self_index, chunk_size, index=None, keys=None):
    """Validated-input kNN; ``self_index`` (Nq,) or None. Used by the retrieval metrics' chunks,
    which pass what does not change between chunks: the pruned ``index``, or the ``keys`` of the
    torch (:func:`_key_rows`) or faiss (:func:`_faiss_index`) search."""
    if query.shape[0] == 0:
        empty = torch.empty((0, k), device=query.device)
        return empty.to(query.dtype), empty.long()
    if backend == "pruned":
        from shiftguard.heads.knn_pruned import PrunedKNNIndex  # noqa: PLC0415 - imports this module

        if index is None:
            index = PrunedKNNIndex(support)
        budget = chunk_size * support.shape[0] * support.element_size()
        return index.search(query, k, self_index, memory_budget_bytes=budget)
    if _resolve_backend(backend, query, support.shape[0]) == "faiss":
        if query.device.type != "cpu":
            raise ValueError("backend: 'faiss' (faiss-cpu) needs CPU tensors; use backend='torch' on GPU")
        return _faiss_knn(query, support, k, self_index, keys=keys)
    return _torch_knn(query, support, k, self_index, chunk_size, keys=keys)


def _search_state(support: torch.Tensor, backend: str) -> dict:
    """What every search of ``support`` with ``backend`` can share, as keyword arguments of
    :func:`_knn_dispatch`: the pruned ``index``, or the ``keys`` of the torch search (the centred
    key rows, :func:`_key_rows`) or of the faiss search (:func:`_faiss_index`). Built once by
    callers that search one support in many query chunks (the retrieval metrics)."""
    if backend == "pruned":
        from shiftguard.heads.knn_pruned import PrunedKNNIndex  # noqa: PLC0415 - imports this module

        return {"index": PrunedKNNIndex(support)}
    if _resolve_backend(backend, support, support.shape[0]) == "torch":
        return {"keys": _key_rows(support)}
    if support.device.type == "cpu":
        return {"keys": _faiss_index(support)}
    return {}  # faiss on another device: the search refuses it by name
