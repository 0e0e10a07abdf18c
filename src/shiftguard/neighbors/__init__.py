"""Exact k-nearest-neighbour search, the one kNN API of the library (used by heads, metrics and
uncertainty scores).

- :func:`knn_search` -- the ``k`` nearest support rows of every query, squared Euclidean distance;
  back ends ``"torch"`` (chunked, memory-bounded), ``"faiss"`` and ``"pruned"`` (exact, cluster-pruned)
- :class:`KNNIndex` -- one support prepared once for many searches (any back end)
- :class:`SearchCache` -- searches shared between callers that would run the same one (the NED
  and kNN heads of one support): one prepared support per back end, one search per query
- :func:`resolve_backend` -- the one meaning of ``backend="auto"`` (pruned for large CPU
  searches, torch otherwise; :data:`PRUNED_MIN_SUPPORT`, :data:`PRUNED_MIN_PRODUCTS`)
- :class:`PrunedKNNIndex` -- the cluster-pruned index of ``backend="pruned"``, reusable via ``index=``
- :func:`default_chunk_size`, :data:`DEFAULT_MEMORY_BUDGET_BYTES` -- the memory bound of a search
- :func:`exact_sq_dist`, :func:`check_backend`, :data:`BACKENDS`
- :func:`smallest_k` -- the k smallest entries of each row (the back ends' selection step);
  :func:`warm_up` compiles it ahead of use

See ``docs/heads_metrics.md`` ("kNN search").
"""

from shiftguard.neighbors.cache import SearchCache
from shiftguard.neighbors.exact import DEFAULT_MEMORY_BUDGET_BYTES, default_chunk_size, exact_sq_dist
from shiftguard.neighbors.pruned import PrunedKNNIndex
from shiftguard.neighbors.search import (
    BACKENDS,
    PRUNED_MIN_PRODUCTS,
    PRUNED_MIN_SUPPORT,
    KNNIndex,
    check_backend,
    knn_search,
    resolve_backend,
)
from shiftguard.neighbors.select import smallest_k, warm_up

__all__ = [
    "BACKENDS",
    "DEFAULT_MEMORY_BUDGET_BYTES",
    "KNNIndex",
    "PRUNED_MIN_PRODUCTS",
    "PRUNED_MIN_SUPPORT",
    "PrunedKNNIndex",
    "SearchCache",
    "check_backend",
    "default_chunk_size",
    "exact_sq_dist",
    "knn_search",
    "resolve_backend",
    "smallest_k",
    "warm_up",
]
