"""One kNN search serves every head that would run the same one (NED, kNN, weighted kNN on the same
support with the same k): the results are those of each head searching on its own."""

from __future__ import annotations

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


def test_grid_results_equal_each_head_searching_alone(monkeypatch):
    x, y = _data()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 8), nn.ReLU(), nn.Linear(8, 3))
    kw = dict(support=(x, y), corruptions=["fog", "shot_noise"], severities=[2], heads=["ned", "knn", "wknn", "1nn"],
              k=5, n_boot=10)
    calls = []
    real = G._shared_neighbors
    monkeypatch.setattr(G, "_shared_neighbors", lambda heads, emb: calls.append(1) or real(heads, emb))
    shared = shiftguard.evaluate(net, (x, y), **kw)
    assert calls  # the shared search ran
    monkeypatch.setattr(G, "_shared_neighbors", lambda heads, emb: {})
    alone = shiftguard.evaluate(net, (x, y), **kw)
    assert shared.rows == alone.rows
    assert shared.results["intervals"] == alone.results["intervals"]


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
