"""Confidence heads: formulas against slow references, fitted parameters, interface, bad input."""

import math

import pytest
import torch

from shiftguard.heads import (
    HEAD_NAMES,
    NED,
    DistanceRatioHead,
    KNNVote,
    LogisticRegressionHead,
    NotFittedError,
    OneNN,
    TemperatureScaling,
    WeightedKNN,
    build_head,
)
from shiftguard.metrics import ece


def blobs(n=400, d=8, c=4, spread=1.5, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(c, d, generator=g, dtype=dtype) * 2.0
    y = torch.arange(n) % c
    x = centres[y] + spread * torch.randn(n, d, generator=g, dtype=dtype)
    return x, y


def reference_knn_probs(query, support, labels, k, weight_fn, c):
    """Per-query Python loop: weights of the sorted k nearest neighbours, summed per class."""
    out = torch.zeros(len(query), c, dtype=torch.float64)
    for qi, q in enumerate(query):
        d = ((support - q) ** 2).sum(1)
        order = torch.argsort(d, stable=True)[:k]
        w = weight_fn(d[order])
        for wi, j in zip(w, order):
            out[qi, labels[j]] += wi
        out[qi] /= w.sum()
    return out


def test_ned_matches_equation_3_reference():
    x, y = blobs()
    q, _ = blobs(n=30, seed=5)
    head = NED(k=7).fit(x, y)
    t = head.temperature_
    ref = reference_knn_probs(q, x, y, 7, lambda d: torch.exp(-d / t), 4)
    torch.testing.assert_close(head.predict_proba(q), ref)


def test_ned_loo_temperature_minimises_the_leave_one_out_nll():
    x, y = blobs()
    head = NED(k=10).fit(x, y)

    def loo_nll(temp):
        total = 0.0
        for i in range(len(x)):
            d = ((x - x[i]) ** 2).sum(1)
            d[i] = float("inf")
            order = torch.argsort(d)[:10]
            w = torch.exp(-(d[order] - d[order].min()) / temp)
            p = w[y[order] == y[i]].sum() / w.sum()
            if p > 0:
                total -= math.log(p)
        return total

    best = loo_nll(head.temperature_)
    assert best <= loo_nll(head.temperature_ * 1.1) and best <= loo_nll(head.temperature_ / 1.1)


def test_ned_is_stable_for_huge_distances():
    x, y = blobs()
    head = NED(k=5).fit(x * 1e4, y)
    p = head.predict_proba(x[:20] * 1e4 + 3e4)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(1), torch.ones(20, dtype=p.dtype))


def test_ned_holdout_mode_fits_on_a_split_or_on_given_validation_data():
    x, y = blobs(n=800)
    x, y, xv, yv = x[:600], y[:600], x[600:], y[600:]
    split = NED(k=10, fit_mode="holdout", holdout_fraction=0.3).fit(x, y)
    val = NED(k=10, fit_mode="holdout").fit(x, y, xv, yv)
    loo = NED(k=10).fit(x, y)
    for h in (split, val):
        assert 0.3 < h.temperature_ / loo.temperature_ < 3.0
    assert torch.equal(val.support_embeddings_, x)


def test_ned_is_better_calibrated_than_vote_and_one_nn_on_overlapping_blobs():
    x, y = blobs(n=2000, spread=2.0)
    q, yq = x[1000:], y[1000:]
    x, y = x[:1000], y[:1000]
    eces = {type(h).__name__: ece(h.fit(x, y).predict_proba(q), yq) for h in (NED(k=20), KNNVote(k=20), OneNN())}
    assert eces["NED"] < eces["KNNVote"] and eces["NED"] < eces["OneNN"]


def test_knn_vote_is_the_vote_share_of_equation_4():
    x, y = blobs()
    q, _ = blobs(n=25, seed=2)
    ref = reference_knn_probs(q, x, y, 6, lambda d: torch.ones_like(d), 4)
    torch.testing.assert_close(KNNVote(k=6).fit(x, y).predict_proba(q), ref)


def test_one_nn_gives_probability_one_to_the_nearest_label():
    x, y = blobs()
    p = OneNN().fit(x, y).predict_proba(x[:50])
    assert torch.equal(p.argmax(1), y[:50]) and torch.all(p.max(1).values == 1)


def dudani(d):
    e = d.sqrt()
    return torch.ones_like(e) if e[-1] == e[0] else (e[-1] - e) / (e[-1] - e[0])


def gou(d):
    e = d.sqrt()
    if e[-1] == e[0]:
        return torch.ones_like(e)
    return (e[-1] - e) / (e[-1] - e[0]) * (e[-1] + e[0]) / (e[-1] + e)


@pytest.mark.parametrize("kind, fn", [("dudani", dudani), ("gou", gou)])
def test_weighted_knn_uses_the_dudani_and_gou_weights(kind, fn):
    x, y = blobs()
    q, _ = blobs(n=25, seed=2)
    ref = reference_knn_probs(q, x, y, 8, fn, 4)
    torch.testing.assert_close(WeightedKNN(k=8, kind=kind).fit(x, y).predict_proba(q), ref)


def test_weighted_knn_with_equal_distances_falls_back_to_the_vote():
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    p = WeightedKNN(k=3).fit(x, torch.tensor([0, 1, 1])).predict_proba(torch.zeros(1, 2))
    torch.testing.assert_close(p, torch.tensor([[1 / 3, 2 / 3]]))


def test_temperature_scaling_recovers_the_temperature_that_generated_the_labels():
    g = torch.Generator().manual_seed(0)
    logits = 3.0 * torch.randn(20000, 5, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits / 2.5, 1), 1, generator=g).squeeze(1)
    ts = TemperatureScaling().fit(logits, labels)
    assert abs(ts.temperature_ - 2.5) < 0.1
    torch.testing.assert_close(ts.predict_proba(logits[:3]), torch.softmax(logits[:3] / ts.temperature_, 1))


def test_temperature_scaling_wraps_a_logit_model_and_fits_on_validation_data():
    x, y = blobs(n=800)
    lr = LogisticRegressionHead().fit(x[:400], y[:400])
    ts = TemperatureScaling(logit_fn=lr.decision_function).fit(x[:400], y[:400], x[400:], y[400:])
    direct = TemperatureScaling().fit(lr.decision_function(x[400:]), y[400:])
    assert ts.temperature_ == pytest.approx(direct.temperature_, rel=1e-6)


def test_logistic_regression_head_agrees_with_scikit_learn():
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    x, y = blobs(n=600, d=10, spread=2.5)
    head = LogisticRegressionHead(C=0.5, tol=1e-9).fit(x, y)
    xs = StandardScaler().fit_transform(x.numpy())
    sk = LogisticRegression(C=0.5, tol=1e-10, max_iter=5000).fit(xs, y.numpy())
    ours = head.predict_proba(x)
    theirs = torch.from_numpy(sk.predict_proba(xs))
    assert (ours - theirs).abs().max() < 1e-4


def test_lbfgs_runs_blas_on_one_thread_and_restores_the_setting_after():
    from threadpoolctl import threadpool_info, threadpool_limits

    from shiftguard.heads._optim import minimize_lbfgs

    def blas_threads():
        return sorted({lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"})

    if not blas_threads():
        pytest.skip("numpy and SciPy report no BLAS library to threadpoolctl")
    seen = []

    def loss(p):
        seen.append(blas_threads())
        return ((p - 3.0) ** 2).sum()

    with threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        theta, value, _ = minimize_lbfgs(loss, torch.zeros(4, dtype=torch.float64))
        after = blas_threads()
    assert seen and all(s == [1] for s in seen)
    assert after == before  # [2] where BLAS runs two threads (else the restore is not observable here)
    assert torch.allclose(theta, torch.full((4,), 3.0, dtype=torch.float64)) and value < 1e-12


def test_lbfgs_also_limits_a_blas_library_loaded_after_its_first_call():
    # faiss-cpu brings its own OpenBLAS; loaded after the optimiser's first call, it must run on one
    # thread too (the optimiser's controller of the BLAS libraries is built again after an import)
    from threadpoolctl import threadpool_info, threadpool_limits

    from shiftguard.heads._optim import minimize_lbfgs

    minimize_lbfgs(lambda p: ((p - 3.0) ** 2).sum(), torch.zeros(4, dtype=torch.float64))
    pytest.importorskip("faiss")
    seen = []

    def loss(p):
        seen.append(sorted({lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"}))
        return ((p - 3.0) ** 2).sum()

    with threadpool_limits(limits=2, user_api="blas"):
        minimize_lbfgs(loss, torch.zeros(4, dtype=torch.float64))
    assert seen and all(s == [1] for s in seen)


def test_distance_ratio_head_matches_paper_ii_equation_5():
    x, y = blobs()
    head = DistanceRatioHead().fit(x, y)
    q, _ = blobs(n=10, seed=4)
    d = torch.cdist(q, head.representatives_)
    ref = d ** (-head.rho_) / (d ** (-head.rho_)).sum(1, keepdim=True)
    torch.testing.assert_close(head.predict_proba(q), ref)


def test_distance_ratio_head_prototypes_are_class_means_and_rho_starts_at_e_squared():
    x, y = blobs()
    head = DistanceRatioHead(max_iter=1)
    assert head.init_log_rho == 2.0
    head.fit(x, y)
    torch.testing.assert_close(head.representatives_[2], x[y == 2].mean(0))


def test_distance_ratio_gives_probability_one_at_distance_zero():
    x, y = blobs()
    for dtype in (torch.float32, torch.float64):
        head = DistanceRatioHead().fit(x.to(dtype), y)
        p = head.predict_proba(head.representatives_)
        assert torch.isfinite(p).all()
        torch.testing.assert_close(p, torch.eye(4, dtype=dtype))


def test_distance_ratio_fit_reduces_the_nll_from_the_initial_rho():
    x, y = blobs(spread=3.0)
    from shiftguard.heads.distance_ratio import distance_ratio_log_probs

    head = DistanceRatioHead().fit(x, y)
    before = -distance_ratio_log_probs(x, head.representatives_, math.exp(2.0))[torch.arange(len(y)), y].mean()
    after = -head.predict_log_proba(x)[torch.arange(len(y)), y].mean()
    assert after < before


def test_distance_ratio_head_accepts_given_proxies():
    x, y = blobs()
    proxies = torch.randn(4, 8, dtype=torch.float64)
    head = DistanceRatioHead(proxies=proxies).fit(x, y)
    torch.testing.assert_close(head.representatives_, proxies)


ALL_HEADS = [
    lambda: NED(k=5),
    lambda: OneNN(),
    lambda: KNNVote(k=5),
    lambda: WeightedKNN(k=5, kind="gou"),
    lambda: LogisticRegressionHead(),
    lambda: DistanceRatioHead(),
]


@pytest.mark.parametrize("make", ALL_HEADS)
def test_every_head_returns_probabilities_and_predict_is_their_argmax(make):
    x, y = blobs(dtype=torch.float32)
    head = make()
    assert head.fit(x, y) is head
    p = head.predict_proba(x[:40])
    assert p.shape == (40, 4) and p.dtype == torch.float32
    torch.testing.assert_close(p.sum(1), torch.ones(40))
    assert torch.equal(head.predict(x[:40]), p.argmax(1))
    assert head.num_classes_ == 4
    assert type(head).__name__ in repr(head)


@pytest.mark.parametrize("make", ALL_HEADS)
def test_every_head_raises_clear_errors_on_bad_input(make):
    x, y = blobs(dtype=torch.float32)
    with pytest.raises(NotFittedError):
        make().predict_proba(x)
    with pytest.raises(ValueError, match="train_labels"):
        make().fit(x, y[:-1])
    with pytest.raises(ValueError, match="train_embeddings"):
        make().fit(x[:0], y[:0])
    bad = x.clone()
    bad[3, 2] = float("nan")
    with pytest.raises(ValueError, match="train_embeddings"):
        make().fit(bad, y)
    head = make().fit(x, y)
    with pytest.raises(ValueError, match="embeddings"):
        head.predict_proba(x[:, :5])
    with pytest.raises(ValueError, match="embeddings"):
        head.predict_proba(bad)


def test_a_class_missing_from_the_support_is_a_clear_error():
    x, y = blobs()
    with pytest.raises(ValueError, match=r"class\(es\) \[4\] of num_classes=5"):
        NED(num_classes=5).fit(x, y)
    with pytest.raises(ValueError, match=r"class\(es\) \[1\]"):
        KNNVote().fit(x[y != 1], y[y != 1])


def test_k_larger_than_the_support_is_a_clear_error():
    x, y = blobs(n=8)
    with pytest.raises(ValueError, match="k"):
        KNNVote(k=9).fit(x, y)
    with pytest.raises(ValueError, match="k"):
        NED(k=8).fit(x, y)  # leave-one-out needs k <= 7


def test_ned_rejects_unknown_fit_mode_when_fitted():
    head = NED(fit_mode="cv")  # parameters are checked by fit, as scikit-learn's are
    with pytest.raises(ValueError, match="^fit_mode: expected 'loo' or 'holdout', got 'cv'$"):
        head.fit(*blobs())


def test_heads_keep_the_device_and_num_classes_can_exceed_the_labels_only_with_proxies():
    x, y = blobs()
    head = DistanceRatioHead(proxies=torch.randn(6, 8, dtype=torch.float64), num_classes=6).fit(x, y)
    assert head.predict_proba(x[:3]).shape == (3, 6)


def test_ned_subsampled_leave_one_out_is_nearly_optimal_for_the_full_leave_one_out_nll():
    from shiftguard.heads.ned import ned_nll
    from shiftguard.neighbors import knn_search

    x, y = blobs(n=1500, spread=3.0)
    full = NED(k=10, max_fit_queries=None).fit(x, y)
    sub = NED(k=10, max_fit_queries=500).fit(x, y)
    d, idx = knn_search(x, x, 10, exclude_self=True)
    same = y[idx] == y[:, None]
    keep = same.any(1)
    nll_at = lambda t: ned_nll(d[keep], same[keep], math.log(t))
    assert nll_at(full.temperature_) <= nll_at(sub.temperature_) + 1e-9
    assert nll_at(sub.temperature_) < 1.02 * nll_at(full.temperature_)


def test_quantile_classifier_head_adapts_the_quantile_classifier():
    from shiftguard.heads import QuantileClassifierHead

    x, y = blobs(n=400, spread=1.0, dtype=torch.float32)
    head = QuantileClassifierHead(fit_kwargs={"epochs": 15}).fit(x, y)
    p = head.predict_proba(x)
    assert p.shape == (400, 4)
    torch.testing.assert_close(p.sum(1), torch.ones(400))
    assert (p.argmax(1) == y).float().mean() > 0.8
    ovr = head.predict_one_vs_rest(x)  # the classifier's own per-class probabilities [QACT, Sec. 3]
    assert ovr.shape == (400, 4) and float(ovr.min()) >= 0 and float(ovr.max()) <= 1
    torch.testing.assert_close(p, ovr / ovr.sum(1, keepdim=True))
    with pytest.raises(ValueError, match="embeddings"):
        head.predict_proba(x[:, :3])


def test_temperature_scaling_rejects_bad_input():
    logits = torch.randn(20, 3, dtype=torch.float64)
    labels = torch.arange(20) % 3
    with pytest.raises(ValueError, match="val_embeddings and val_labels"):
        TemperatureScaling().fit(logits, labels, val_embeddings=logits)
    with pytest.raises(ValueError, match="num_classes"):
        TemperatureScaling(num_classes=4).fit(logits, labels)
    with pytest.raises(ValueError, match="labels"):
        TemperatureScaling().fit(logits, labels + 1)
    with pytest.raises(NotFittedError):
        TemperatureScaling().predict_proba(logits)
    ts = TemperatureScaling().fit(logits, labels)
    with pytest.raises(ValueError, match="embeddings"):
        ts.predict_proba(torch.randn(2, 5, dtype=torch.float64))


# ------------------------------------------------------------------------ scikit-learn's habits
def _fit(head, x, y, vx, vy):
    torch.manual_seed(0)
    return head.fit(x, y, *((vx, vy) if head.uses_validation else ()))


@pytest.mark.parametrize("name", HEAD_NAMES)
def test_scikit_learns_own_clone_accepts_every_head_and_the_clone_answers_alike(name):
    from sklearn.base import clone as sklearn_clone

    head = build_head(name, 4, k=5)
    if head.input == "logits":
        g = torch.Generator().manual_seed(2)
        x, y = (
            torch.randn(120, 4, generator=g, dtype=torch.float64) + 3 * torch.eye(4)[torch.arange(120) % 4],
            torch.arange(120) % 4,
        )
    else:
        x, y = blobs(n=120)
    fitted = _fit(head, x, y, x[:60], y[:60])
    twin = sklearn_clone(fitted)  # it checks that __init__ stores every argument as given
    assert type(twin) is type(head) and not hasattr(twin, "classes_")
    assert torch.equal(_fit(twin, x, y, x[:60], y[:60]).predict_proba(x[:30]), fitted.predict_proba(x[:30]))


def test_every_way_of_setting_a_parameter_gives_the_same_head():
    """Parameters are now converted in fit, not in __init__: an int where a float is expected, the
    constructor, set_params and clone all give bit-identical probabilities."""
    from shiftguard.heads import clone

    x, y = blobs()
    q, _ = blobs(n=30, seed=5)
    by_float = DistanceRatioHead(init_log_rho=1.0, max_iter=30).fit(x, y).predict_proba(q)
    assert torch.equal(DistanceRatioHead(init_log_rho=1, max_iter=30).fit(x, y).predict_proba(q), by_float)
    assert torch.equal(DistanceRatioHead().set_params(init_log_rho=1, max_iter=30).fit(x, y).predict_proba(q), by_float)
    holdout = NED(k=5, fit_mode="holdout", holdout_fraction=0.25, seed=3).fit(x, y)
    assert torch.equal(clone(holdout).fit(x, y).predict_proba(q), holdout.predict_proba(q))
    assert clone(holdout).get_params() == holdout.get_params() and not hasattr(clone(holdout), "temperature_")
    knn = KNNVote().set_params(k=3)
    assert repr(knn) == "KNNVote(k=3, backend='torch', num_classes=None)"


def test_set_params_and_clone_refuse_what_is_not_theirs():
    from shiftguard.heads import clone

    with pytest.raises(ValueError, match=r"^kk: not a parameter of KNNVote \(its parameters: \['k', 'backend'"):
        KNNVote().set_params(kk=3)
    with pytest.raises(TypeError, match="^head: expected a shiftguard.heads.Head, got LogisticRegression$"):
        from sklearn.linear_model import LogisticRegression

        clone(LogisticRegression())


def test_clone_copies_settings_and_shares_caches_and_models():
    from shiftguard.heads import QuantileClassifierHead, clone
    from shiftguard.neighbors import SearchCache

    cache = SearchCache()
    knn = build_head("knn", 4, k=3, searches=cache)
    assert clone(knn).searches is cache  # a clone keeps sharing the searches of its support
    logistic = LogisticRegressionHead().fit(*blobs())
    ts = TemperatureScaling(logit_fn=logistic.decision_function)
    assert clone(ts).logit_fn == ts.logit_fn
    proxies = torch.randn(4, 8, dtype=torch.float64)
    dr = clone(DistanceRatioHead(proxies=proxies))
    assert dr.proxies is not proxies and torch.equal(dr.proxies, proxies)
    kwargs = {"n_samples": 20}
    quantile = clone(QuantileClassifierHead(classifier_kwargs=kwargs))
    assert quantile.classifier_kwargs == kwargs and quantile.classifier_kwargs is not kwargs


def test_classes_are_the_labels_on_the_device_of_the_fitted_data():
    x, y = blobs()
    head = KNNVote(k=3).fit(x, y)
    assert torch.equal(head.classes_, torch.arange(4)) and head.classes_.device == x.device
    assert torch.equal(head.classes_[head.predict(x[:10])], head.predict(x[:10]))
