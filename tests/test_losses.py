"""Math of the custom losses: each against a slow, obviously-correct reference, plus gradchecks (float64)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from shiftguard.losses import (
    DRLoss,
    ProxyDRLoss,
    RecallAtKSurrogate,
    SmoothAPLoss,
    WatershedLoss,
    build_loss,
    dr_log_probs,
    sd_softmax_log_probs,
)
from shiftguard.losses.distance_ratio import _psi_proxydr, proxydr_initial_scale
from shiftguard.losses.watershed import watershed_propagate, watershed_seeds

D64 = torch.float64


def _batch(n_cls=3, m=3, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n_cls).repeat_interleave(m)
    emb = torch.randn(n_cls * m, dim, generator=g, dtype=D64) + 2.0 * F.one_hot(labels % dim, dim).to(D64)
    return emb, labels


# ---------------------------------------------------------------- distance ratio [Kim, Art. II]


@pytest.mark.parametrize(
    "d1,d2,sigma,delta,l_s,l_dr",
    [
        (1.0, 2.0, 0.95257, 0.80000, 0.048587, 0.22314),  # Table 1, case (a)
        (2.0, 4.0, 0.99999, 0.80000, 6.1442e-6, 0.22314),  # Table 1, case (b)
    ],
)
def test_dr_and_softmax_reproduce_paper2_table1(d1, d2, sigma, delta, l_s, l_dr):
    d = torch.tensor([[d1, d2]], dtype=D64)
    log_sd = sd_softmax_log_probs(d)[0, 0]
    log_dr = dr_log_probs(d, 2.0)[0, 0]  # rho = 2 in Table 1
    assert math.isclose(log_sd.exp().item(), sigma, abs_tol=1e-5)
    assert math.isclose(log_dr.exp().item(), delta, abs_tol=1e-5)
    assert math.isclose(-log_sd.item(), l_s, rel_tol=1e-4)
    assert math.isclose(-log_dr.item(), l_dr, rel_tol=1e-4)


def test_dr_probability_is_one_on_the_prototype_and_gradient_finite():
    d = torch.tensor([[0.0, 1.0, 2.0]], dtype=D64)
    dd = (d.pow(2) + 1e-10).sqrt().requires_grad_(True)
    p = dr_log_probs(dd, math.exp(2.0)).exp()
    assert p[0, 0].item() > 1 - 1e-12 and p[0, 1:].sum().item() < 1e-12
    p[0, 0].log().backward()
    assert torch.isfinite(dd.grad).all()


def test_dr_loss_is_invariant_to_scaling_the_embedding_but_sd_is_not():
    emb, y = _batch()
    dr, sd = DRLoss(), DRLoss(formulation="sd")
    for alpha in (0.1, 2.0, 30.0):
        assert torch.allclose(dr(alpha * emb, y), dr(emb, y), atol=1e-8)
    assert abs(sd(2.0 * emb, y).item() - sd(emb, y).item()) > 1e-3


def test_dr_initial_rho_is_exp2_and_learnable():
    loss = DRLoss()
    assert math.isclose(loss.rho.item(), math.exp(2.0), rel_tol=1e-6)
    assert any(p is loss.log_rho for p in loss.parameters())


def _ref_dr_prototypes(emb, y, rho):
    """Loop reference: leave-one-out prototypes, eq. (5), eq. (3)."""
    classes = sorted(set(y.tolist()))
    total, n = 0.0, 0
    for i in range(len(y)):
        own = [j for j in range(len(y)) if y[j] == y[i] and j != i]
        if not own:
            continue
        ds = []
        for c in classes:
            members = own if c == y[i] else [j for j in range(len(y)) if y[j] == c]
            proto = emb[members].mean(0)
            ds.append(math.sqrt(float(((emb[i] - proto) ** 2).sum()) + 1e-10))
        w = [dd ** (-rho) for dd in ds]
        total += -math.log(w[classes.index(int(y[i]))] / sum(w))
        n += 1
    return total / n


def test_dr_prototype_loss_matches_loop_reference():
    emb, y = _batch(n_cls=3, m=3)
    y = y.clone()
    y[-1] = 3  # a singleton class: it is a prototype for others but is skipped as a query
    loss = DRLoss()
    assert math.isclose(loss(emb, y).item(), _ref_dr_prototypes(emb, y, loss.rho.item()), rel_tol=1e-10)


def test_dr_proxy_mode_matches_reference():
    emb, y = _batch()
    loss = DRLoss(mode="proxies", num_classes=3, embedding_dim=4).double()
    d = torch.cdist(emb, loss.proxies)
    ref = -dr_log_probs((d**2 + 1e-10).sqrt(), loss.rho)[torch.arange(9), y].mean()
    assert torch.allclose(loss(emb, y), ref, atol=1e-12)


def test_gradcheck_dr_prototypes_embeddings_and_log_rho():
    emb, y = _batch()
    emb.requires_grad_(True)
    loss = DRLoss().double()
    log_rho = torch.tensor(0.5, dtype=D64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda e, r: functional_call(loss, {"log_rho": r}, (e, y)), (emb, log_rho))


def test_gradcheck_dr_proxies():
    emb, y = _batch()
    emb.requires_grad_(True)
    loss = DRLoss(mode="proxies", num_classes=3, embedding_dim=4).double()
    prox = loss.proxies.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e, p: functional_call(loss, {"proxies": p}, (e, y)), (emb, prox))


# ---------------------------------------------------------------- ProxyDR [Kim, Art. IV]


def test_proxydr_matches_reference_with_normalised_chord_distance():
    emb, y = _batch()
    loss = ProxyDRLoss(3, 4).double()
    f = emb / emb.norm(dim=1, keepdim=True)
    w = loss.proxies / loss.proxies.norm(dim=1, keepdim=True)
    d = ((f[:, None] - w[None]) ** 2).sum(-1).add(1e-10).sqrt()
    logits = -10.0 * d.log()
    ref = F.cross_entropy(logits, y)
    assert torch.allclose(loss(emb, y), ref, atol=1e-12)
    assert float(loss.scale) == 10.0  # fixed scale factor of [Kim, Art. IV]


def test_proxydr_is_invariant_to_embedding_and_proxy_norms():
    emb, y = _batch()
    loss = ProxyDRLoss(3, 4).double()
    assert torch.allclose(loss(emb, y), loss(emb * torch.rand(9, 1, dtype=D64).add(0.5) * 7, y), atol=1e-10)


def test_proxydr_dynamic_initial_scale_solves_psi():
    for c in (2, 10, 100):
        s = proxydr_initial_scale(c)
        assert s > 1
        assert abs(_psi_proxydr(s, (c - 1) * (math.pi / 2) ** (-s), math.pi / 4)) < 1e-8


def test_proxydr_dynamic_scale_steps_reduce_psi_on_a_fixed_batch():
    emb, y = _batch()
    loss = ProxyDRLoss(3, 4, dynamic=True, dynamic_lr=0.05).double()
    s0 = float(loss.scale)

    def psi():
        d = loss.distances(emb).detach()
        s = float(loss.scale)
        neg = torch.ones_like(d, dtype=torch.bool)
        neg[torch.arange(9), y] = False
        b = float((d.pow(-s) * neg).sum(1).mean())
        cos = (F.normalize(emb, dim=1) * F.normalize(loss.proxies.detach(), dim=1)[y]).sum(1)
        th = float(torch.arccos(cos.clamp(-1, 1)).median().clamp(1e-6, math.pi / 4))
        return _psi_proxydr(s, b, th)

    p0 = abs(psi())
    for _ in range(300):
        loss(emb, y)
    assert float(loss.scale) != s0
    assert abs(psi()) < p0
    loss.eval()
    s1 = float(loss.scale)
    loss(emb, y)
    assert float(loss.scale) == s1  # no update in eval mode


def test_gradcheck_proxydr():
    emb, y = _batch()
    emb.requires_grad_(True)
    loss = ProxyDRLoss(3, 4).double()
    prox = loss.proxies.detach().clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e, p: functional_call(loss, {"proxies": p}, (e, y)), (emb, prox))


# ---------------------------------------------------------------- watershed [QACT, App. D]


def _prim_watershed(dist, seeds, seed_labels):
    """Reference: grow the seeded minimum spanning forest one sample at a time (Prim)."""
    n = dist.shape[0]
    lab = [-1] * n
    for s, label in zip(seeds.tolist(), seed_labels.tolist()):
        lab[s] = label
    while min(lab) < 0:
        best = (math.inf, None, None)
        for i in range(n):
            if lab[i] < 0:
                continue
            for j in range(n):
                if lab[j] < 0 and dist[i, j] < best[0]:
                    best = (float(dist[i, j]), i, j)
        lab[best[2]] = lab[best[1]]
    return torch.tensor(lab)


def test_watershed_propagation_equals_prim_minimum_spanning_forest():
    g = torch.Generator().manual_seed(1)
    for trial in range(5):
        x = torch.randn(40, 3, generator=g, dtype=D64)
        y = torch.randint(0, 4, (40,), generator=g)
        seeds = watershed_seeds(y, 1, torch.Generator().manual_seed(trial))
        dist = torch.cdist(x, x)
        got = watershed_propagate(dist, seeds, y[seeds])
        assert torch.equal(got, _prim_watershed(dist, seeds, y[seeds]))


def test_watershed_propagation_without_numba_grows_the_same_forest(monkeypatch):
    from shiftguard import _numba

    g = torch.Generator().manual_seed(2)
    cases = []
    for trial in range(4):
        x = torch.randn(60, 5, generator=g, dtype=D64)
        y = torch.randint(0, 5, (60,), generator=g)
        seeds = watershed_seeds(y, 1 + trial % 2, torch.Generator().manual_seed(trial))
        cases.append((torch.cdist(x, x), seeds, y[seeds]))
    compiled = [watershed_propagate(*c) for c in cases]
    monkeypatch.setattr(_numba, "AVAILABLE", False)
    for c, want in zip(cases, compiled):
        assert torch.equal(watershed_propagate(*c), want)


def test_watershed_propagation_refuses_non_finite_distances():
    dist = torch.tensor([[0.0, float("inf")], [float("inf"), 0.0]])
    with pytest.raises(ValueError, match="dist"):
        watershed_propagate(dist, torch.tensor([0]), torch.tensor([1]))


def test_watershed_propagation_recovers_well_separated_clusters():
    g = torch.Generator().manual_seed(0)
    y = torch.arange(4).repeat_interleave(10)
    x = 10.0 * F.one_hot(y, 4).to(D64) + 0.1 * torch.randn(40, 4, generator=g, dtype=D64)
    seeds = watershed_seeds(y, 1, torch.Generator().manual_seed(1))
    assert torch.equal(watershed_propagate(torch.cdist(x, x), seeds, y[seeds]), y)


def test_watershed_seeds_one_per_class_reproducible():
    y = torch.tensor([0, 0, 1, 1, 1, 2, 0, 2])
    s1 = watershed_seeds(y, 1, torch.Generator().manual_seed(3))
    s2 = watershed_seeds(y, 1, torch.Generator().manual_seed(3))
    assert torch.equal(s1, s2)
    assert sorted(y[s1].tolist()) == [0, 1, 2]
    s3 = watershed_seeds(y, 2, torch.Generator().manual_seed(3))
    assert sorted(y[s3].tolist()) == [0, 0, 1, 1, 2, 2]


def _ref_watershed_loss(emb, y, y_hat):
    n = len(y)
    classes = sorted(set(y.tolist()))
    total, cnt = 0.0, 0
    for i in range(n):
        logits = {}
        for c in classes:
            ds = [
                float((emb[i] - emb[j]).pow(2).sum().add(1e-10).sqrt())
                for j in range(n)
                if j != i and y[j] == c and y_hat[j] == c
            ]
            if ds:
                logits[c] = -min(ds)
        if int(y[i]) not in logits:
            continue
        lse = math.log(sum(math.exp(v) for v in logits.values()))
        total += -(logits[int(y[i])] - lse)
        cnt += 1
    return total / cnt


def test_watershed_loss_matches_loop_reference_of_eq11():
    emb, y = _batch(n_cls=3, m=5, dim=3, seed=2)
    loss = WatershedLoss(generator=torch.Generator().manual_seed(0))
    val = loss(emb, y)
    ref = _ref_watershed_loss(emb, y, loss.last_propagated_labels_)
    assert math.isclose(val.item(), ref, rel_tol=1e-10)


def test_gradcheck_watershed_with_fixed_seeds():
    emb, y = _batch(n_cls=3, m=3, dim=3, seed=4)
    emb.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: WatershedLoss(generator=torch.Generator().manual_seed(0))(e, y), (emb,))


# ---------------------------------------------------------------- RS@k and SiMix [Patel, Ch. 5]


def _ref_rsk(sim, y, ks, tau1, tau2):
    """Loop reference of eq. (5.5)-(5.7) with the min(k, |P|) normalisation and clipping at k."""
    n = len(y)
    sig = lambda u, t: 1.0 / (1.0 + math.exp(-u / t))
    losses = []
    for q in range(n):
        pos = [x for x in range(n) if x != q and y[x] == y[q]]
        if not pos:
            continue
        lk = []
        for k in ks:
            num = 0.0
            for x in pos:
                r = sum(sig(float(sim[q, z] - sim[q, x]), tau2) for z in range(n) if z not in (q, x))
                num += sig(k - 1 - r, tau1)
            lk.append(1 - min(num, k) / min(k, len(pos)))
        losses.append(sum(lk) / len(lk))
    return sum(losses) / len(losses)


def test_rsk_matches_loop_reference():
    emb, y = _batch(n_cls=3, m=4, dim=4)
    loss = RecallAtKSurrogate(k=(1, 2, 4), tau2=0.1)
    x = F.normalize(emb, dim=1)
    ref = _ref_rsk(x @ x.t(), y, (1, 2, 4), 1.0, 0.1)
    assert math.isclose(loss(emb, y).item(), ref, rel_tol=1e-10)


def test_rsk_defaults_from_thesis():
    a, b = RecallAtKSurrogate(), RecallAtKSurrogate(simix=True)
    assert a.k == (1, 2, 4, 8, 16) and a.tau1 == 1.0 and a.tau2 == 0.01
    assert b.k == (1, 2, 4, 8, 12, 16, 20, 24, 28, 32)


def test_simix_equals_rsk_on_explicit_unnormalised_virtual_embeddings():
    emb, y = _batch(n_cls=2, m=3, dim=4)
    loss = RecallAtKSurrogate(k=(1, 2), tau2=0.1, simix=True, generator=torch.Generator().manual_seed(5))
    val = loss(emb, y)
    # reference: build the virtual examples explicitly (eq. (5.8)), in the same pair order and with the same alphas
    x = F.normalize(emb, dim=1)
    alpha = torch.rand(6, generator=torch.Generator().manual_seed(5), dtype=D64)
    pairs = [(a, b) for a in range(6) for b in range(a + 1, 6) if y[a] == y[b]]
    virt = torch.stack([alpha[i] * x[a] + (1 - alpha[i]) * x[b] for i, (a, b) in enumerate(pairs)])
    allx = torch.cat([x, virt])
    ally = torch.cat([y, torch.tensor([int(y[a]) for a, _ in pairs])])
    ref = _ref_rsk(allx @ allx.t(), ally, (1, 2), 1.0, 0.1)
    assert math.isclose(val.item(), ref, rel_tol=1e-10)


def test_rsk_when_every_positive_is_ranked_first_equals_the_sigmoid_at_k_minus_1():
    # rank~ = 1 exactly (negatives at similarity 0 vs 1, tau_2 = 0.01), so R~^k = sigmoid(k - 1) (eq. (5.5))
    y = torch.arange(4).repeat_interleave(2)
    emb = F.one_hot(y, 4).to(D64) * 5
    s0, s1 = torch.sigmoid(torch.tensor([0.0, 1.0], dtype=D64))
    expected = ((1 - s0) + (1 - s1)) / 2
    assert math.isclose(RecallAtKSurrogate(k=(1, 2))(emb, y).item(), expected.item(), rel_tol=1e-7)
    rand = RecallAtKSurrogate(k=(1, 2))(torch.randn(8, 4, dtype=D64), y).item()
    assert rand > expected.item()


def test_gradcheck_rsk_and_simix():
    emb, y = _batch(n_cls=2, m=3, dim=3)
    emb.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: RecallAtKSurrogate(k=(1, 2, 4))(e, y), (emb,))
    assert torch.autograd.gradcheck(
        lambda e: RecallAtKSurrogate(k=(1, 2), simix=True, generator=torch.Generator().manual_seed(0))(e, y), (emb,)
    )


# ---------------------------------------------------------------- Smooth-AP (Brown et al. 2020)


def _ref_smooth_ap(sim, y, tau):
    n = len(y)
    sig = lambda u: 1.0 / (1.0 + math.exp(-u / tau))
    aps = []
    for q in range(n):
        pos = [i for i in range(n) if i != q and y[i] == y[q]]
        if not pos:
            continue
        omega = [j for j in range(n) if j != q]
        ap = 0.0
        for i in pos:
            num = 1 + sum(sig(float(sim[q, j] - sim[q, i])) for j in pos if j != i)
            den = 1 + sum(sig(float(sim[q, j] - sim[q, i])) for j in omega if j != i)
            ap += num / den
        aps.append(ap / len(pos))
    return 1 - sum(aps) / len(aps)


def test_smooth_ap_matches_loop_reference_with_unequal_classes():
    emb, y = _batch(n_cls=3, m=3)
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    x = F.normalize(emb, dim=1)
    assert math.isclose(SmoothAPLoss(0.05)(emb, y).item(), _ref_smooth_ap(x @ x.t(), y, 0.05), rel_tol=1e-10)


def test_pml_smoothap_depends_on_batch_order_ours_does_not():
    from pytorch_metric_learning.losses import SmoothAPLoss as PMLSmoothAP

    g = torch.Generator().manual_seed(0)
    emb = torch.randn(8, 4, generator=g)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # same batch, classes interleaved
    pml = PMLSmoothAP()
    assert abs(pml(emb, y).item() - pml(emb[perm], y[perm]).item()) > 1e-3
    ours = SmoothAPLoss()
    assert math.isclose(ours(emb, y).item(), ours(emb[perm], y[perm]).item(), rel_tol=1e-6)


def test_gradcheck_smooth_ap():
    emb, y = _batch(n_cls=2, m=3, dim=3)
    emb.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: SmoothAPLoss(0.05)(e, y), (emb,))


# ---------------------------------------------------------------- registry


def test_build_loss_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="name: unknown loss 'nope'; expected one of .*recall_at_k.*watershed"):
        build_loss("nope")


def _same_loss(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return type(a) is type(b) and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("name", ["proxydr", "spce", "cross_entropy", "proxy_anchor", "nivmf_proxy"])
def test_build_loss_takes_num_classes_and_embedding_dim_by_keyword_and_the_old_positional_order_is_deprecated(name):
    torch.manual_seed(0)
    new = build_loss(name, num_classes=3, embedding_dim=8)
    torch.manual_seed(0)
    with pytest.warns(
        DeprecationWarning,
        match=r"^passing \(embedding_dim, num_classes\) by position to build_loss is deprecated .*; "
        r"use keywords: build_loss\(name, num_classes=\.\.\., embedding_dim=\.\.\.\)$",
    ) as record:
        old = build_loss(name, 8, 3)  # the former order: embedding_dim, then num_classes
    assert record[0].filename == __file__  # the warning points at the caller
    assert _same_loss(old, new)
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning):
        assert _same_loss(build_loss(name, 8, num_classes=3), new)


def test_build_loss_refuses_a_dimension_given_twice_or_too_many():
    with pytest.raises(TypeError, match="^embedding_dim: given both by position and by keyword$"):
        build_loss("proxydr", 8, embedding_dim=8)
    with pytest.raises(TypeError, match="^num_classes: given both by position and by keyword$"):
        build_loss("proxydr", 8, 3, num_classes=3)
    with pytest.raises(TypeError, match="^embedding_dim, num_classes: at most 2 dimensions by position, got 3$"):
        build_loss("proxydr", 8, 3, 1)


def test_cross_entropy_loss_takes_keywords_and_its_old_positional_order_is_deprecated():
    from shiftguard.losses import CrossEntropyLoss

    torch.manual_seed(0)
    new = CrossEntropyLoss(num_classes=3, embedding_dim=8)
    assert (new.classifier.out_features, new.classifier.in_features) == (3, 8)
    assert new.extra_repr() == "num_classes=3, embedding_dim=8"
    torch.manual_seed(0)
    with pytest.warns(DeprecationWarning, match=r"by position to CrossEntropyLoss is deprecated") as record:
        old = CrossEntropyLoss(8, 3)
    assert record[0].filename == __file__
    assert _same_loss(old, new)
    with pytest.raises(ValueError, match="^num_classes and embedding_dim: both are required"):
        CrossEntropyLoss(num_classes=3)


def test_build_loss_requires_dims_for_proxy_losses():
    with pytest.raises(ValueError, match="num_classes"):
        build_loss("proxydr")
    with pytest.raises(ValueError, match="num_classes"):
        build_loss("proxy_anchor", embedding_dim=8)


@pytest.mark.parametrize(
    "name",
    [
        "watershed",
        "dr",
        "proxydr",
        "recall_at_k",
        "smooth_ap",
        "cross_entropy",
        "triplet",
        "proxy_nca",
        "proxy_nca_pp",
        "proxy_anchor",
        "normface",
        "supcon",
        "mcinfonce",
        "hib",
        "elk",
        "nivmf_proxy",
        "Recall@k",
    ],
)
def test_build_loss_every_name_gives_a_finite_differentiable_scalar(name):
    emb = torch.randn(12, 6, requires_grad=True)
    y = torch.arange(3).repeat(4)
    loss = build_loss(name, num_classes=3, embedding_dim=6)
    out = loss(emb, y)
    assert out.dim() == 0 and torch.isfinite(out)
    out.backward()
    assert torch.isfinite(emb.grad).all()


def test_proxy_nca_pp_is_the_temperature_scaled_normalised_proxy_softmax():
    """ProxyNCA++ (Teh et al. 2020): -log softmax_c(-||x^ - p^_c||^2 / T)[y], T = 1/9, positive in the denominator."""
    torch.manual_seed(0)
    emb = torch.randn(10, 5, dtype=D64)
    y = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 0, 1])
    loss = build_loss("proxy_nca_pp", num_classes=4, embedding_dim=5).double()
    proxies = loss.loss.proxies.detach()
    x, p = F.normalize(emb, dim=1), F.normalize(proxies, dim=1)
    ref = 0.0
    for i in range(10):
        logits = torch.tensor([-9.0 * float(((x[i] - p[c]) ** 2).sum()) for c in range(4)], dtype=D64)
        ref += -float(torch.log_softmax(logits, 0)[y[i]]) / 10
    assert float(loss(emb, y).detach()) == pytest.approx(ref, rel=1e-9)
    with pytest.raises(ValueError, match="temperature"):
        build_loss("proxy_nca_pp", num_classes=4, embedding_dim=5, temperature=0.0)


def test_safe_euclidean_large_path_matches_small_path(monkeypatch):
    import shiftguard.losses.base as base

    a, b = torch.randn(30, 5, dtype=D64), torch.randn(20, 5, dtype=D64)
    small = base.safe_euclidean(a, b)
    monkeypatch.setattr(base, "EXPLICIT_DIFF_LIMIT", 0)
    assert torch.allclose(base.safe_euclidean(a, b), small, atol=1e-10)
