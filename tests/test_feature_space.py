"""Embedding-change ratios of [Kim, Art. II, App. C.1-C.2]: norm ratio, alpha*, con-alpha, div-alpha
and con-div, against hand-computed values and a literal loop over the definitions."""

from __future__ import annotations

import math

import pytest
import torch

from shiftguard.metrics import embedding_change_ratios, norm_ratio, procrustes_scale

D64 = torch.float64


def test_norm_ratio_and_scale_of_a_hand_computed_pair():
    x0 = torch.tensor([[1.0, 0.0], [-1.0, 0.0]], dtype=D64)
    x1 = torch.tensor([[2.0, 1.0], [-2.0, -1.0]], dtype=D64) + 7.0  # a translation is centred away
    assert procrustes_scale(x0, x1) == pytest.approx(2.0)
    # X_new - 2 X_origin = [[0, 1], [0, -1]] (norm sqrt 2); X_new - X_origin = [[1, 1], [-1, -1]] (norm 2)
    assert norm_ratio(x0, x1) == pytest.approx(math.sqrt(2) / 2)


def test_a_pure_rescaling_gives_phi_zero_and_unit_alpha_ratios():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(30, 4, generator=g, dtype=D64)
    y = torch.arange(30) % 3
    out = embedding_change_ratios(x0, 2.5 * x0 - 1.0, y)
    assert out["alpha"] == pytest.approx(2.5)
    assert out["norm_ratio"] == pytest.approx(0.0, abs=1e-12)
    for k in ("con_alpha", "div_alpha", "con_div"):
        assert out[k] == pytest.approx(1.0)


def test_psi_ratios_follow_the_literal_definition_with_support_and_queries():
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(24, 3, generator=g, dtype=D64)
    x1 = x0 + 0.3 * torch.randn(24, 3, generator=g, dtype=D64)
    y = torch.arange(24) % 4
    support = torch.arange(24) < 12
    out = embedding_change_ratios(x0, x1, y, support=support)

    # literal: prototypes of each checkpoint from its own support embeddings; psi over query-prototype pairs
    def protos(x):
        return {c: x[support & (y == c)].mean(0) for c in range(4)}

    p0, p1 = protos(x0), protos(x1)
    con, div = [], []
    for j in range(24):
        if support[j]:
            continue
        for c in range(4):
            psi = float((x1[j] - p1[c]).norm() / (x0[j] - p0[c]).norm())
            (con if c == int(y[j]) else div).append(math.log(psi))
    psi_con, psi_div = math.exp(sum(con) / len(con)), math.exp(sum(div) / len(div))
    a0, a1 = x0 - x0.mean(0), x1 - x1.mean(0)
    alpha = float((a0 * a1).sum() / (a0 * a0).sum())
    assert out["alpha"] == pytest.approx(alpha)
    assert out["norm_ratio"] == pytest.approx(float((a1 - alpha * a0).norm() / (a1 - a0).norm()))
    assert out["psi_con"] == pytest.approx(psi_con)
    assert out["psi_div"] == pytest.approx(psi_div)
    assert out["con_alpha"] == pytest.approx(psi_con / alpha)
    assert out["div_alpha"] == pytest.approx(psi_div / alpha)
    assert out["con_div"] == pytest.approx(psi_con / psi_div)


def test_converging_classes_give_con_div_below_one():
    centres = torch.tensor([[0.0, 0.0], [4.0, 0.0], [0.0, 4.0]], dtype=D64)
    g = torch.Generator().manual_seed(2)
    y = torch.arange(60) % 3
    noise = torch.randn(60, 2, generator=g, dtype=D64)
    out = embedding_change_ratios(centres[y] + noise, centres[y] + 0.3 * noise, y)
    assert out["con_div"] < 1 and out["con_alpha"] < 1


def test_degenerate_inputs_raise_naming_the_argument():
    x = torch.randn(6, 2, dtype=D64)
    with pytest.raises(ValueError, match="x_origin"):
        procrustes_scale(torch.ones(6, 2, dtype=D64), x)
    with pytest.raises(ValueError, match="x_new"):
        norm_ratio(x, x.clone())
    with pytest.raises(ValueError, match="x_new"):
        norm_ratio(x, x[:5])
    with pytest.raises(ValueError, match="labels"):
        embedding_change_ratios(x, 2 * x, torch.zeros(6, dtype=torch.long))
    with pytest.raises(ValueError, match="support"):
        embedding_change_ratios(x, 2 * x, torch.tensor([0, 1, 0, 1, 0, 1]), support=torch.ones(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="labels"):
        embedding_change_ratios(
            x, 2 * x, torch.tensor([0, 1, 0, 1, 2, 2]), support=torch.tensor([True, True, False, False, False, False])
        )
