"""Hierarchy-informed metrics [Kim, Art. IV, "Performance measures"] against hand-computed values on a
small tree: root -> A -> {0, 1}, root -> B -> {2, 3} (d_H = 2 within a group, 4 across)."""

from __future__ import annotations

import math

import pytest
import torch

from shiftguard.data import ClassHierarchy
from shiftguard.metrics import (
    average_hierarchical_distance,
    class_prototypes,
    hierarchical_precision_at_k,
    hierarchical_similarity_at_k,
    hierarchy_metrics,
    mean_rank_correlation,
    representative_correlation,
)

D64 = torch.float64


def tree() -> ClassHierarchy:
    return ClassHierarchy.from_nested({"A": ["0", "1"], "B": ["2", "3"]}, classes=["0", "1", "2", "3"])


# labels 0, 2, 3; top-3 orders [1, 2, 0] (0 before 3 on a tie), [2, 3, 0], [0, 1, 2]
SCORES = torch.tensor([[0.1, 0.5, 0.3, 0.1], [0.0, 0.0, 0.9, 0.1], [0.7, 0.2, 0.05, 0.05]], dtype=D64)
LABELS = torch.tensor([0, 2, 3])


def test_ahd_averages_the_hierarchical_distance_of_the_top_k_over_all_samples():
    assert average_hierarchical_distance(SCORES, LABELS, tree(), k=1) == pytest.approx((2 + 0 + 4) / 3)
    assert average_hierarchical_distance(SCORES, LABELS, tree(), k=2) == pytest.approx((3 + 1 + 4) / 3)
    # ties resolve towards the lower class index: sample 0's third class is 0 (d = 0), not 3 (d = 4)
    assert average_hierarchical_distance(SCORES, LABELS, tree(), k=3) == pytest.approx((6 / 3 + 6 / 3 + 10 / 3) / 3)


def test_hp_at_k_counts_top_k_classes_inside_the_smallest_ball_with_k_classes():
    # hCorrectSet(c, 2) = {c, sibling}: 1/2, 2/2, 0/2
    assert hierarchical_precision_at_k(SCORES, LABELS, tree(), k=2) == pytest.approx(0.5)
    # hCorrectSet(c, 1) = {c}: top-1 accuracy
    assert hierarchical_precision_at_k(SCORES, LABELS, tree(), k=1) == pytest.approx(1 / 3)
    # hCorrectSet(c, 3) = every class
    assert hierarchical_precision_at_k(SCORES, LABELS, tree(), k=3) == 1.0


def test_metrics_accept_a_distance_matrix_in_place_of_the_hierarchy():
    d = tree().distance_matrix() / 2
    assert average_hierarchical_distance(SCORES, LABELS, d, k=2) == pytest.approx((3 + 1 + 4) / 6)
    out = hierarchy_metrics(SCORES, LABELS, tree(), ks=(1, 2), hp_ks=(2,))
    assert out == pytest.approx({"top1": 1 / 3, "top2": 1 / 3, "ahd@1": 2.0, "ahd@2": 8 / 3, "hp@2": 0.5})


def _unit(deg):
    return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]


def test_hs_at_k_and_ahs_match_the_hand_computed_retrieval():
    # points at 0, 10, 25, 180 degrees with labels 0, 1, 0, 2; s_H = 1 (same), 5/9 (d_H 2), 9/25 (d_H 4)
    norms = torch.tensor([[1.0], [3.0], [0.5], [2.0]], dtype=D64)  # ranking uses normalised embeddings
    emb = torch.tensor([_unit(0), _unit(10), _unit(25), _unit(180)], dtype=D64) * norms
    y = torch.tensor([0, 1, 0, 2])
    out = hierarchical_similarity_at_k(emb, y, tree(), ks=(1, 2), ahs_k=2)
    # HS@1 per query: 5/9, 1, 5/9, 1; HS@2: all 1; AHS@2 = (HS@1 + HS@2) / 4 per query
    assert out["hs@1"] == pytest.approx(7 / 9)
    assert out["hs@2"] == pytest.approx(1.0)
    assert out["ahs@2"] == pytest.approx(4 / 9)


def test_hs_at_k_with_a_separate_reference_set_keeps_every_reference():
    q = torch.tensor([_unit(0)], dtype=D64)
    ref = torch.tensor([_unit(5), _unit(90), _unit(100)], dtype=D64)
    out = hierarchical_similarity_at_k(
        q, torch.tensor([0]), tree(), ks=(1, 2), ahs_k=None, reference=ref, reference_labels=torch.tensor([3, 0, 1])
    )
    # ranking: label 3 (9/25), label 0 (1), label 1 (5/9); best: 1, 5/9
    assert out["hs@1"] == pytest.approx(9 / 25)
    assert out["hs@2"] == pytest.approx((9 / 25 + 1) / (1 + 5 / 9))


def test_hs_at_k_refuses_cut_offs_beyond_the_references():
    with pytest.raises(ValueError, match="ks"):
        hierarchical_similarity_at_k(torch.randn(4, 2), torch.tensor([0, 1, 2, 3]), tree(), ks=(4,), ahs_k=None)


def test_mean_correlation_is_the_fisher_mean_of_per_row_spearman_coefficients():
    scipy_stats = pytest.importorskip("scipy.stats")
    d_h = tree().distance_matrix()
    g = torch.Generator().manual_seed(3)
    learned = torch.rand(4, 4, generator=g, dtype=D64)
    rows = []
    for c in range(4):
        keep = [j for j in range(4) if j != c]
        rows.append(scipy_stats.spearmanr(learned[c, keep].numpy(), d_h[c, keep].numpy()).statistic)
    expected = math.tanh(sum(math.atanh(r) for r in rows) / 4)
    assert mean_rank_correlation(learned, d_h) == pytest.approx(expected)
    # a learned geometry that reverses every row's order: -1; the hierarchy itself: +1
    assert mean_rank_correlation(-d_h, d_h) == -1.0
    assert mean_rank_correlation(d_h, d_h) == 1.0


def test_mean_correlation_of_hand_computed_rows():
    # every row off the diagonal: reference [2, 4, 4] (ranks 1, 2.5, 2.5), learned [3, 1, 2] (ranks 3, 1, 2):
    # centred ranks (-1, .5, .5) and (1, -1, 0) give rho = -1.5 / sqrt(1.5 * 2) = -sqrt(3)/2 per row,
    # and the Fisher mean of equal coefficients is that coefficient
    ref = torch.zeros(4, 4, dtype=D64)
    lrn = torch.zeros(4, 4, dtype=D64)
    for c in range(4):
        off = [j for j in range(4) if j != c]
        ref[c, off] = torch.tensor([2.0, 4.0, 4.0], dtype=D64)
        lrn[c, off] = torch.tensor([3.0, 1.0, 2.0], dtype=D64)
    assert mean_rank_correlation(lrn, ref) == pytest.approx(-math.sqrt(3) / 2)


def test_constant_hierarchy_rows_raise_unless_skipped():
    flat_one = ClassHierarchy.from_nested({"A": ["0", "1"], "2": None}, classes=["0", "1", "2"])
    w = torch.tensor([_unit(0), _unit(30), _unit(170)], dtype=D64)
    with pytest.raises(ValueError, match="reference: rows \\[2\\]"):
        representative_correlation(w, flat_one)
    # rows 0 and 1: [d(0,1)=2, d(0,2)=3] vs chord [small, large] -> +1 each
    assert representative_correlation(w, flat_one, skip_constant_reference=True) == 1.0


def test_prototypes_are_normalised_means_of_normalised_embeddings():
    emb = torch.tensor([[2.0, 0.0], [0.0, 5.0], [0.0, -1.0], [0.0, -3.0]], dtype=D64)
    p = class_prototypes(emb, torch.tensor([0, 0, 1, 1]), 2)
    assert torch.allclose(p, torch.tensor([[1 / math.sqrt(2), 1 / math.sqrt(2)], [0.0, -1.0]], dtype=D64))
    with pytest.raises(ValueError, match="labels"):
        class_prototypes(emb, torch.tensor([0, 0, 0, 0]), 2)


def test_bad_inputs_name_the_argument():
    with pytest.raises(ValueError, match="scores"):
        average_hierarchical_distance(SCORES[:, :3], LABELS.clamp(max=2), tree())
    with pytest.raises(ValueError, match="labels"):
        average_hierarchical_distance(SCORES, torch.tensor([0, 1]), tree())
    with pytest.raises(ValueError, match="k"):
        hierarchical_precision_at_k(SCORES, LABELS, tree(), k=5)
    with pytest.raises(ValueError, match="hierarchy"):
        average_hierarchical_distance(SCORES, LABELS, torch.ones(4, 3))
    bad = SCORES.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="scores"):
        average_hierarchical_distance(bad, LABELS, tree())
