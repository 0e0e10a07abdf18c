"""AUROC of errors (vs scikit-learn), R-AUROC [Kirchhof, Alg. 1] and AURC (vs a loop reference)."""

import itertools

import pytest
import torch

from shiftguard.metrics import aurc, auroc_error, r_auroc


def test_auroc_error_equals_scikit_learn_including_ties():
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(0)
    u = torch.randint(0, 5, (300,), generator=g).double()
    e = torch.rand(300, generator=g) < 0.3
    assert auroc_error(u, e) == pytest.approx(roc_auc_score(e.numpy(), u.numpy()))


@pytest.mark.parametrize("seed, n, levels", [(1, 1000, None), (2, 57, 3), (3, 2, None), (4, 500, 2)])
def test_auroc_error_equals_scikit_learn_on_random_and_heavily_tied_scores(seed, n, levels):
    from sklearn.metrics import roc_auc_score

    g = torch.Generator().manual_seed(seed)
    if levels is None:
        u = torch.rand(n, generator=g, dtype=torch.float64)
    else:
        u = torch.randint(0, levels, (n,), generator=g).float()
    e = torch.rand(n, generator=g) < 0.4
    e[0], e[1] = True, False  # both outcomes
    assert auroc_error(u, e) == pytest.approx(roc_auc_score(e.numpy(), u.double().numpy()), abs=1e-12)


def test_auroc_error_is_the_probability_an_error_outranks_a_correct_prediction():
    u = torch.tensor([0.1, 0.4, 0.35, 0.8])
    e = torch.tensor([0, 0, 1, 1])
    pairs = [(ue > uc) + 0.5 * (ue == uc) for ue, uc in itertools.product(u[e == 1], u[e == 0])]
    assert auroc_error(u, e) == pytest.approx(float(sum(pairs)) / len(pairs))


def test_auroc_error_needs_both_outcomes():
    with pytest.raises(ValueError, match="is_error"):
        auroc_error(torch.rand(5), torch.zeros(5, dtype=torch.bool))


def test_r_auroc_scores_the_uncertainty_against_one_nn_misses():
    g = torch.Generator().manual_seed(1)
    y = torch.arange(200) % 4
    x = torch.randn(200, 3, generator=g, dtype=torch.float64) + 1.5 * torch.nn.functional.one_hot(y, 4)[:, :3]
    d = ((x[:, None] - x[None]) ** 2).sum(-1)
    d.fill_diagonal_(float("inf"))
    wrong = y[d.argmin(1)] != y
    u = torch.rand(200, generator=g, dtype=torch.float64)
    assert r_auroc(x, y, u, metric="euclidean") == pytest.approx(auroc_error(u, wrong))
    assert r_auroc(x, y, wrong.double() + 0.01 * u, metric="euclidean") == pytest.approx(1.0)


def reference_aurc(u, e, n_perm=2000, seed=0):
    """Average the risk-coverage area over random tie-breaking orders."""
    g = torch.Generator().manual_seed(seed)
    total = 0.0
    n = len(u)
    for _ in range(n_perm):
        jitter = torch.rand(n, generator=g, dtype=torch.float64) * 1e-9
        order = torch.argsort(u + jitter)
        es = e[order].double()
        total += float((torch.cumsum(es, 0) / torch.arange(1, n + 1)).mean())
    return total / n_perm


def test_aurc_without_ties_is_the_mean_prefix_risk():
    u = torch.tensor([0.9, 0.1, 0.5, 0.3])
    e = torch.tensor([1, 0, 1, 0])
    # accepted order: 0.1 (ok), 0.3 (ok), 0.5 (err), 0.9 (err): risks 0, 0, 1/3, 1/2
    assert aurc(u, e) == pytest.approx((0 + 0 + 1 / 3 + 1 / 2) / 4)


def test_aurc_with_ties_is_the_expectation_over_tie_breaking():
    u = torch.tensor([0.2, 0.2, 0.2, 0.5, 0.5, 0.1])
    e = torch.tensor([1, 0, 0, 1, 0, 0])
    assert aurc(u, e) == pytest.approx(reference_aurc(u.double(), e), abs=5e-3)


def test_aurc_of_a_perfect_ranking_is_the_optimum():
    e = torch.tensor([0] * 8 + [1] * 2)
    perfect = aurc(e.double(), e)
    assert perfect == pytest.approx(sum(max(0, i - 8) / i for i in range(1, 11)) / 10)
    assert aurc(-e.double(), e) > perfect
