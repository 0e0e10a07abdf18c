"""Contrastive classifiers [Patel, Ch. 6] and the InfoNCE baseline [Kirchhof, URL App. B.2].

Each loss and posterior against a literal Python loop over its equations (float64), gradchecks, the
ESupCon decomposition of eq. (6.17), the closed-form prototype recursion of eq. (6.11), and a short
training run on a separable toy.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shiftguard.losses import (
    ESupConLoss,
    InfoNCELoss,
    MomentumMeanClassifier,
    SPCELoss,
    TightnessLoss,
    build_loss,
)

D64 = torch.float64


def _batch(m=7, dim=3, n_cls=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(m, dim, generator=g, dtype=D64)
    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2][:m])
    return emb, labels


def _unit(v):
    return v / math.sqrt(sum(float(a) ** 2 for a in v)) if any(float(a) != 0 for a in v) else v


def _dot(a, b):
    return sum(float(x) * float(y) for x, y in zip(a, b))


def _log_softmax_at(logits, idx):
    mx = max(logits)
    return logits[idx] - (mx + math.log(sum(math.exp(v - mx) for v in logits)))


# ------------------------------------------------------------------------------------------------ SPCE (6.7)


def _spce_loop(z, y, num_classes, tau=1.0, normalize=False):
    zs = [_unit(r) if normalize else r for r in z]
    m = len(zs)
    total = 0.0
    for i in range(m):
        logits = [sum(_dot(zs[j], zs[i]) for j in range(m) if int(y[j]) == k) / m / tau for k in range(num_classes)]
        total -= _log_softmax_at(logits, int(y[i]))
    return total / m


@pytest.mark.parametrize("tau,normalize", [(1.0, False), (0.3, True)])
def test_spce_equals_the_literal_loop_of_eq_6_7_over_all_classes(tau, normalize):
    emb, y = _batch()
    loss = SPCELoss(num_classes=4, embedding_dim=3, temperature=tau, normalize=normalize)  # class 3 is absent
    assert math.isclose(loss(emb, y).item(), _spce_loop(emb, y, 4, tau, normalize), rel_tol=1e-12)


def test_spce_posterior_equals_eq_6_8_over_the_reference_set():
    ref, ref_y = _batch(seed=1)
    query = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=D64)
    loss = SPCELoss(num_classes=4, embedding_dim=3, temperature=0.5).double().fit(ref, ref_y)
    post = loss.predict_proba(query)
    m = ref.shape[0]
    for i in range(4):
        logits = [sum(_dot(ref[j], query[i]) for j in range(m) if int(ref_y[j]) == k) / m / 0.5 for k in range(4)]
        for k in range(4):
            assert math.isclose(float(post[i, k]), math.exp(_log_softmax_at(logits, k)), rel_tol=1e-12)


def test_spce_posterior_needs_fit_and_fit_validates_its_arguments():
    loss = SPCELoss(3, 2)
    with pytest.raises(RuntimeError, match="fit"):
        loss.predict_proba(torch.randn(2, 2))
    with pytest.raises(ValueError, match="reference_labels"):
        loss.fit(torch.randn(3, 2), torch.tensor([0, 1, 3]))
    with pytest.raises(ValueError, match="reference"):
        loss.fit(torch.randn(3, 5), torch.tensor([0, 1, 2]))
    loss.fit(torch.randn(3, 2), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="embeddings"):
        loss.predict_proba(torch.randn(2, 5))


def test_spce_gradcheck():
    emb, y = _batch()
    loss = SPCELoss(4, 3, temperature=0.7, normalize=True)
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (emb.requires_grad_(True),))


# ----------------------------------------------------------------------------------- tightness (6.9)-(6.11)


def test_tightness_equals_the_literal_loop_of_eq_6_9():
    emb, y = _batch()
    loss = TightnessLoss(3, 3).double()
    with torch.no_grad():
        loss.prototypes.copy_(torch.randn(3, 3, generator=torch.Generator().manual_seed(3), dtype=D64))
    theta = loss.prototypes.detach()
    ref = -sum(_dot(_unit(emb[i]), theta[int(y[i])]) for i in range(7)) / 7
    assert math.isclose(loss(emb, y).item(), ref, rel_tol=1e-12)


def test_tightness_gradient_is_eq_6_10_and_stops_at_the_embeddings():
    emb, y = _batch()
    emb.requires_grad_(True)
    loss = TightnessLoss(4, 3).double()
    loss(emb, y).backward()
    zn = F.normalize(emb.detach(), dim=1)
    for k in range(4):
        expected = -sum((zn[i] for i in range(7) if int(y[i]) == k), torch.zeros(3, dtype=D64)) / 7
        assert torch.allclose(loss.prototypes.grad[k], expected, atol=1e-14)
    assert torch.equal(emb.grad, torch.zeros_like(emb))


def test_tightness_gradcheck_wrt_prototypes_and_embeddings():
    emb, y = _batch()
    loss = TightnessLoss(3, 3, stop_gradient=False).double()
    with torch.no_grad():
        loss.prototypes.copy_(torch.randn(3, 3, generator=torch.Generator().manual_seed(4), dtype=D64))

    def g(e, p):
        z = e / e.norm(dim=1, keepdim=True)
        return -(z * p[y]).sum(1).mean()

    e, p = emb.clone().requires_grad_(True), loss.prototypes.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda e_, p_: torch.func.functional_call(loss, {"prototypes": p_}, (e_, y)), (e, p)
    )
    assert torch.allclose(torch.func.functional_call(loss, {"prototypes": p}, (e, y)), g(e, p), atol=1e-14)


def test_tightness_adds_its_base_loss():
    emb, y = _batch()
    base = SPCELoss(3, 3)
    combined = TightnessLoss(3, 3, base=base).double()
    with torch.no_grad():
        combined.prototypes.fill_(0.5)
    alone = TightnessLoss(3, 3).double()
    with torch.no_grad():
        alone.prototypes.fill_(0.5)
    assert math.isclose(combined(emb, y).item(), base(emb, y).item() + alone(emb, y).item(), rel_tol=1e-12)
    assert isinstance(build_loss("tightness", num_classes=3, embedding_dim=3, base="spce").base, SPCELoss)


def test_momentum_mean_classifier_follows_the_literal_recursion_of_eq_6_11():
    g = torch.Generator().manual_seed(5)
    eta, k, d = 0.3, 3, 4
    clf = MomentumMeanClassifier(k, d, eta=eta).double()
    theta = [[0.0] * d for _ in range(k)]
    for t in range(4):
        m = 5 + t
        z = torch.randn(m, d, generator=g, dtype=D64)
        y = torch.randint(0, 2 if t == 0 else k, (m,), generator=g)  # class 2 absent at t = 0
        clf.update(z, y)
        for c in range(k):
            for i in range(m):
                if int(y[i]) == c:
                    zi = _unit(z[i])
                    theta[c] = [theta[c][q] + eta / m * float(zi[q]) for q in range(d)]
        assert torch.allclose(clf.prototypes, torch.tensor(theta, dtype=D64), atol=1e-14, rtol=0)
    assert int(clf.steps_) == 4


def test_sgd_on_the_tightness_loss_equals_the_momentum_mean_classifier():
    g = torch.Generator().manual_seed(6)
    eta = 0.7
    loss = TightnessLoss(3, 4).double()
    opt = torch.optim.SGD(loss.parameters(), lr=eta)
    clf = MomentumMeanClassifier(3, 4, eta=eta).double()
    for _ in range(3):
        z, y = torch.randn(6, 4, generator=g, dtype=D64), torch.randint(0, 3, (6,), generator=g)
        opt.zero_grad()
        loss(z, y).backward()
        opt.step()
        clf.update(z, y)
    assert torch.allclose(loss.prototypes.detach(), clf.prototypes, atol=1e-14)
    x = torch.randn(5, 4, generator=g, dtype=D64)
    assert torch.allclose(loss.predict_proba(x), clf.predict_proba(x), atol=1e-14)


def test_momentum_mean_classifier_validates_its_batch_by_name():
    clf = MomentumMeanClassifier(3, 2)
    with pytest.raises(ValueError, match="labels"):
        clf.update(torch.randn(2, 2), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="embeddings"):
        clf.update(torch.randn(2, 4), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="embeddings"):
        clf.update(torch.tensor([[float("nan"), 0.0]]), torch.tensor([0]))
    assert torch.equal(clf.prototypes, torch.zeros(3, 2))  # nothing was applied


def test_prototype_classifiers_pick_the_nearest_normalised_prototype():
    clf = MomentumMeanClassifier(2, 2, temperature=0.5)
    clf.update(torch.tensor([[3.0, 0.0], [0.0, 0.1], [0.0, 0.1]]), torch.tensor([0, 1, 1]))
    x = torch.tensor([[1.0, 0.9], [0.9, 1.0]])
    assert clf.predict_proba(x).argmax(1).tolist() == [0, 1]  # class 1's prototype is longer-lived, not larger
    assert torch.allclose(clf.logits(x), F.normalize(x, dim=1) @ torch.eye(2) / 0.5)


# --------------------------------------------------------------------------------------- ESupCon (6.12)-(6.15)


def _esupcon_loop(z, y, theta, tau):
    zs = [_unit(r) for r in z]
    ts = [_unit(r) for r in theta]
    m, k = len(zs), len(ts)

    def s(a, b):
        return _dot(a, b) / tau

    def pt(i, c):  # eq. (6.12)
        denom = sum(math.exp(s(zs[i], ts[q])) for q in range(k)) + sum(
            math.exp(s(zs[i], zs[j])) for j in range(m) if j != i
        )
        return -s(zs[i], ts[c]) + math.log(denom)

    def supcon(i):  # eq. (6.5)
        positives = [p for p in range(m) if p != i and int(y[p]) == int(y[i])]
        lse = math.log(sum(math.exp(s(zs[i], zs[j])) for j in range(m) if j != i))
        return sum(-s(zs[i], zs[p]) + lse for p in positives) / len(positives), len(positives)

    proto_sum, terms = 0.0, 0
    for c in range(k):
        members = [i for i in range(m) if int(y[i]) == c]
        if members:  # eq. (6.14)
            proto_sum += sum(pt(i, c) for i in members) / len(members)
            terms += 1
    sup_sum = 0.0
    for i in range(m):
        if any(p != i and int(y[p]) == int(y[i]) for p in range(m)):
            sup_sum += supcon(i)[0]
            terms += 1
    return (proto_sum + sup_sum) / terms  # eq. (6.15)


@pytest.mark.parametrize(
    "labels,num_classes",
    [
        ([0, 0, 1, 1, 1, 2, 2], 3),  # every class present twice or more: divisor 2N + K exactly
        ([0, 0, 1, 1, 1, 2, 3], 5),  # a singleton (class 3) and an absent class (4)
    ],
)
def test_esupcon_equals_the_literal_loop_of_eqs_6_12_to_6_15(labels, num_classes):
    emb, _ = _batch()
    y = torch.tensor(labels)
    loss = ESupConLoss(num_classes, 3, temperature=0.5).double()
    assert math.isclose(loss(emb, y).item(), _esupcon_loop(emb, y, loss.prototypes.detach(), 0.5), rel_tol=1e-12)


def test_esupcon_divisor_is_2n_plus_k_when_every_class_has_pairs():
    emb, y = _batch()
    loss = ESupConLoss(3, 3, temperature=0.5).double()
    t = loss.terms(emb, y)
    per_class = sum(t.prototype[y == c].mean().item() for c in range(3))
    assert math.isclose(loss(emb, y).item(), (per_class + t.supcon.sum().item()) / (7 + 3), rel_tol=1e-12)


def test_esupcon_prototype_term_decomposes_into_ce_and_supcon_as_eq_6_17():
    """l_pt(z_i, th_yi) = log(exp(l_CE(z_i)) + exp(l_SupCon(z_i, th_yi)) - 1) [Patel, Ch. 6, eq. (6.16)-(6.17)]."""
    emb, y = _batch()
    tau = 0.4
    loss = ESupConLoss(3, 3, temperature=tau).double()
    with torch.no_grad():
        l_pt = loss.terms(emb, y).prototype
        l_ce = F.cross_entropy(loss.logits(emb), y, reduction="none")  # CE on the prototypes
    zs, th = [_unit(r) for r in emb], [_unit(r) for r in loss.prototypes.detach()]
    for i in range(7):
        big_t = _dot(zs[i], th[int(y[i])]) / tau
        c2 = sum(math.exp(_dot(zs[i], zs[j]) / tau) for j in range(7) if j != i)
        supcon_with_prototype = -big_t + math.log(c2 + math.exp(big_t))  # theta_{y_i} added to the pool
        rhs = math.log(math.exp(float(l_ce[i])) + math.exp(supcon_with_prototype) - 1.0)
        assert math.isclose(float(l_pt[i]), rhs, rel_tol=1e-12)


def test_esupcon_posterior_is_the_softmax_over_prototype_cosines():
    emb, _ = _batch()
    loss = ESupConLoss(3, 3, temperature=0.25).double()
    with torch.no_grad():
        post = loss.predict_proba(emb)
    th = [_unit(r) for r in loss.prototypes.detach()]
    for i in range(7):
        logits = [_dot(_unit(emb[i]), th[k]) / 0.25 for k in range(3)]
        for k in range(3):
            assert math.isclose(float(post[i, k]), math.exp(_log_softmax_at(logits, k)), rel_tol=1e-12)


def test_esupcon_gradcheck_wrt_embeddings_and_prototypes():
    emb, y = _batch()
    loss = ESupConLoss(3, 3, temperature=0.5).double()
    p = loss.prototypes.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda e, p_: torch.func.functional_call(loss, {"prototypes": p_}, (e, y)), (emb.requires_grad_(True), p)
    )


def test_esupcon_single_sample_is_the_cross_entropy_on_prototypes():
    loss = ESupConLoss(3, 2).double()
    z, y = torch.tensor([[0.3, -1.0]], dtype=D64), torch.tensor([2])
    assert math.isclose(loss(z, y).item(), F.cross_entropy(loss.logits(z), y).item(), rel_tol=1e-12)


# -------------------------------------------------------------------------------------------------- InfoNCE


def _nt_xent_loop(z, tau):
    """[Patel, Ch. 6, eq. (6.1)-(6.2)]: views i and i + N of image i, cosine similarity."""
    two_n = len(z)
    n = two_n // 2

    def sim(a, b):
        return _dot(_unit(z[a]), _unit(z[b])) / tau

    def pair(i, j):
        return -sim(i, j) + math.log(sum(math.exp(sim(i, k)) for k in range(two_n) if k != i))

    return sum(pair(i, i + n) + pair(i + n, i) for i in range(n)) / two_n


def test_infonce_equals_the_literal_nt_xent_loop():
    g = torch.Generator().manual_seed(7)
    z = torch.randn(8, 5, generator=g, dtype=D64)
    ids = torch.arange(4).repeat(2)
    assert math.isclose(InfoNCELoss(0.3)(z, ids).item(), _nt_xent_loop(z, 0.3), rel_tol=1e-12)
    perm = torch.randperm(8, generator=g)  # the pairing comes from the ids, not from the layout
    assert math.isclose(InfoNCELoss(0.3)(z[perm], ids[perm]).item(), _nt_xent_loop(z, 0.3), rel_tol=1e-12)


def test_infonce_prefers_aligned_views_of_orthogonal_instances():
    n = 4
    base = torch.eye(n, dtype=D64) * 2.0
    ids = torch.arange(n).repeat(2)
    aligned = InfoNCELoss()(torch.cat([base, base]), ids)
    g = torch.Generator().manual_seed(8)
    random = [InfoNCELoss()(torch.randn(2 * n, n, generator=g, dtype=D64), ids).item() for _ in range(20)]
    assert float(aligned) < min(random)


def test_infonce_gradcheck_and_zero_without_pairs():
    z = torch.randn(6, 3, generator=torch.Generator().manual_seed(9), dtype=D64, requires_grad=True)
    ids = torch.tensor([0, 1, 2, 0, 1, 2])
    assert torch.autograd.gradcheck(lambda e: InfoNCELoss(0.5)(e, ids), (z,))
    out = InfoNCELoss()(z, torch.arange(6))
    out.backward()
    assert out.item() == 0.0 and torch.equal(z.grad, torch.zeros_like(z))


# ------------------------------------------------------------------------------------ registry and validation


@pytest.mark.parametrize(
    "name,cls", [("spce", SPCELoss), ("tightness", TightnessLoss), ("esupcon", ESupConLoss), ("InfoNCE", InfoNCELoss)]
)
def test_registry_builds_the_contrastive_losses(name, cls):
    assert isinstance(build_loss(name, num_classes=3, embedding_dim=8), cls)


@pytest.mark.parametrize("name", ["spce", "tightness", "esupcon"])
def test_class_losses_need_dims_and_reject_labels_and_widths_they_cannot_hold(name):
    with pytest.raises(ValueError, match="num_classes and embedding_dim"):
        build_loss(name)
    loss = build_loss(name, num_classes=3, embedding_dim=4)
    with pytest.raises(ValueError, match="labels"):
        loss(torch.randn(4, 4), torch.tensor([0, 1, 2, 3]))
    with pytest.raises(ValueError, match="embeddings"):
        loss(torch.randn(4, 5), torch.tensor([0, 1, 2, 0]))


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: SPCELoss(3, 2, temperature=0.0), "temperature"),
        (lambda: SPCELoss(0, 2), "num_classes"),
        (lambda: ESupConLoss(3, 2, temperature=-1.0), "temperature"),
        (lambda: TightnessLoss(3, 2.5), "embedding_dim"),
        (lambda: TightnessLoss(3, 2, base="spce"), "base"),
        (lambda: MomentumMeanClassifier(3, 2, eta=0.0), "eta"),
        (lambda: InfoNCELoss(temperature=float("nan")), "temperature"),
    ],
)
def test_constructor_arguments_are_validated_by_name(make, arg):
    with pytest.raises((TypeError, ValueError), match=arg):
        make()


def test_half_precision_embeddings_are_computed_in_float32():
    emb, y = _batch()
    for loss in (SPCELoss(3, 3), ESupConLoss(3, 3), InfoNCELoss()):
        out = loss(emb.half(), y)
        assert out.dtype == torch.float32 and torch.isfinite(out)


# ------------------------------------------------------------------------------------------ training sanity


def _toy(n_per_class, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[3.0, 0.0], [-1.5, 2.6], [-1.5, -2.6]])
    y = torch.arange(3).repeat_interleave(n_per_class)
    x = centres[y] + torch.randn(len(y), 2, generator=g)
    return x, y


@pytest.mark.parametrize("name", ["spce", "esupcon"])
def test_training_on_a_separable_toy_gives_posteriors_well_above_chance(name):
    torch.manual_seed(0)
    x, y = _toy(60, seed=0)
    x_test, y_test = _toy(100, seed=1)
    model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 4))
    loss = SPCELoss(3, 4, temperature=0.1, normalize=True) if name == "spce" else ESupConLoss(3, 4)
    opt = torch.optim.Adam(list(model.parameters()) + list(loss.parameters()), lr=0.01)
    for _ in range(150):
        idx = torch.randperm(len(y))[:60]
        opt.zero_grad()
        loss(model(x[idx]), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        if name == "spce":
            loss.fit(model(x), y)
        post = loss.predict_proba(model(x_test))
    assert torch.allclose(post.sum(1), torch.ones(300))
    assert float((post.argmax(1) == y_test).float().mean()) > 0.9  # chance is 1/3


@pytest.mark.parametrize("name", ["spce", "tightness", "esupcon", "momentum"])
def test_posterior_is_a_deprecated_alias_of_predict_proba(name):
    ref, ref_y = _batch(seed=1)
    clf = {
        "spce": lambda: SPCELoss(3, 3).double().fit(ref, ref_y),
        "tightness": lambda: TightnessLoss(3, 3).double(),
        "esupcon": lambda: ESupConLoss(3, 3).double(),
        "momentum": lambda: MomentumMeanClassifier(3, 3).double().update(ref, ref_y),
    }[name]()
    query = torch.randn(4, 3, generator=torch.Generator().manual_seed(2), dtype=D64)
    with pytest.warns(
        DeprecationWarning,
        match=rf"^{type(clf).__name__}\.posterior is deprecated .*; use {type(clf).__name__}\.predict_proba$",
    ) as record:
        old = clf.posterior(query)
    assert record[0].filename == __file__  # the warning points at the caller
    assert torch.equal(old, clf.predict_proba(query))
