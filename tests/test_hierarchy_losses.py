"""Hierarchy and proxy training pieces of [Kim, Art. IV]: fixed hierarchy proxies, the CORR loss
(eq. (11)), EMA proxy updates (eq. (9), (12)), NormFace (eq. (5)) with the dynamic AdaCos scale, and
EMA proxies in ProxyDR."""

from __future__ import annotations

import math

import pytest
import torch

from shiftguard.data import ClassHierarchy, cifar100_hierarchy, fashion_mnist_hierarchy
from shiftguard.data.hierarchy import transformed_distance
from shiftguard.losses import CORRLoss, EMAProxies, NormFaceLoss, ProxyDRLoss, build_loss, hierarchy_proxies
from shiftguard.losses.hierarchy import ema_proxy_update_, normface_initial_scale, normface_psi

D64 = torch.float64


@pytest.mark.parametrize("make, dim", [(fashion_mnist_hierarchy, 10), (cifar100_hierarchy, 128)])
def test_similarity_proxies_reproduce_the_hierarchical_similarity(make, dim):
    h = make()
    w = hierarchy_proxies(h, dim)
    assert w.shape == (h.num_classes, dim)
    assert torch.allclose(w.norm(dim=1), torch.ones(h.num_classes, dtype=D64), atol=1e-12)
    assert torch.allclose(w @ w.t(), 1.0 - h.distance_matrix("lcs"), atol=1e-10)


def test_similarity_proxies_need_the_rank_and_a_psd_similarity():
    with pytest.raises(ValueError, match="embedding_dim"):
        hierarchy_proxies(fashion_mnist_hierarchy(), 9)
    # leaves at depths 1 to 4 (root 11 holds classes 0-2; inner chains 11 -> 12 -> 14 and 12 -> 13 -> 15, 16):
    # shortest-path heights make 1 - d_LCS indefinite, Barz & Denzler's longest-path heights do not
    uneven = ClassHierarchy([11, 11, 11, 14, 14, 14, 15, 15, 15, 16, 16, None, 11, 12, 12, 13, 13], 11)
    with pytest.raises(ValueError, match="hierarchy"):
        hierarchy_proxies(uneven, 11)
    w = hierarchy_proxies(uneven, 11, height="longest")
    assert torch.allclose(w @ w.t(), 1.0 - uneven.distance_matrix("lcs", height="longest"), atol=1e-10)


def test_mds_proxies_fit_the_transformed_path_distances():
    h = fashion_mnist_hierarchy()
    w = hierarchy_proxies(h, 10, "mds", seed=1)
    target = transformed_distance(h.distance_matrix())
    stress = float((torch.cdist(w, w) - target).norm() / target.norm())
    assert stress < 0.01
    assert torch.allclose(w.norm(dim=1), torch.ones(10, dtype=D64))
    assert torch.equal(w, hierarchy_proxies(h, 10, "mds", seed=1))


def test_corr_loss_is_one_minus_the_cosine_to_the_fixed_proxy():
    h = ClassHierarchy([2, 2, None], 2)
    loss = CORRLoss(h, proxies=torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    emb = torch.tensor([[3.0, 4.0], [0.0, -2.0]])
    # cos: 3/5 and -1 -> ((1 - 0.6) + (1 + 1)) / 2
    assert float(loss(emb, torch.tensor([0, 1]))) == pytest.approx(1.2)
    assert list(loss.parameters()) == []


def test_corr_loss_gradcheck_and_fixed_proxies():
    loss = CORRLoss(fashion_mnist_hierarchy(), embedding_dim=12).double()
    before = loss.proxies.clone()
    emb = torch.randn(8, 12, dtype=D64, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (emb,))
    loss(emb, y).backward()
    assert torch.equal(loss.proxies, before)


def test_corr_loss_without_hierarchy_uses_orthonormal_proxies():
    loss = build_loss("corr", num_classes=4, embedding_dim=5)
    assert torch.allclose(loss.proxies @ loss.proxies.t(), torch.eye(4), atol=1e-6)
    with pytest.raises(ValueError, match="embedding_dim"):
        build_loss("corr", num_classes=4, embedding_dim=3)


def test_ema_update_is_the_normalised_moving_average_of_the_batch_class_direction():
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]], dtype=D64)
    emb = torch.tensor([[0.0, 2.0], [0.0, 1.0], [-3.0, 0.0]], dtype=D64)
    ema_proxy_update_(w, emb, torch.tensor([0, 0, 2]), 0.5)
    r = 1 / math.sqrt(2)
    # class 0: mu = (0, 1) -> normalise(0.5 (0, 1) + 0.5 (1, 0)); class 1 absent; class 2: mu = (-1, 0)
    # and 0.5 (-1, 0) + 0.5 (1, 0) = 0 has no direction: unchanged
    assert torch.allclose(w, torch.tensor([[r, r], [0.0, 1.0], [1.0, 0.0]], dtype=D64))


def test_ema_single_sample_update_is_eq_9():
    ema = EMAProxies(1, 2, alpha=0.25, init=torch.tensor([[1.0, 0.0]]))
    ema.update(torch.tensor([[0.0, 5.0]]), torch.tensor([0]))
    expect = torch.tensor([0.75, 0.25]) / math.hypot(0.75, 0.25)
    assert torch.allclose(ema.proxies[0], expect)
    with pytest.raises(ValueError, match="alpha"):
        EMAProxies(2, 2, alpha=1.0)
    with pytest.raises(ValueError, match="labels"):
        ema.update(torch.tensor([[0.0, 5.0]]), torch.tensor([1]))


def test_normface_loss_is_cross_entropy_of_scaled_cosines():
    loss = NormFaceLoss(3, 2, scale=10.0, proxies=torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 0.0]]))
    emb = torch.tensor([[3.0, 4.0]])
    cos = [0.6, 0.8, -0.6]
    expect = -(10 * cos[1] - math.log(sum(math.exp(10 * c) for c in cos)))
    assert float(loss(emb, torch.tensor([1]))) == pytest.approx(expect, rel=1e-6)


def test_normface_ema_proxies_move_only_in_training_and_get_no_gradient():
    torch.manual_seed(0)
    loss = NormFaceLoss(3, 4, ema_alpha=0.5)
    assert list(loss.parameters()) == []
    emb, y = torch.randn(6, 4, requires_grad=True), torch.tensor([0, 0, 1, 1, 2, 2])
    before = loss.proxies.clone()
    loss.eval()
    loss(emb, y).backward()
    assert torch.equal(loss.proxies, before)
    loss.train()
    expect = before.clone()
    ema_proxy_update_(expect, emb.detach(), y, 0.5)
    loss(emb, y).backward()
    assert torch.allclose(loss.proxies, expect)


def test_adacos_scale_update_is_log_b_avg_over_cos_theta_median():
    torch.manual_seed(1)
    loss = NormFaceLoss(4, 3, dynamic=True, dynamic_rule="adacos")
    s0 = float(loss.scale)
    assert s0 == pytest.approx(math.sqrt(2) * math.log(3))
    emb, y = torch.randn(5, 3, dtype=D64), torch.tensor([0, 1, 2, 3, 0])
    w = torch.nn.functional.normalize(loss.proxies.detach().double(), dim=1)
    cos = torch.nn.functional.normalize(emb, dim=1) @ w.t()
    b = [sum(math.exp(s0 * float(cos[i, j])) for j in range(4) if j != int(y[i])) for i in range(5)]
    thetas = sorted(math.acos(float(cos[i, int(y[i])])) for i in range(5))
    theta = min(thetas[2], math.pi / 4)
    loss.double()(emb, y)
    assert float(loss.scale) == pytest.approx(math.log(sum(b) / 5) / math.cos(theta))


def test_adam_rule_starts_at_the_largest_root_of_psi_and_moves_s():
    s0 = normface_initial_scale(100)
    assert normface_psi(s0, 99.0, math.pi / 4) == pytest.approx(0.0, abs=1e-6)
    assert all(normface_psi(s, 99.0, math.pi / 4) > 0 for s in (s0 + 0.5, s0 + 3.0))
    loss = NormFaceLoss(100, 8, dynamic=True)
    assert float(loss.scale) == pytest.approx(s0)
    loss(torch.randn(16, 8), torch.randint(0, 100, (16,)))
    assert float(loss.scale) != s0
    loss.eval()
    s1 = float(loss.scale)
    loss(torch.randn(16, 8), torch.randint(0, 100, (16,)))
    assert float(loss.scale) == s1


def test_proxydr_default_is_unchanged_and_ema_updates_a_buffer():
    torch.manual_seed(5)
    plain = ProxyDRLoss(3, 4)
    torch.manual_seed(5)
    ref = torch.randn(3, 4)
    assert torch.equal(plain.proxies.data, ref) and plain.proxies.requires_grad
    torch.manual_seed(5)
    ema = ProxyDRLoss(3, 4, ema_alpha=0.1)
    assert list(ema.parameters()) == []
    emb, y = torch.randn(6, 4), torch.tensor([0, 0, 1, 1, 2, 2])
    expect = ema.proxies.clone()
    ema_proxy_update_(expect, emb, y, 0.1)
    ema(emb, y)
    assert torch.allclose(ema.proxies, expect)
    with pytest.raises(ValueError, match="ema_alpha"):
        ProxyDRLoss(3, 4, ema_alpha=1.5)
