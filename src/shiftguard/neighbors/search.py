"""Exact k-nearest-neighbour search in squared Euclidean distance.

:func:`knn_search` is the one place the library looks up neighbours (NED and the kNN baselines in
[NED, Sec. 2], the retrieval metrics of [Patel, Sec. 5.3] and the R-AUROC of [Kirchhof, Sec. 4.3]). Three exact back
ends return the same neighbours on tie-free data:

- ``"torch"``: chunked ``||s||^2 - 2 q.s`` (the ranking part of ``||q - s||^2``) and ``topk``; the
  ``(chunk, N_support)`` distance block is the only large temporary, its size set by
  ``memory_budget_bytes``. Any device (:mod:`shiftguard.neighbors.exact`).
- ``"faiss"``: ``faiss.IndexFlatL2`` (optional dependency ``faiss-cpu``, imported lazily), CPU only
  (:mod:`shiftguard.neighbors.faiss_backend`).
- ``"pruned"``: the torch back end's arithmetic, but whole (query block, support cluster) products
  that a provable lower bound rules out are skipped (:class:`~shiftguard.neighbors.PrunedKNNIndex`);
  same neighbours as ``"torch"``, several times fewer products on clustered embeddings, about the
  brute-force cost plus an index build where nothing can be pruned.

``"auto"`` means one rule everywhere (:func:`resolve_backend`): the pruned search for large CPU
searches, the torch search otherwise; FAISS only when named.

All back ends rank on rows centred at the support's mean and return distances recomputed exactly
for the selected neighbours (:mod:`shiftguard.neighbors.exact`). To search one support many times
without rebuilding what the back end prepares (centred key rows, a faiss index, the pruned index),
build a :class:`KNNIndex` once and call its :meth:`KNNIndex.search`.
"""

from __future__ import annotations

from typing import Optional

import torch

from shiftguard._validation import check_positive, check_tensor
from shiftguard.neighbors.exact import DEFAULT_MEMORY_BUDGET_BYTES, default_chunk_size, key_rows, torch_knn
from shiftguard.neighbors.faiss_backend import faiss_index, faiss_knn
from shiftguard.neighbors.pruned import PrunedKNNIndex

__all__ = [
    "BACKENDS",
    "KNNIndex",
    "PRUNED_MIN_PRODUCTS",
    "PRUNED_MIN_SUPPORT",
    "check_backend",
    "knn_search",
    "resolve_backend",
]

#: The back ends :func:`knn_search` and :class:`KNNIndex` take.
BACKENDS = ("torch", "faiss", "pruned", "auto")


def check_backend(backend: str, argument: str = "backend") -> str:
    """``backend`` if it is one of :data:`BACKENDS`, else ``ValueError`` naming ``argument``."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"{argument}: expected one of {BACKENDS}, got {backend!r}")
    return backend


#: ``backend="auto"`` takes the pruned search where the support has at least this many rows and
#: the search at least :data:`PRUNED_MIN_PRODUCTS` query x support distances, the brute-force torch
#: search below (:func:`resolve_backend`).
PRUNED_MIN_SUPPORT = 24_000
#: See :data:`PRUNED_MIN_SUPPORT`.
PRUNED_MIN_PRODUCTS = 40_000_000


def resolve_backend(
    backend: str, n_support: int, n_queries: int, device: torch.device | str = "cpu", argument: str = "backend"
) -> str:
    """The back end a search of ``n_queries`` rows against ``n_support`` rows on ``device`` runs with:
    ``backend`` itself, except ``"auto"`` -- the one meaning of ``"auto"`` in the library.

    ``"auto"`` is ``"pruned"`` for CPU tensors where ``n_support >= PRUNED_MIN_SUPPORT`` (24,000)
    and ``n_support * n_queries >= PRUNED_MIN_PRODUCTS`` (4e7), else ``"torch"``. Measured on LeNet
    embeddings, k = 10, with the index built beforehand (``docs/heads_metrics.md``, "kNN search"):
    below these sizes the pruned search's per-block work costs more than the products it skips.
    Pruning is CPU-only (elsewhere the pruned back end is the brute-force search), so other devices
    get ``"torch"``. ``"faiss"`` runs only when named: on class-clustered embeddings the pruned
    search is faster, and an optional install must not change which search ``"auto"`` is.

    Raises ``ValueError`` naming ``argument`` for a back end not in :data:`BACKENDS`.

    Examples:
        >>> resolve_backend("auto", 48_000, 10_000), resolve_backend("auto", 8_000, 1_000)
        ('pruned', 'torch')
        >>> resolve_backend("faiss", 10, 10)
        'faiss'
    """
    check_backend(backend, argument)
    if backend != "auto":
        return backend
    large = n_support >= PRUNED_MIN_SUPPORT and n_support * n_queries >= PRUNED_MIN_PRODUCTS
    return "pruned" if large and torch.device(device).type == "cpu" else "torch"


def _check_support(support) -> torch.Tensor:
    return check_tensor(support, "support", ndim=2, floating=True, finite=True, nonempty=True)


def _check_query(query, support: torch.Tensor) -> torch.Tensor:
    query = check_tensor(query, "query", ndim=2, floating=True, finite=True)
    if query.shape[1] != support.shape[1]:
        raise ValueError(f"query and support: embedding dimensions differ ({query.shape[1]} vs {support.shape[1]})")
    if query.device != support.device:
        raise ValueError(f"query and support: on different devices ({query.device} vs {support.device})")
    return query


def _check_exclusion(exclude_self: bool, exclude, n_q: int, n_s: int, device) -> Optional[torch.Tensor]:
    """The ``(Nq,)`` int64 support row to leave out per query, or None (arguments of ``knn_search``)."""
    if exclude is not None:
        if exclude_self:
            raise ValueError("exclude: give exclude_self=True or exclude, not both")
        ex = check_tensor(exclude, "exclude", ndim=1)
        if ex.is_floating_point() or ex.is_complex() or ex.dtype == torch.bool:
            raise TypeError(f"exclude: expected an integer tensor of support rows, got dtype {ex.dtype}")
        if ex.shape[0] != n_q:
            raise ValueError(f"exclude: expected one support row per query ({n_q}), got shape {tuple(ex.shape)}")
        if ex.numel() and (int(ex.min()) < 0 or int(ex.max()) >= n_s):
            raise ValueError(
                f"exclude: support rows must lie in [0, {n_s}), got values in [{int(ex.min())}, {int(ex.max())}]"
            )
        if ex.device != device:
            raise ValueError(f"exclude: on {ex.device}, expected the device of query ({device})")
        return ex.long()
    if exclude_self:
        if n_q != n_s:
            raise ValueError(f"exclude_self: query and support must be the same set, got {n_q} and {n_s} rows")
        return torch.arange(n_q, device=device)
    return None


def _check_k(k: int, n_s: int, self_index: Optional[torch.Tensor], exclude_self: bool) -> None:
    check_positive(k, "k", integer=True)
    available = n_s - (1 if self_index is not None else 0)
    if k > available:
        raise ValueError(
            f"k: {k} neighbours requested but the support has only {available} candidate rows"
            + (
                (" (its own row excluded)" if exclude_self else " (one row excluded per query)")
                if self_index is not None
                else ""
            )
        )


def _dispatch(query, support, k, backend, self_index, chunk_size, index=None, keys=None):
    """Validated-input kNN with a resolved ``backend`` (not ``"auto"``); ``self_index`` (Nq,) or None;
    ``index`` (pruned) or ``keys`` (torch:
    :func:`~shiftguard.neighbors.exact.key_rows`, faiss: ``faiss_index``) prepared by the caller."""
    if query.shape[0] == 0:
        empty = torch.empty((0, k), device=query.device)
        return empty.to(query.dtype), empty.long()
    if backend == "pruned":
        if index is None:
            index = PrunedKNNIndex(support)
        budget = chunk_size * support.shape[0] * support.element_size()
        return index.search(query, k, self_index, memory_budget_bytes=budget)
    if backend == "faiss":
        if query.device.type != "cpu":
            raise ValueError("backend: 'faiss' (faiss-cpu) needs CPU tensors; use backend='torch' on GPU")
        return faiss_knn(query, support, k, self_index, keys=keys)
    return torch_knn(query, support, k, self_index, chunk_size, keys=keys)


def knn_search(
    query: torch.Tensor,
    support: torch.Tensor,
    k: int,
    backend: str = "torch",
    exclude_self: bool = False,
    chunk_size: Optional[int] = None,
    memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    index: Optional[PrunedKNNIndex] = None,
    exclude: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` nearest support rows of every query row, in squared Euclidean distance.

    Args:
        query: ``(Nq, D)`` float tensor.
        support: ``(Ns, D)`` float tensor on the same device (the gallery); converted to the dtype
            of ``query`` if it differs.
        k: neighbours per query, ``1 <= k <= Ns`` (``Ns - 1`` with ``exclude_self`` or ``exclude``).
        backend: ``"torch"`` (exact, chunked, any device), ``"faiss"`` (``IndexFlatL2``, CPU,
            needs ``faiss-cpu``), ``"pruned"`` (exact, torch arithmetic, skips products ruled out
            by a lower bound; see :class:`~shiftguard.neighbors.PrunedKNNIndex`) or ``"auto"``
            (pruned for large CPU searches, torch otherwise: :func:`resolve_backend`).
        exclude_self: the query set *is* the support set (``query[i]`` is ``support[i]``);
            every query's own row is left out (leave-one-out, retrieval evaluation).
        chunk_size: query rows per distance block; default from ``memory_budget_bytes``.
        memory_budget_bytes: bytes one ``(chunk, Ns)`` distance block may use (torch back end;
            the pruned back end keeps its key blocks within the same budget).
        index: ``backend="pruned"`` only: a ``PrunedKNNIndex`` built on this very ``support``
            tensor (unchanged since), reused instead of building one for this call.
        exclude: ``(Nq,)`` integer tensor: for every query, one support row left out of its
            candidates (leave-one-out on a subset of the support: ``query = support[rows]``,
            ``exclude = rows``). Excluded by index, so a duplicate of the query elsewhere in the
            support is still found. Not together with ``exclude_self``.

    Returns:
        ``(distances, indices)``, both ``(Nq, k)``, sorted by increasing distance; distances are
        squared Euclidean (exact for the selected pairs) in the dtype of ``query``, indices are
        ``int64`` rows of ``support``.

    Raises:
        TypeError: a non-floating ``query`` or ``support``, a non-integer ``k`` or ``exclude``.
        ValueError: wrong shapes, NaN/inf, an empty support, different devices, ``k`` above the
            candidate rows, an unknown ``backend``, an ``index`` of another support, or
            ``backend="faiss"`` on a non-CPU device; each message names the argument.

    Examples:
        >>> support = torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]])
        >>> d, i = knn_search(torch.tensor([[0.9, 0.0]]), support, k=2)
        >>> i.tolist(), [round(v, 4) for v in d[0].tolist()]
        ([[1, 0]], [0.01, 0.81])
        >>> knn_search(support, support, k=1, exclude_self=True)[1].squeeze(1).tolist()
        [1, 0, 1]
    """
    query = check_tensor(query, "query", ndim=2, floating=True, finite=True)
    support = _check_support(support)
    query = _check_query(query, support)
    if support.dtype != query.dtype:
        support = support.to(query.dtype)
    check_positive(k, "k", integer=True)
    check_backend(backend)
    n_q, n_s = query.shape[0], support.shape[0]
    self_index = _check_exclusion(exclude_self, exclude, n_q, n_s, query.device)
    _check_k(k, n_s, self_index, exclude_self)
    if chunk_size is None:
        chunk_size = default_chunk_size(n_s, query.dtype, memory_budget_bytes)
    else:
        check_positive(chunk_size, "chunk_size", integer=True)
    if index is not None:
        if backend != "pruned":
            raise ValueError(f"index: only used by backend='pruned', got backend={backend!r}")
        if not isinstance(index, PrunedKNNIndex):
            raise TypeError(f"index: expected a PrunedKNNIndex, got {type(index).__name__}")
        if not index.matches(support):
            raise ValueError(
                "index: built for a different support tensor (or the support changed since); "
                "build PrunedKNNIndex(support) again"
            )
    backend = resolve_backend(backend, n_s, n_q, query.device)
    return _dispatch(query, support, k, backend, self_index, chunk_size, index=index)


class KNNIndex:
    """One support set prepared for many exact searches with one back end.

    What a back end builds from the support alone is built once here: the centred key rows of the
    torch search, the faiss ``IndexFlatL2``, or the :class:`~shiftguard.neighbors.PrunedKNNIndex`.
    :meth:`search` returns exactly what :func:`knn_search` returns for the same arguments (with
    ``"auto"``: for queries of ``n_queries`` rows), without re-validating the support; the support
    must not be modified in place afterwards.

    Args:
        support: ``(Ns, D)`` float tensor, finite, non-empty.
        backend: one of :data:`BACKENDS` (see :func:`knn_search`); ``"auto"`` is resolved here
            (:func:`resolve_backend`) for searches of ``n_queries`` rows.
        n_queries: query rows of one search, for resolving ``"auto"``; default ``Ns`` (every
            support row queries the others, as in the retrieval metrics).

    Attributes:
        support: the validated support tensor. backend: the back end its searches run with
        (``"auto"`` resolved).

    Examples:
        >>> support = torch.tensor([[0.0, 0.0], [1.0, 0.0], [5.0, 5.0]])
        >>> index = KNNIndex(support)
        >>> index.search(support[:2], k=1, exclude=torch.tensor([0, 1]))[1].squeeze(1).tolist()
        [1, 0]
    """

    def __init__(self, support: torch.Tensor, backend: str = "torch", n_queries: Optional[int] = None):
        check_backend(backend)
        self.support = _check_support(support)
        if n_queries is not None:
            check_positive(n_queries, "n_queries", integer=True)
        n_s = self.support.shape[0]
        self.backend = backend = resolve_backend(
            backend, n_s, n_s if n_queries is None else n_queries, self.support.device
        )
        self._state: dict = {}
        if backend == "pruned":
            self._state = {"index": PrunedKNNIndex(self.support)}
        elif backend == "torch":
            self._state = {"keys": key_rows(self.support)}
        elif self.support.device.type == "cpu":
            self._state = {"keys": faiss_index(self.support)}
        # faiss on another device: nothing is prepared and search refuses it by name.

    def search(
        self,
        query: torch.Tensor,
        k: int,
        exclude: Optional[torch.Tensor] = None,
        chunk_size: Optional[int] = None,
        memory_budget_bytes: int = DEFAULT_MEMORY_BUDGET_BYTES,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` nearest support rows of every row of ``query`` ``(Nq, D)``, of the support's dtype
        and device; ``exclude``, ``chunk_size``, ``memory_budget_bytes`` and the result as in
        :func:`knn_search`. A ``query`` of another dtype raises ``ValueError`` naming ``query``."""
        support = self.support
        query = _check_query(query, support)
        if query.dtype != support.dtype:
            raise ValueError(f"query: dtype {query.dtype} differs from the index's support ({support.dtype})")
        check_positive(k, "k", integer=True)
        self_index = _check_exclusion(False, exclude, query.shape[0], support.shape[0], query.device)
        _check_k(k, support.shape[0], self_index, False)
        if chunk_size is None:
            chunk_size = default_chunk_size(support.shape[0], support.dtype, memory_budget_bytes)
        else:
            check_positive(chunk_size, "chunk_size", integer=True)
        return _dispatch(query, support, k, self.backend, self_index, chunk_size, **self._state)
