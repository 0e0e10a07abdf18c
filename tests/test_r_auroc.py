"""R-AUROC's neighbour metric: cosine by default (the URL benchmark's Recall@1), Euclidean on request."""

import pytest
import torch

from shiftguard.metrics import auroc_error, r_auroc


def _scaled_problem():
    # Two directions per class; the norms differ wildly, so the Euclidean 1-NN of a long vector is a
    # long vector of any direction while the cosine 1-NN is the vector of the closest direction.
    g = torch.Generator().manual_seed(0)
    y = torch.arange(120) % 3
    angle = y.double() * 2.1 + 0.9 * torch.randn(120, generator=g, dtype=torch.float64)
    radius = torch.exp(2.0 * torch.randn(120, generator=g, dtype=torch.float64))
    x = torch.stack([angle.cos(), angle.sin()], 1) * radius[:, None]
    u = torch.rand(120, generator=g, dtype=torch.float64)
    return x, y, u


def _misses(x, y):
    d = ((x[:, None] - x[None]) ** 2).sum(-1)
    d.fill_diagonal_(float("inf"))
    return y[d.argmin(1)] != y


def test_r_auroc_finds_the_nearest_neighbour_by_cosine_by_default():
    x, y, u = _scaled_problem()
    xn = x / x.norm(dim=1, keepdim=True)
    cos = xn @ xn.t()
    cos.fill_diagonal_(-float("inf"))
    wrong = y[cos.argmax(1)] != y
    assert r_auroc(x, y, u) == pytest.approx(auroc_error(u, wrong), abs=1e-12)
    assert r_auroc(x, y, u, metric="cosine") == r_auroc(x, y, u)


def test_r_auroc_euclidean_option_uses_raw_distances():
    x, y, u = _scaled_problem()
    wrong = _misses(x, y)
    assert r_auroc(x, y, u, metric="euclidean") == pytest.approx(auroc_error(u, wrong), abs=1e-12)
    # On this problem the two neighbour rules disagree, so the default is not the Euclidean value.
    assert r_auroc(x, y, u) != pytest.approx(r_auroc(x, y, u, metric="euclidean"), abs=1e-6)


def test_r_auroc_cosine_is_invariant_to_row_scaling():
    x, y, u = _scaled_problem()
    scale = torch.linspace(0.01, 100.0, x.shape[0], dtype=torch.float64)[:, None]
    assert r_auroc(x * scale, y, u) == r_auroc(x, y, u)


def test_r_auroc_rejects_an_unknown_metric():
    x, y, u = _scaled_problem()
    with pytest.raises(ValueError, match="metric"):
        r_auroc(x, y, u, metric="manhattan")
