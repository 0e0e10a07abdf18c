"""Conformal prediction sets (shiftguard.conformal) and their metrics: agreement with MAPIE on the
same probabilities, the coverage guarantee on exchangeable data, the weighted variant under a
covariate shift, class-conditional coverage, and the metrics on cases worked by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from shiftguard.conformal import (
    SplitConformal,
    WeightedSplitConformal,
    conformal_quantile,
    likelihood_ratio_weights,
    score_matrix,
)
from shiftguard.metrics.conformal import class_coverage_gap, coverage, set_sizes, size_stratified_coverage

mapie = pytest.importorskip("mapie", reason="MAPIE is the conformal oracle of these tests (test extras)")


def _calibrated(n: int, classes: int = 5, seed: int = 0, scale: float = 2.0):
    """Probabilities of a perfectly calibrated model: labels drawn from the probabilities."""
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, classes, generator=g, dtype=torch.float64) * scale).softmax(1)
    y = torch.multinomial(p, 1, generator=g).squeeze(1)
    return p, y


def _identity_classifier(classes: int):
    from sklearn.base import BaseEstimator, ClassifierMixin

    class Identity(ClassifierMixin, BaseEstimator):
        """A prefit classifier whose inputs are its probabilities."""

        def fit(self, X, y):
            self.classes_ = np.arange(classes)
            return self

        def predict_proba(self, X):
            return np.asarray(X)

        def predict(self, X):
            return np.asarray(X).argmax(1)

    return Identity().fit(None, None)


def _mapie_sets(p_cal, y_cal, p_test, score: str, seed: int, include_last=None):
    from mapie.classification import SplitConformalClassifier

    m = SplitConformalClassifier(
        _identity_classifier(p_cal.shape[1]),
        confidence_level=0.9,
        conformity_score=score,
        prefit=True,
        random_state=seed,
    )
    m.conformalize(p_cal.numpy(), y_cal.numpy())
    params = {"include_last_label": include_last} if include_last is not None else None
    _, sets = m.predict_set(p_test.numpy(), conformity_score_params=params)
    return torch.as_tensor(sets[:, :, 0])


# --------------------------------------------------------------------------- agreement with MAPIE
def test_lac_sets_are_mapies():
    p, y = _calibrated(800)
    mine = SplitConformal("lac", 0.1).fit(p[:400], y[:400]).predict_sets(p[400:])
    assert torch.equal(mine, _mapie_sets(p[:400], y[:400], p[400:], "lac", seed=0))


@pytest.mark.parametrize("randomized, include_last", [(True, "randomized"), (False, True)])
def test_aps_sets_are_mapies_with_the_same_uniform_draws(randomized, include_last):
    p, y = _calibrated(800, classes=6, seed=1)
    seed = 7
    # MAPIE draws u from RandomState(seed) for the calibration scores and again for the test sets; its
    # score is (mass up to and including the label) - u * p, ours (mass above the label) + u * p.
    u_cal = 1.0 - torch.as_tensor(np.random.RandomState(seed).uniform(size=400))
    u_test = 1.0 - torch.as_tensor(np.random.RandomState(seed).uniform(size=400))
    conf = SplitConformal("aps", 0.1, randomized=randomized).fit(p[:400], y[:400], uniform=u_cal)
    mine = conf.predict_sets(p[400:], uniform=u_test if randomized else None)
    assert torch.equal(mine, _mapie_sets(p[:400], y[:400], p[400:], "aps", seed, include_last))


def test_raps_scores_and_threshold_are_mapies_and_lam_0_is_aps():
    from mapie.conformity_scores import RAPSConformityScore
    from mapie.utils import _compute_classification_quantile

    p, y = _calibrated(600, classes=6, seed=2)
    pc, yc = p[:300].numpy(), y[:300].numpy()
    k_reg, lam, seed = 2, 0.1, 5
    u = np.random.RandomState(seed).uniform(size=300)
    raps = RAPSConformityScore()
    cum, cutoff = raps.get_true_label_cumsum_proba(yc, pc, np.arange(6))
    reg = raps._regularize_conformity_score(
        np.array([k_reg]), lam, cum - u[:, None] * np.take_along_axis(pc, yc[:, None], 1), cutoff
    )
    q = float(_compute_classification_quantile(reg, np.array([0.1]))[0])
    conf = SplitConformal("raps", 0.1, k_reg=k_reg, lam=lam).fit(p[:300], y[:300], uniform=torch.as_tensor(1 - u))
    torch.testing.assert_close(conf.scores_, torch.as_tensor(reg[:, 0, 0]))
    assert conf.threshold_ == q
    u_test = torch.rand(300, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    a = SplitConformal("raps", 0.1, k_reg=k_reg, lam=0.0).fit(p[:300], y[:300], uniform=torch.as_tensor(1 - u))
    b = SplitConformal("aps", 0.1).fit(p[:300], y[:300], uniform=torch.as_tensor(1 - u))
    assert torch.equal(a.predict_sets(p[300:], uniform=u_test), b.predict_sets(p[300:], uniform=u_test))


def test_the_score_matrix_is_the_definition_written_out_per_label():
    p = torch.tensor([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3]], dtype=torch.float64)
    u = torch.tensor([0.25, 0.5], dtype=torch.float64)
    aps = score_matrix(p, "aps", u)
    # row 0 sorted 0.5 (label 0), 0.3 (label 2), 0.2 (label 1): mass above + u * p
    torch.testing.assert_close(aps[0], torch.tensor([0.125, 0.8 + 0.05, 0.5 + 0.075], dtype=torch.float64))
    raps = score_matrix(p, "raps", u, k_reg=1, lam=0.5)
    torch.testing.assert_close(raps[0] - aps[0], torch.tensor([0.0, 1.0, 0.5], dtype=torch.float64))
    torch.testing.assert_close(score_matrix(p, "lac", u), 1 - p)


# --------------------------------------------------------------------------- the guarantee
@pytest.mark.parametrize(
    "method, randomized", [("lac", True), ("aps", True), ("aps", False), ("raps", True), ("raps", False)]
)
def test_coverage_over_random_splits_lies_within_the_theorys_bounds(method, randomized):
    n_cal, n_test, alpha, trials = 200, 200, 0.1, 150
    covs = []
    for t in range(trials):
        p, y = _calibrated(n_cal + n_test, classes=5, seed=100 + t)
        kw = dict(k_reg=1, lam=0.05) if method == "raps" else {}
        conf = SplitConformal(method, alpha, randomized=randomized, seed=t, **kw).fit(p[:n_cal], y[:n_cal])
        covs.append(coverage(conf.predict_sets(p[n_cal:]), y[n_cal:]))
    mean, se = float(np.mean(covs)), float(np.std(covs) / math.sqrt(trials))
    assert mean >= 1 - alpha - 3 * se
    if randomized or method == "lac":  # exact up to 1 / (n + 1); the deterministic variants over-cover
        assert mean <= 1 - alpha + 1 / (n_cal + 1) + 3 * se


def test_class_conditional_conformal_covers_every_class():
    p, y = _calibrated(6000, classes=4, seed=4, scale=1.0)
    p = (p + torch.tensor([0.6, 0.0, 0.0, 0.0], dtype=torch.float64)) / 1.6  # a model biased towards class 0
    plain = SplitConformal("lac", 0.1).fit(p[:3000], y[:3000]).predict_sets(p[3000:])
    mondrian = SplitConformal("lac", 0.1, mondrian=True).fit(p[:3000], y[:3000]).predict_sets(p[3000:])
    per_plain = class_coverage_gap(plain, y[3000:], 0.1)["per_class"]
    per_mondrian = class_coverage_gap(mondrian, y[3000:], 0.1)["per_class"]
    assert min(per_plain) < 0.85  # marginal coverage hides an under-covered class
    assert min(per_mondrian) > 0.87


# --------------------------------------------------------------------------- covariate shift
def _shifted(n: int, mean: float, seed: int):
    """x ~ N(mean, 1); P(y = 1 | x) = 0.5 + 0.35 tanh(x), while the model says sigmoid(3x): it grows
    over-confident as x grows, where the shifted test inputs lie."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) + mean
    y = (torch.rand(n, generator=g, dtype=torch.float64) < 0.5 + 0.35 * torch.tanh(x)).long()
    p1 = torch.sigmoid(3 * x)
    return x, torch.stack([1 - p1, p1], 1), y


def test_weighted_conformal_restores_the_coverage_plain_split_conformal_loses_under_covariate_shift():
    alpha, mean = 0.1, 1.5
    covs_plain, covs_true, covs_est = [], [], []
    for t in range(20):
        xc, pc, yc = _shifted(1000, 0.0, seed=2 * t)
        xt, pt, yt = _shifted(1000, mean, seed=2 * t + 1)
        covs_plain.append(coverage(SplitConformal("lac", alpha).fit(pc, yc).predict_sets(pt), yt))
        weighted = WeightedSplitConformal("lac", alpha).fit(pc, yc)
        ratio = lambda x: torch.exp(mean * x - mean**2 / 2)  # N(mean, 1) / N(0, 1)
        covs_true.append(coverage(weighted.predict_sets(pt, cal_weights=ratio(xc), test_weights=ratio(xt)), yt))
        covs_est.append(coverage(weighted.predict_sets(pt, cal_features=xc[:, None], test_features=xt[:, None]), yt))
    assert np.mean(covs_plain) < 1 - alpha - 0.03  # 0.853 here
    assert np.mean(covs_true) >= 1 - alpha - 0.02  # 0.891 with the true ratio (its standard error: 0.005)
    assert np.mean(covs_est) >= 1 - alpha - 0.02  # 0.892 with the logistic estimate


def test_the_likelihood_ratio_estimate_follows_the_true_one():
    xc, _, _ = _shifted(4000, 0.0, seed=1)
    xt, _, _ = _shifted(4000, 1.0, seed=2)
    w_cal, w_test = likelihood_ratio_weights(xc[:, None], xt[:, None])
    true = torch.exp(1.0 * xc - 0.5)
    assert float(np.corrcoef(torch.log(w_cal).numpy(), torch.log(true).numpy())[0, 1]) > 0.99
    assert w_cal.shape == (4000,) and w_test.shape == (4000,) and bool((w_cal > 0).all())


def test_weighted_with_equal_weights_is_split_conformal_with_the_test_points_mass():
    p, y = _calibrated(500, seed=6)
    w = WeightedSplitConformal("lac", 0.1).fit(p[:300], y[:300])
    sets = w.predict_sets(p[300:], cal_weights=torch.ones(300), test_weights=torch.ones(200))
    assert torch.equal(sets, SplitConformal("lac", 0.1).fit(p[:300], y[:300]).predict_sets(p[300:]))
    dominated = w.predict_sets(p[300:], cal_weights=torch.ones(300), test_weights=torch.full((200,), 1e6))
    assert bool(torch.isinf(w.last_thresholds_).all()) and bool(dominated.all())  # every label


# --------------------------------------------------------------------------- edges and errors
def test_the_finite_sample_quantile_and_its_infinite_case():
    s = torch.arange(1.0, 10.0)  # n = 9
    assert conformal_quantile(s, 0.1) == 9.0  # ceil(10 * 0.9) = 9th smallest
    assert conformal_quantile(s, 0.2) == 8.0
    assert conformal_quantile(s, 0.05) == math.inf  # ceil(10 * 0.95) = 10 > 9: every label
    assert conformal_quantile(torch.empty(0), 0.5) == math.inf


def test_bad_arguments_are_errors_naming_them():
    p, y = _calibrated(50)
    with pytest.raises(ValueError, match="method: expected one of lac, aps, raps"):
        SplitConformal("thr")
    with pytest.raises(ValueError, match="alpha: expected a miscoverage level in"):
        SplitConformal("lac", 1.5)
    with pytest.raises(ValueError, match="k_reg, lam: RAPS's regularisation"):
        SplitConformal("aps", k_reg=2)
    with pytest.raises(ValueError, match="cal_probs: expected class probabilities"):
        SplitConformal().fit(p * 2, y)
    from shiftguard.heads import NotFittedError

    with pytest.raises(NotFittedError):
        SplitConformal().predict_sets(p)


# --------------------------------------------------------------------------- metrics
def test_set_metrics_on_a_case_worked_by_hand():
    sets = torch.tensor([[True, False, False], [True, True, False], [False, False, False], [True, True, True]])
    y = torch.tensor([0, 2, 1, 1])
    assert coverage(sets, y) == 0.5
    assert set_sizes(sets) == {"mean": 1.5, "median": 1.0, "empty": 0.25}
    strat = size_stratified_coverage(sets, y, 0.1, strata=((0, 1), (2, 3)))
    assert [s["n"] for s in strat["strata"]] == [2, 2] and [s["coverage"] for s in strat["strata"]] == [0.5, 0.5]
    assert strat["sscv"] == pytest.approx(0.4)
    gap = class_coverage_gap(sets, y, 0.1)
    assert gap["per_class"] == [1.0, 0.5, 0.0]
    assert gap["worst"] == pytest.approx(0.9) and gap["gap"] == pytest.approx((0.1 + 0.4 + 0.9) / 3)
