"""Searches shared between the callers that would run the same one.

The NED and kNN heads fitted on one support search it alike: with the same ``k`` and back end they
ask for the very same neighbours of every query. A :class:`SearchCache` handed to each of them
(``build_head(..., searches=cache)``, ``KNNVote(searches=cache)``) makes that one search: the
support is prepared once per back end (:class:`~shiftguard.neighbors.KNNIndex`) and each query is
searched once per ``(support, k, back end)``, with exactly the answer each caller's own
:func:`~shiftguard.neighbors.knn_search` would give. The evaluation grid gives one cache to all the
heads it fits, so a cell costs one search per support instead of one per head.
"""

from __future__ import annotations

from typing import Optional

import torch

from shiftguard._validation import check_tensor
from shiftguard.neighbors.search import KNNIndex, knn_search, resolve_backend

__all__ = ["SearchCache"]

_Answer = tuple[torch.Tensor, torch.Tensor]


class SearchCache:
    """Exact kNN searches shared by the callers that would run the same one.

    Two things are kept, both keyed by tensor *identity* -- the very tensor object, not modified in
    place since (its ``_version``; a changed tensor is prepared or searched again):

    - per (support, back end): a :class:`~shiftguard.neighbors.KNNIndex`, built by the first search
      of that support and searched by every later one (:meth:`index`);
    - for the latest query tensor: the answer of each (support, ``k``, back end) search, so a second
      caller asking the same search of the same query gets the first caller's answer. A search of
      another query tensor drops these answers; the indexes stay until :meth:`clear`.

    :meth:`search` returns what ``knn_search(query, support, k, backend=backend)`` returns (a
    :class:`KNNIndex` searches exactly like ``knn_search``); ``"auto"`` is resolved per search by
    :func:`~shiftguard.neighbors.resolve_backend`. A query whose dtype differs from the support's (or
    that is not a 2-D tensor) is passed to ``knn_search`` as it is, uncached. An equal copy of a
    support is another support. The cache keeps alive the supports it prepared, their indexes, the
    latest query and its answers. Answers are shared between callers: do not modify them in place.
    A pickled (or deep-copied) cache is empty: what it holds is derived data, and a faiss index
    cannot be pickled.

    Examples:
        >>> cache = SearchCache()
        >>> support, query = torch.randn(50, 4), torch.randn(5, 4)
        >>> first = cache.search(query, support, k=3)
        >>> cache.search(query, support, k=3) is first          # one search for both callers
        True
        >>> torch.equal(first[1], knn_search(query, support, 3)[1])
        True
        >>> cache.index(support) is cache.index(support)      # one prepared support per back end
        True
    """

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        """Drop every index and answer."""
        # (id(support), resolved back end) -> (support, its _version when prepared, index)
        self._indexes: dict[tuple[int, str], tuple[torch.Tensor, int, KNNIndex]] = {}
        # the latest query and its _version; its answers by (id(support), support _version, k, back end)
        self._query: Optional[tuple[torch.Tensor, int]] = None
        self._answers: dict[tuple[int, int, int, str], _Answer] = {}

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.clear()

    def __repr__(self) -> str:
        return f"SearchCache(indexes={len(self._indexes)}, answers={len(self._answers)})"

    def index(self, support: torch.Tensor, backend: str = "torch", n_queries: Optional[int] = None) -> KNNIndex:
        """The :class:`KNNIndex` of ``support`` ``(Ns, D)`` for ``backend``, built on first use and
        kept; ``"auto"`` is resolved for searches of ``n_queries`` rows (default ``Ns``).

        Raises the errors of :class:`KNNIndex`, naming ``support`` or ``backend``.
        """
        support = check_tensor(support, "support", ndim=2, floating=True)
        n_s = support.shape[0]
        resolved = resolve_backend(backend, n_s, n_s if n_queries is None else n_queries, support.device)
        key = (id(support), resolved)
        entry = self._indexes.get(key)
        if entry is None or entry[0] is not support or entry[1] != support._version:
            entry = (support, support._version, KNNIndex(support, resolved))
            self._indexes[key] = entry
        return entry[2]

    def search(self, query: torch.Tensor, support: torch.Tensor, k: int, backend: str = "torch") -> _Answer:
        """``(squared distances (Nq, k), support rows (Nq, k))``: the ``k`` nearest rows of ``support``
        ``(Ns, D)`` for every row of ``query`` ``(Nq, D)``, as :func:`knn_search` gives them; each
        (query, support, ``k``, back end) is searched once while ``query`` is the latest query.

        Raises the errors of :func:`knn_search`, naming the argument.
        """
        if not (
            isinstance(query, torch.Tensor)
            and isinstance(support, torch.Tensor)
            and query.ndim == 2
            and support.ndim == 2
            and query.dtype == support.dtype
        ):
            return knn_search(query, support, k, backend=backend)
        resolved = resolve_backend(backend, support.shape[0], query.shape[0], query.device)
        if self._query is None or self._query[0] is not query or self._query[1] != query._version:
            self._query, self._answers = (query, query._version), {}
        key = (id(support), support._version, k, resolved)
        answer = self._answers.get(key)
        if answer is None:
            answer = self.index(support, resolved).search(query, k)
            self._answers[key] = answer
        return answer
