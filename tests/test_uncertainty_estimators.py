"""The uncertainty estimators of the URL benchmark (deep ensemble, MC dropout, SNGP, HET-XL, L2 loss
prediction), each checked against a slow, obviously-correct reference, plus the shared protocol:
log-probability outputs, a backpropagating objective, argument errors, ``shiftguard.evaluate``, and
a short fit on a toy problem."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import shiftguard
from shiftguard.models import MLP
from shiftguard.uncertainty import (
    HETXL,
    SNGP,
    DeepEnsemble,
    LossPredictionL2,
    MCDropout,
    UncertaintyEstimator,
    entropy_from_log_probs,
    jensen_shannon_divergence,
    loss_prediction_l2_loss,
    spectral_normalize,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class Encoder(nn.Module):
    """A plain backbone: ``x -> (N, D)``, with ``embedding_dim`` / ``num_classes`` attributes."""

    def __init__(self, in_features=2, embedding_dim=16, num_classes=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(in_features, 32), nn.ReLU(), nn.Linear(32, embedding_dim), nn.ReLU())
        self.embedding_dim = embedding_dim
        self.num_classes = num_classes

    def forward(self, x):
        return self.net(x)


def _images(n=24, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g), torch.arange(n) % classes


def _mlp(seed=0, classes=3):
    torch.manual_seed(seed)
    return MLP(num_classes=classes, hidden=(32, 16))


FACTORIES = {
    "ensemble": lambda b: DeepEnsemble(b, num_members=4),
    "ensemble_independent": lambda b: DeepEnsemble(b, num_members=3, independent=True),
    "mc_dropout": lambda b: MCDropout(b, rate=0.2, num_samples=5),
    "sngp": lambda b: SNGP(b, num_features=64),
    "hetxl": lambda b: HETXL(b, num_samples=8),
    "loss_prediction_l2": lambda b: LossPredictionL2(b, hidden=(32, 32)),
}


# ----------------------------------------------------------------------------------------------- SNGP
def test_sngp_posterior_equals_an_explicit_inverse_and_the_mean_field_formula():
    """Sigma = inv(ridge I + Phi^T Phi) over the training features; var = phi^T Sigma phi; eval logits
    g / sqrt(1 + pi/8 var) -- all against literal float64 computations."""
    torch.manual_seed(0)
    enc = Encoder(in_features=3, embedding_dim=5, num_classes=3).double()
    ridge, m_feat, ls = 0.7, 12, 1.5
    model = SNGP(
        enc, num_features=m_feat, ridge=ridge, normalize_input=False, length_scale=ls, spectral_norm=False
    ).double()
    x_train = torch.randn(40, 3, dtype=torch.float64)
    model.fit_covariance([x_train[:25], (x_train[25:], torch.zeros(15))])
    gp = model.classifier

    def phi(x):
        h = enc(x).detach()
        return math.sqrt(2.0 / m_feat) * torch.cos(h @ gp.rf_weight.T / ls + gp.rf_bias)

    big_phi = phi(x_train)
    sigma_ref = torch.linalg.inv(ridge * torch.eye(m_feat, dtype=torch.float64) + big_phi.T @ big_phi)
    torch.testing.assert_close(model.posterior_covariance(), sigma_ref, rtol=1e-10, atol=1e-12)

    x_test = torch.randn(7, 3, dtype=torch.float64) * 2
    phi_t = phi(x_test)
    var_ref = torch.stack([phi_t[i] @ sigma_ref @ phi_t[i] for i in range(7)])
    torch.testing.assert_close(model.predictive_variance(x_test), var_ref, rtol=1e-10, atol=1e-12)
    assert model.uncertainty(x_test)["variance"].tolist() == pytest.approx(var_ref.tolist(), rel=1e-10)

    g = phi_t @ gp.beta.weight.detach().T
    model.eval()
    expected = F.log_softmax(g / torch.sqrt(1 + math.pi / 8 * var_ref).unsqueeze(1), dim=1)
    torch.testing.assert_close(model(x_test).detach(), expected, rtol=1e-10, atol=1e-12)
    model.train()
    torch.testing.assert_close(model(x_test).detach(), F.log_softmax(g, dim=1), rtol=1e-10, atol=1e-12)

    # reset + per-batch updates == fit_covariance; before any data Sigma is the prior I / ridge
    model.reset_covariance()
    torch.testing.assert_close(model.posterior_covariance(), torch.eye(m_feat, dtype=torch.float64) / ridge)
    for chunk in x_train.split(10):
        model.update_covariance(enc(chunk).detach())
    torch.testing.assert_close(model.posterior_covariance(), sigma_ref, rtol=1e-10, atol=1e-12)


def test_spectral_normalisation_bounds_large_weights_and_leaves_small_ones():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(20, 30), nn.Conv2d(2, 3, 3), nn.Linear(30, 10))
    with torch.no_grad():
        net[0].weight.mul_(10)
        net[2].weight.mul_(1e-3)
    small = net[2].weight.detach().clone()
    assert spectral_normalize(net, bound=0.9) == 3
    for _ in range(30):  # power iteration runs on training forwards
        _ = net[0].weight, net[1].weight
    assert float(torch.linalg.matrix_norm(net[0].weight.detach(), ord=2)) == pytest.approx(0.9, rel=1e-4)
    conv = net[1].weight.detach().reshape(3, -1)
    assert float(torch.linalg.matrix_norm(conv, ord=2)) <= 0.9 * (1 + 1e-4)
    assert torch.equal(net[2].weight.detach(), small)
    # SNGP normalises an EmbeddingClassifier's hidden layers, not its (replaced) classifier
    model = SNGP(_mlp(), num_features=16)
    assert torch.nn.utils.parametrize.is_parametrized(model.backbone.body[1], "weight")
    assert not torch.nn.utils.parametrize.is_parametrized(model.backbone.classifier, "weight")


# --------------------------------------------------------------------------------------------- HET-XL
def _zero_covariance(model: HETXL):
    d = model.embedding_dim
    with torch.no_grad():
        model.classifier.covariance.weight.zero_()
        model.classifier.covariance.bias.zero_()
        model.classifier.covariance.bias[d * model.classifier.rank :] = -1e4  # softplus(-1e4) == 0 exactly


def test_hetxl_with_zero_covariance_is_exactly_the_deterministic_softmax():
    x, _ = _images()
    model = HETXL(_mlp(), rank=2, num_samples=9, temperature=0.7).eval()
    _zero_covariance(model)
    emb = model.embed(x)
    expected = F.log_softmax(model.backbone.classifier(emb) / model.classifier.temperature, dim=1)
    assert torch.equal(model(x), expected)
    assert torch.equal(model.uncertainty(x)["entropy"], entropy_from_log_probs(expected.detach()))
    assert bool((model.uncertainty(x)["log_det_cov"] == -math.inf).all())  # Sigma = 0 is singular


def test_hetxl_monte_carlo_average_and_log_det_against_literal_loops():
    torch.manual_seed(0)
    x, _ = _images(6)
    model = HETXL(_mlp(), rank=2, num_samples=5, temperature=1.3).double().eval()
    head = model.classifier
    emb = model.embed(x.double()).detach()
    eps = head.noise(emb)  # (N, S, D), the eval-mode draws of `seed`
    tau = head.temperature
    probs = torch.stack([F.softmax(head.linear(emb + eps[:, s]) / tau, dim=1) for s in range(5)]).mean(0)
    torch.testing.assert_close(model(x.double()).detach(), probs.log().detach(), rtol=1e-10, atol=1e-12)
    v, d = head.covariance_factors(emb)
    ref = torch.stack([torch.logdet(v[i] @ v[i].T + torch.diag(d[i])) for i in range(6)])
    torch.testing.assert_close(model.uncertainty(x.double())["log_det_cov"], ref.detach(), rtol=1e-9, atol=1e-9)


def test_hetxl_noise_has_the_covariance_v_vt_plus_diag_d():
    torch.manual_seed(0)
    model = HETXL(Encoder(embedding_dim=4), rank=2, num_samples=40000, num_classes=3).double().eval()
    emb = model.embed(torch.randn(1, 2, dtype=torch.float64)).detach()
    v, d = model.classifier.covariance_factors(emb)
    cov_ref = (v[0] @ v[0].T + torch.diag(d[0])).detach()
    eps = model.classifier.noise(emb)[0].detach()
    torch.testing.assert_close(torch.cov(eps.T), cov_ref, atol=0.03 * float(cov_ref.abs().max()), rtol=0.0)


def test_hetxl_eval_predictions_repeat_and_do_not_depend_on_the_batch():
    x, _ = _images()
    model = HETXL(_mlp(), num_samples=4).eval()
    full = model(x)
    assert torch.equal(full, model(x))
    torch.testing.assert_close(model(x[5:9]), full[5:9])
    other = HETXL(_mlp(), num_samples=4, seed=1).eval()
    assert not torch.equal(other(x), full)


# ---------------------------------------------------------------------------------------- MC dropout
def test_mc_dropout_at_rate_zero_is_exactly_the_deterministic_model():
    x, _ = _images()
    backbone = _mlp()
    model = MCDropout(backbone, rate=0.0, num_samples=6).eval()
    assert torch.equal(model(x), F.log_softmax(backbone(x), dim=1))
    assert torch.equal(model.uncertainty(x)["jsd"], torch.zeros(len(x)))


def test_mc_dropout_samples_are_seeded():
    x, _ = _images()
    a = MCDropout(_mlp(), rate=0.3, seed=0).eval()
    b = MCDropout(_mlp(), rate=0.3, seed=1).eval()
    assert torch.equal(a(x), a(x))  # the same seed repeats
    assert not torch.equal(a(x), b(x))  # two seeds differ
    torch.testing.assert_close(a(x[3:7]), a(x)[3:7])  # masks shared across the batch
    assert float(a.uncertainty(x)["jsd"].min()) > 0
    a.train()
    torch.manual_seed(0)
    first = a(x)
    assert not torch.equal(first, a(x))  # training: fresh dropout per call


def test_mc_dropout_sample_average_against_a_literal_loop():
    x, _ = _images()
    model = MCDropout(_mlp(), rate=0.25, num_samples=4).eval()
    emb = model.embed(x)
    masks = model.classifier.masks(emb.shape[1], emb.device, emb.dtype)
    assert set(masks.unique().tolist()) <= {0.0, float(torch.tensor(1 / 0.75))}
    probs = torch.stack([F.softmax(model.backbone.classifier(emb * m), dim=1) for m in masks]).mean(0)
    torch.testing.assert_close(model(x), probs.log(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------ ensemble
def test_ensemble_of_identical_members_has_zero_jsd_and_the_member_entropy():
    x, _ = _images()
    model = DeepEnsemble(_mlp(), num_members=5).eval()
    heads = model.classifier.heads
    with torch.no_grad():
        for h in heads[1:]:
            h.weight.copy_(heads[0].weight)
            h.bias.copy_(heads[0].bias)
    u = model.uncertainty(x)
    member = F.log_softmax(heads[0](model.embed(x)), dim=1).detach()
    assert torch.equal(u["jsd"], torch.zeros(len(x)))
    assert torch.equal(u["entropy"], entropy_from_log_probs(member))
    assert torch.equal(model(x).detach(), member)


def test_ensemble_of_different_members_pools_probabilities():
    x, y = _images()
    model = DeepEnsemble(_mlp(), num_members=3, objective="members")
    emb = model.embed(x)
    probs = [F.softmax(h(emb), dim=1) for h in model.classifier.heads]
    p_bar = torch.stack(probs).mean(0)
    torch.testing.assert_close(model(x), p_bar.log())
    ent = lambda p: -(p * p.log()).sum(1)
    jsd_ref = ent(p_bar) - torch.stack([ent(p) for p in probs]).mean(0)
    u = model.uncertainty(x)
    torch.testing.assert_close(u["jsd"], jsd_ref.detach(), rtol=1e-4, atol=1e-6)
    assert float(u["jsd"].min()) > 0
    torch.testing.assert_close(u["entropy"], ent(p_bar).detach())
    literal = sum(F.cross_entropy(h(emb), y) for h in model.classifier.heads)
    torch.testing.assert_close(model.training_loss(x, y), literal)
    mean_obj = DeepEnsemble(model.backbone, num_members=3)  # the default: URL's CE of p_bar
    torch.testing.assert_close(mean_obj.training_loss(x, y), F.nll_loss(mean_obj(x), y))


def test_independent_ensemble_has_freshly_initialised_full_members():
    x, _ = _images()
    backbone = _mlp()
    model = DeepEnsemble(backbone, num_members=3, independent=True, seed=5)
    w = [m.body[1].weight for m in model.members]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    assert not any(torch.equal(wi, backbone.body[1].weight) for wi in w)
    assert model.embed(x).shape == (len(x), 3 * 16)
    p_bar = torch.stack([F.softmax(m(x), dim=1) for m in model.members]).mean(0)
    torch.testing.assert_close(model(x), p_bar.log())
    again = DeepEnsemble(backbone, num_members=3, independent=True, seed=5)
    assert torch.equal(again(x), model(x))  # seeded initialisation


def test_jensen_shannon_divergence_is_the_entropy_gap():
    g = torch.Generator().manual_seed(0)
    logp = F.log_softmax(torch.randn(8, 4, 5, generator=g) * 3, dim=-1)
    p = logp.exp()
    ent = lambda q: -(q * q.log()).sum(-1)
    ref = ent(p.mean(1)) - ent(p).mean(1)
    torch.testing.assert_close(jensen_shannon_divergence(logp), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="^member_log_probs:"):
        jensen_shannon_divergence(logp[0])


# ------------------------------------------------------------------------------- L2 loss prediction
def test_l2_loss_prediction_loss_is_eq_8_with_a_detached_target():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(10, 4, generator=g, requires_grad=True)
    u = torch.rand(10, generator=g, requires_grad=True)
    y = torch.arange(10) % 4
    lam = 0.3
    loss = loss_prediction_l2_loss(logits, y, u, lam)
    ce = torch.stack([-F.log_softmax(logits[i], dim=0)[y[i]] for i in range(10)])
    literal = ce.mean() + lam * ((u - ce.detach()) ** 2).mean()
    torch.testing.assert_close(loss, literal)
    g_logits, g_u = torch.autograd.grad(loss, [logits, u])
    (g_ce,) = torch.autograd.grad(ce.mean(), [logits])
    torch.testing.assert_close(g_logits, g_ce)  # the L2 term never reaches the CE target
    torch.testing.assert_close(g_u, 2 * lam * (u - ce).detach() / 10)


def test_l2_loss_prediction_estimator_trains_classifier_and_predictor_jointly():
    x, y = _images()
    model = LossPredictionL2(_mlp(), loss_weight=0.4, hidden=(8,))
    emb = model.embed(x)
    expected = loss_prediction_l2_loss(model.backbone.classifier(emb), y, model.predicted_loss(x), 0.4)
    torch.testing.assert_close(model.training_loss(x, y), expected)
    assert float(model.predicted_loss(x).detach().min()) > 0  # softplus output
    detached = LossPredictionL2(_mlp(), hidden=(8,), detach_embedding=True)
    detached.backbone.zero_grad()
    torch.autograd.backward(detached.predicted_loss(x).sum())
    assert all(p.grad is None for p in detached.backbone.parameters())


# -------------------------------------------------------------------------------- the shared protocol
@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_estimator_outputs_log_probabilities_and_backpropagates(name):
    x, y = _images()
    model = FACTORIES[name](_mlp())
    assert isinstance(model, UncertaintyEstimator)
    for mode in (True, False):
        model.train(mode)
        out = model(x)
        assert out.shape == (len(x), 3)
        torch.testing.assert_close(out.logsumexp(dim=1), torch.zeros(len(x)), atol=1e-5, rtol=0)
    model.train()
    loss = model.training_loss(x, y)
    assert loss.dim() == 0
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    u = model.uncertainty(x)
    assert set(u) == set(model.uncertainty_names) and model.default_uncertainty in u
    assert all(v.shape == (len(x),) for v in u.values())
    assert model.training and all(m.training for m in model.modules())  # mode restored
    assert model.embed(x).shape == (len(x), model.embedding_dim)


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_estimators_predict_proba_is_the_eval_mode_softmax_of_its_output(name):
    x, _ = _images()
    model = FACTORIES[name](_mlp())
    model.train()
    p = model.predict_proba(x)
    assert model.training and all(m.training for m in model.modules())  # mode restored
    assert not p.requires_grad and p.shape == (len(x), 3)
    with torch.no_grad():
        assert torch.equal(p, torch.softmax(model.eval()(x), dim=1))
    with pytest.raises(ValueError, match="^x:"):
        model.predict_proba(x[:0])


def test_resolve_backbone_takes_its_sizes_by_keyword_and_the_old_positional_order_is_deprecated():
    from shiftguard.uncertainty.estimator import resolve_backbone

    enc = nn.Linear(2, 16)
    new = resolve_backbone(enc, num_classes=4, embedding_dim=16)
    assert (new.num_classes, new.embedding_dim) == (4, 16)
    with pytest.warns(DeprecationWarning, match=r"by position to resolve_backbone is deprecated"):
        assert resolve_backbone(enc, 16, 4) == new


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_estimator_works_with_shiftguard_evaluate(name):
    x, y = _images(30)
    pixels = (x * 255).to(torch.uint8)
    model = FACTORIES[name](_mlp()).eval()
    res = shiftguard.evaluate(
        model, (pixels, y), heads=("softmax",), output="logits", corruptions=["fog"], severities=[1], n_boot=10
    )
    clean = [r for r in res.rows if r["severity"] == 0]
    accuracy = float((model(pixels.float() / 255).argmax(1) == y).float().mean())
    assert clean and clean[0]["accuracy"] == pytest.approx(accuracy)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: DeepEnsemble(_mlp(), num_members=0), "^num_members:"),
        (lambda: DeepEnsemble(_mlp(), objective="vote"), "^objective:"),
        (
            lambda: DeepEnsemble(Encoder(), num_classes=3, embedding_dim=16).training_loss(
                torch.randn(4, 2), [0, 1, 2, 3]
            ),
            "^y:",
        ),
        (lambda: DeepEnsemble("resnet"), "^backbone:"),
        (lambda: DeepEnsemble(_mlp(), num_classes=5), "^num_classes:"),
        (lambda: MCDropout(nn.Linear(2, 8), embedding_dim=8), "^num_classes:"),
        (lambda: MCDropout(nn.Linear(2, 8), num_classes=3), "^embedding_dim:"),
        (lambda: MCDropout(_mlp(), rate=1.0), "^rate:"),
        (lambda: MCDropout(_mlp(), num_samples=0), "^num_samples:"),
        (lambda: SNGP(_mlp(), num_features=0), "^num_features:"),
        (lambda: SNGP(_mlp(), ridge=0.0), "^ridge:"),
        (lambda: SNGP(_mlp()).update_covariance(torch.randn(3, 7)), "^embeddings:"),
        (lambda: SNGP(_mlp()).fit_covariance([]), "^x_batches:"),
        (lambda: HETXL(_mlp(), rank=0), "^rank:"),
        (lambda: HETXL(_mlp(), temperature=-1.0), "^temperature:"),
        (lambda: HETXL(_mlp()).uncertainty(torch.zeros(5)), "^x:"),
        (lambda: LossPredictionL2(_mlp(), loss_weight=-0.1), "^loss_weight:"),
        (lambda: loss_prediction_l2_loss(torch.randn(3, 2), [0, 1, 1], torch.rand(4)), "mismatched lengths"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# --------------------------------------------------------------------------------------- toy training
def _blobs(n=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    centres = torch.tensor([[2.0, 0.0], [0.0, 2.0], [-2.0, 0.0], [0.0, -2.0]])
    y = torch.arange(n) % 4
    return centres[y] + 0.5 * torch.randn(n, 2, generator=g), y


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_estimator_fits_four_gaussian_blobs(name):
    x, y = _blobs()
    x_test, y_test = _blobs(seed=1)
    torch.manual_seed(0)
    model = FACTORIES[name](Encoder())
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(60):
        loss = model.training_loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    if isinstance(model, SNGP):
        model.fit_covariance([x])
    model.eval()
    accuracy = float((model(x_test).argmax(1) == y_test).float().mean())
    assert accuracy > 0.85, accuracy
