"""One kNN search serves every head that would run the same one (NED, kNN, weighted kNN on the same
support with the same k): the results are those of each head searching on its own."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import shiftguard
from shiftguard.evaluation import grid as G
from shiftguard.heads import build_head


def _data(n=90):
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 3
    x = torch.randint(0, 256, (n, 1, 28, 28), generator=g, dtype=torch.uint8)
    return x, y


@pytest.mark.parametrize("backend", ["torch", "pruned"])
def test_grid_results_equal_each_head_searching_alone(monkeypatch, backend):
    x, y = _data()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 3))
    kw = dict(support=(x, y), corruptions=["fog", "shot_noise"], severities=[2], heads=["ned", "knn", "wknn", "1nn"],
              k=5, n_boot=10, knn_backend=backend)
    calls, built = [], []
    real, real_index = G._shared_neighbors, G.KNNIndex
    monkeypatch.setattr(G, "_shared_neighbors", lambda heads, emb, indexes=None: calls.append(1)
                        or real(heads, emb, indexes))
    monkeypatch.setattr(G, "KNNIndex", lambda support, backend: built.append(backend) or real_index(support, backend))
    shared = shiftguard.evaluate(net, (x, y), **kw)
    assert len(calls) == 3  # clean + two cells
    # one index of the one support, not one per cell: the group ned/knn/wknn (k = 5) and 1-NN (k = 1,
    # a group of one) search it
    assert built == [backend]
    monkeypatch.setattr(G, "_shared_neighbors", lambda heads, emb, indexes=None: {})
    alone = shiftguard.evaluate(net, (x, y), **kw)
    assert shared.rows == alone.rows
    assert shared.results["intervals"] == alone.results["intervals"]
    assert shared.results["config"]["knn_backend"] == shared.results["knn_backend"] == backend


def test_auto_takes_the_pruned_search_for_large_searches_only():
    assert G.grid_knn_backend("auto", 48_000, 10_000) == "pruned"
    assert G.grid_knn_backend("auto", 48_000, 1_000) == "pruned"
    assert G.grid_knn_backend("auto", 48_000, 500) == "torch"       # too few distances per cell
    assert G.grid_knn_backend("auto", 16_000, 100_000) == "torch"   # too small a support
    assert G.grid_knn_backend("auto", 0, 10_000) == "torch"
    assert G.grid_knn_backend("faiss", 10, 10) == "faiss"           # a named back end is kept
    with pytest.raises(ValueError, match="knn_backend"):
        G.grid_knn_backend("annoy", 10, 10)
    x, y = _data()
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 3))
    res = shiftguard.evaluate(net, (x, y), support=(x, y), corruptions=["fog"], severities=[2], heads=["knn"],
                              n_boot=10)
    assert res.results["config"]["knn_backend"] == "auto" and res.results["knn_backend"] == "torch"


def test_ned_with_its_own_pruned_index_shares_the_search():
    g = torch.Generator().manual_seed(2)
    support, labels = torch.randn(300, 6, generator=g), torch.arange(300) % 3
    query = torch.randn(40, 6, generator=g)
    ned = build_head("ned", 3, k=5, backend="pruned").fit(support, labels)
    knn = build_head("knn", 3, k=5, backend="pruned").fit(ned.support_embeddings_, labels)
    knn.support_embeddings_ = ned.support_embeddings_   # one support tensor, as the grid's heads have
    assert ned.knn_index_ is not None and ned.shares_search_with(knn) and knn.shares_search_with(ned)
    found = G._shared_neighbors([ned, knn], query, {})
    for h in (ned, knn):
        torch.testing.assert_close(h.probabilities_from_neighbors(*found[id(h)]), h.predict_proba(query),
                                   rtol=0, atol=0)


def test_build_head_sets_the_backend_of_the_knn_family_only():
    assert build_head("wknn", 3, backend="pruned").backend == "pruned"
    assert build_head("1nn", 3, backend="faiss").backend == "faiss"
    assert not hasattr(build_head("logistic", 3, backend="pruned"), "backend")
    with pytest.raises(ValueError, match="backend"):
        build_head("knn", 3, backend="annoy")
    with pytest.raises(ValueError, match="knn_backend"):
        shiftguard.evaluate(nn.Linear(4, 2), (torch.zeros(4, 1, 2, 2), torch.zeros(4).long()), knn_backend="annoy")


def test_only_heads_with_the_same_search_are_grouped():
    g = torch.Generator().manual_seed(1)
    support, labels = torch.randn(40, 4, generator=g), torch.arange(40) % 4
    query = torch.randn(7, 4, generator=g)
    heads = [build_head(h, 4, k=5) for h in ("ned", "knn", "wknn", "1nn")] + [build_head("knn", 4, k=3)]
    for h in heads:
        h.fit(support, labels)
    found = G._shared_neighbors(heads, query)
    assert set(found) == {id(h) for h in heads[:3]}  # 1-NN (k=1) and the k=3 kNN search on their own
    for h in heads[:3]:
        torch.testing.assert_close(h.probabilities_from_neighbors(*found[id(h)]), h.predict_proba(query),
                                   rtol=0, atol=0)
    other = build_head("knn", 4, k=5).fit(support.clone(), labels)  # an equal but distinct support tensor
    assert not heads[1].shares_search_with(other)
