"""One kNN search serves every head that would run the same one (NED, kNN, weighted kNN on the same
support with the same k, through a shared ``neighbors.SearchCache``): the results are those of each
head searching on its own. And ``backend="auto"`` has one meaning (``neighbors.resolve_backend``)."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.evaluation import grid as G
from shiftguard.heads import build_head
from shiftguard.neighbors import SearchCache, knn_search, resolve_backend
from shiftguard.neighbors import cache as C


def _data(n=90):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    x = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    return x, y


class _Alone(SearchCache):
    """A cache that shares nothing: every call is the caller's own ``knn_search``."""

    def search(self, query, support, k, backend="torch"):
        return knn_search(query, support, k, backend=backend)


@pytest.mark.parametrize("backend", ["torch", "pruned"])
def test_grid_results_equal_each_head_searching_alone(monkeypatch, backend):
    x, y = _data()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 3))
    kw = dict(
        support=(x, y),
        corruptions=["fog", "shot_noise"],
        severities=[2],
        heads=["ned", "knn", "wknn", "1nn"],
        k=5,
        n_boot=10,
        knn_backend=backend,
    )
    built, searched = [], []
    real_index = C.KNNIndex

    class CountingIndex(real_index):
        def __init__(self, support, backend="torch", n_queries=None):
            built.append(backend)
            super().__init__(support, backend, n_queries)

        def search(self, query, k, *args, **kwargs):
            searched.append(k)
            return super().search(query, k, *args, **kwargs)

    monkeypatch.setattr(C, "KNNIndex", CountingIndex)
    shared = shiftguard.evaluate(net, (x, y), **kw)
    # one index of the one support, not one per cell or per head; per cell (clean + two) one search
    # for the group ned/knn/wknn (k = 5) and one for 1-NN (k = 1)
    assert built == [backend]
    assert sorted(searched) == [1, 1, 1, 5, 5, 5]
    monkeypatch.setattr(G, "SearchCache", _Alone)
    alone = shiftguard.evaluate(net, (x, y), **kw)
    assert shared.rows == alone.rows
    assert shared.results["intervals"] == alone.results["intervals"]
    assert shared.results["config"]["knn_backend"] == shared.results["knn_backend"] == backend


def test_auto_takes_the_pruned_search_for_large_cpu_searches_only():
    assert resolve_backend("auto", 48_000, 10_000) == "pruned"
    assert resolve_backend("auto", 48_000, 1_000) == "pruned"
    assert resolve_backend("auto", 48_000, 500) == "torch"  # too few distances per search
    assert resolve_backend("auto", 16_000, 100_000) == "torch"  # too small a support
    assert resolve_backend("auto", 0, 10_000) == "torch"
    assert resolve_backend("auto", 48_000, 10_000, device="meta") == "torch"  # pruning is CPU-only
    assert resolve_backend("auto", 100_000, 100_000) == "pruned"  # never faiss unless named
    assert resolve_backend("faiss", 10, 10) == "faiss"  # a named back end is kept
    with pytest.raises(ValueError, match="knn_backend"):
        resolve_backend("annoy", 10, 10, argument="knn_backend")
    x, y = _data()
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 3))
    res = shiftguard.evaluate(
        net, (x, y), support=(x, y), corruptions=["fog"], severities=[2], heads=["knn"], n_boot=10
    )
    assert res.results["config"]["knn_backend"] == "auto" and res.results["knn_backend"] == "torch"


def test_auto_means_the_same_in_knn_search_and_knn_index(monkeypatch):
    monkeypatch.setattr("shiftguard.neighbors.search.PRUNED_MIN_SUPPORT", 50)
    monkeypatch.setattr("shiftguard.neighbors.search.PRUNED_MIN_PRODUCTS", 50 * 40)
    g = torch.Generator().manual_seed(3)
    support, query = torch.randn(60, 5, generator=g), torch.randn(40, 5, generator=g)
    assert C.KNNIndex(support, "auto", n_queries=40).backend == "pruned"
    assert C.KNNIndex(support, "auto", n_queries=30).backend == "torch"
    assert SearchCache().index(support, "auto", n_queries=40).backend == "pruned"
    for got in (knn_search(query, support, 4, backend="auto"), SearchCache().search(query, support, 4, "auto")):
        want = knn_search(query, support, 4, backend="pruned")
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_ned_with_its_own_pruned_index_searches_like_the_shared_one():
    g = torch.Generator().manual_seed(2)
    support, labels = torch.randn(300, 6, generator=g), torch.arange(300) % 3
    query = torch.randn(40, 6, generator=g)
    alone = build_head("ned", 3, k=5, backend="pruned").fit(support, labels)
    cache = SearchCache()
    ned = build_head("ned", 3, k=5, backend="pruned", searches=cache).fit(support, labels)
    knn = build_head("knn", 3, k=5, backend="pruned", searches=cache).fit(ned.support_embeddings_, labels)
    assert alone.knn_index_ is not None
    shared = ned.predict_proba(query)
    torch.testing.assert_close(shared, alone.predict_proba(query), rtol=0, atol=0)
    assert cache.search(query, support, 5, "pruned") is cache.search(query, support, 5, "pruned")
    torch.testing.assert_close(
        knn.predict_proba(query), build_head("knn", 3, k=5).fit(support, labels).predict_proba(query), rtol=0, atol=0
    )


def test_build_head_sets_the_backend_and_the_cache_of_the_knn_family_only():
    cache = SearchCache()
    assert build_head("wknn", 3, backend="pruned").backend == "pruned"
    assert build_head("1nn", 3, backend="faiss", searches=cache).searches is cache
    assert not hasattr(build_head("logistic", 3, backend="pruned", searches=cache), "searches")
    with pytest.raises(ValueError, match="backend"):
        build_head("knn", 3, backend="annoy")
    with pytest.raises(TypeError, match="searches"):
        build_head("knn", 3, searches={})
    with pytest.raises(ValueError, match="knn_backend"):
        shiftguard.evaluate(nn.Linear(4, 2), (torch.zeros(4, 1, 2, 2), torch.zeros(4).long()), knn_backend="annoy")


def test_only_heads_with_the_same_search_share_an_answer(monkeypatch):
    g = torch.Generator().manual_seed(1)
    support, labels = torch.randn(40, 4, generator=g), torch.arange(40) % 4
    query = torch.randn(7, 4, generator=g)
    cache = SearchCache()
    heads = [build_head(h, 4, k=5, searches=cache) for h in ("ned", "knn", "wknn", "1nn")]
    heads.append(build_head("knn", 4, k=3, searches=cache))
    for h in heads:
        h.fit(support, labels)
    for h in heads[1:]:  # one support tensor, as the grid's heads have
        h.support_embeddings_ = heads[0].support_embeddings_
    other = build_head("knn", 4, k=5, searches=cache).fit(support.clone(), labels)  # equal, not the same
    searched = []
    real = C.KNNIndex.search
    monkeypatch.setattr(C.KNNIndex, "search", lambda self, q, k, *a, **kw: searched.append(k) or real(self, q, k))
    for h in heads + [other]:
        got = h.predict_proba(query)
        h.searches = None
        torch.testing.assert_close(got, h.predict_proba(query), rtol=0, atol=0)
        h.searches = cache
    # ned / knn / wknn (k = 5) share one search; 1-NN (k = 1), the k = 3 kNN and the equal copy of
    # the support search on their own
    assert sorted(searched) == [1, 3, 5, 5]


def test_a_new_or_modified_query_is_searched_again_and_the_index_is_kept(monkeypatch):
    g = torch.Generator().manual_seed(4)
    support, q1, q2 = torch.randn(30, 3, generator=g), torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    cache = SearchCache()
    a1 = cache.search(q1, support, 2)
    index = cache.index(support)
    a2 = cache.search(q2, support, 2)
    assert cache.search(q1, support, 2) is not a1  # q2 came in between: q1's answer was dropped
    assert cache.index(support) is index  # the prepared support stays
    assert torch.equal(a2[1], knn_search(q2, support, 2)[1])
    before = cache.search(q2, support, 2)
    q2.mul_(-1)  # modified in place: searched again
    after = cache.search(q2, support, 2)
    assert after is not before and torch.equal(after[1], knn_search(q2, support, 2)[1])
    support.add_(1.0)  # a modified support is prepared again
    assert cache.index(support) is not index
    assert torch.equal(cache.search(q2, support, 2)[1], knn_search(q2, support, 2)[1])


def test_a_query_of_another_dtype_is_searched_as_knn_search_does_and_not_cached():
    g = torch.Generator().manual_seed(5)
    support, query = torch.randn(30, 3, generator=g), torch.randn(4, 3, generator=g, dtype=torch.float64)
    cache = SearchCache()
    got = cache.search(query, support, 3)
    want = knn_search(query, support, 3)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]) and got[0].dtype == torch.float64
    assert cache.search(query, support, 3) is not got
    with pytest.raises(ValueError, match="query"):
        cache.search(torch.randn(4, 2), support, 3)


def test_a_pickled_or_copied_cache_is_empty_and_heads_sharing_one_still_share_it():
    g = torch.Generator().manual_seed(6)
    support, labels = torch.randn(30, 3, generator=g), torch.arange(30) % 3
    cache = SearchCache()
    heads = [build_head(h, 3, k=3, searches=cache).fit(support, labels) for h in ("knn", "wknn")]
    heads[0].predict_proba(support[:4])
    assert "indexes=1" in repr(cache)
    back = pickle.loads(pickle.dumps(heads))
    assert back[0].searches is back[1].searches and "indexes=0, answers=0" in repr(back[0].searches)
    assert "indexes=0" in repr(copy.deepcopy(cache))
    torch.testing.assert_close(back[1].predict_proba(support[:4]), heads[1].predict_proba(support[:4]), rtol=0, atol=0)
