"""Uncertainty scores (sign: higher = more uncertain) and the loss-prediction head [Kirchhof, Ch. 5]."""

import math

import pytest
import torch

from shiftguard.heads import NED
from shiftguard.metrics import auroc_error
from shiftguard.uncertainty import (
    LossPredictionHead,
    embedding_norm_uncertainty,
    entropy_uncertainty,
    kappa_uncertainty,
    knn_distance_uncertainty,
    loss_ranking_loss,
    margin_uncertainty,
    max_probability_uncertainty,
    ned_uncertainty,
)

CONFIDENT = torch.tensor([[0.98, 0.01, 0.01]], dtype=torch.float64)
UNSURE = torch.tensor([[0.4, 0.35, 0.25]], dtype=torch.float64)


@pytest.mark.parametrize("score", [max_probability_uncertainty, entropy_uncertainty, margin_uncertainty])
def test_probability_scores_are_higher_for_flatter_predictions(score):
    assert score(UNSURE) > score(CONFIDENT)


def test_probability_scores_match_their_formulas():
    p = torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(max_probability_uncertainty(p), torch.tensor([0.5, 0.0], dtype=torch.float64))
    ent = -(0.5 * math.log(0.5) + 0.3 * math.log(0.3) + 0.2 * math.log(0.2))
    torch.testing.assert_close(entropy_uncertainty(p), torch.tensor([ent, 0.0], dtype=torch.float64))
    torch.testing.assert_close(margin_uncertainty(p), torch.tensor([0.8, 0.0], dtype=torch.float64))


def test_knn_distance_is_the_mean_squared_distance_to_the_k_nearest():
    support = torch.tensor([[0.0, 0.0], [3.0, 0.0], [0.0, 4.0]])
    u = knn_distance_uncertainty(torch.tensor([[0.0, 0.0], [10.0, 10.0]]), support, k=2)
    torch.testing.assert_close(u, torch.tensor([(0 + 9) / 2, (49 + 100 + 100 + 36) / 2]))


def test_norm_and_kappa_scores_are_negated_concentrations():
    z = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    torch.testing.assert_close(embedding_norm_uncertainty(z), torch.tensor([-5.0, -0.5]))
    torch.testing.assert_close(kappa_uncertainty(torch.tensor([2.0, 7.0])), torch.tensor([-2.0, -7.0]))


def test_ned_uncertainty_detects_ned_errors_better_than_chance():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(1200) % 3
    x = torch.randn(1200, 4, generator=g, dtype=torch.float64) + 1.2 * torch.nn.functional.one_hot(y, 4)[:, :4].double()
    head = NED(k=10).fit(x[:800], y[:800])
    u = ned_uncertainty(head, x[800:])
    err = head.predict(x[800:]) != y[800:]
    assert auroc_error(u, err) > 0.6  # chance is 0.5 (measured 0.68 on these overlapping blobs)


def test_scores_reject_bad_input():
    with pytest.raises(ValueError, match="probs"):
        entropy_uncertainty(torch.tensor([[0.5, 0.6]]))
    with pytest.raises(ValueError, match="probs"):
        margin_uncertainty(torch.ones(3, 1))
    with pytest.raises(ValueError, match="embeddings"):
        embedding_norm_uncertainty(torch.ones(3))


def test_ranking_loss_follows_equations_3_and_4():
    u1, u2 = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.0, 0.45, 0.3])
    l1, l2 = torch.tensor([2.0, 2.0, 1.0]), torch.tensor([1.0, 1.0, 3.0])
    # pair 1: higher loss already 0.5 more uncertain -> 0; pair 2: gap 0.05 < m -> 0.05;
    # pair 3: x2 has the higher loss and is 0.3 more uncertain -> 0
    expected = torch.tensor([0.0, 0.05, 0.0]).mean()
    torch.testing.assert_close(loss_ranking_loss(u1, u2, l1, l2, margin=0.1), expected)


def test_loss_prediction_head_learns_to_rank_samples_by_their_loss():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1500, 16, generator=g)
    task_loss = x[:, 0].abs() + 0.1 * torch.randn(1500, generator=g)
    head = LossPredictionHead(16, hidden=(32, 32), epochs=25, batch_size=128, lr=3e-3).fit(x[:1000], task_loss[:1000])
    u = head.predict_uncertainty(x[1000:])
    hard = task_loss[1000:] > task_loss[1000:].median()
    assert auroc_error(u, hard) > 0.9  # |x_0| itself (the oracle) scores 0.99
    assert head.history_[-1] < head.history_[0]


def test_loss_prediction_head_trains_on_detached_cached_embeddings():
    x = torch.randn(64, 8, requires_grad=True)
    head = LossPredictionHead(8, hidden=(16,), epochs=1, batch_size=32).fit(x, x.detach()[:, 0] ** 2)
    assert x.grad is None
    assert head.predict_uncertainty(x).shape == (64,)


def test_loss_prediction_head_rejects_bad_input():
    head = LossPredictionHead(8, hidden=(16,), epochs=1)
    with pytest.raises(ValueError, match="embeddings"):
        head.fit(torch.randn(10, 7), torch.rand(10))
    with pytest.raises(ValueError, match="mismatched"):
        head.fit(torch.randn(10, 8), torch.rand(9))
    with pytest.raises(ValueError, match="task_loss"):
        head.fit(torch.randn(10, 8), torch.full((10,), float("nan")))


def test_loss_prediction_head_predict_is_a_deprecated_alias_of_predict_uncertainty():
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))
    head = LossPredictionHead(8, hidden=(16,), epochs=1, batch_size=32).fit(x, x[:, 0] ** 2)
    with pytest.warns(
        DeprecationWarning,
        match=r"^LossPredictionHead\.predict is deprecated .*; use LossPredictionHead\.predict_uncertainty$",
    ):
        old = head.predict(x)
    assert torch.equal(old, head.predict_uncertainty(x))
