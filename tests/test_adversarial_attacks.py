"""FGSM, BIM and PGD in pixel space, and AttackSpec: hand-computed steps, the feasible set
B(x, eps) ∩ [0, 1]^D, ascent on a convex loss, targeting, seeding, model state, and the
embedding-loss path of [NED, Sec. 5]."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shiftguard.adversarial import AttackSpec, bim, fgsm, pgd
from shiftguard.losses import build_loss

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py


def _linear(d_in=6, classes=3, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d_in, classes)


def _ce_grad(model, x, y):
    xr = x.clone().requires_grad_(True)
    F.cross_entropy(model(xr), y, reduction="sum").backward()
    return xr.grad


@pytest.fixture(scope="module")
def blobs():
    """Three well separated classes in [0, 1]^8 and a small MLP trained on them."""
    g = torch.Generator().manual_seed(1)
    centres = torch.tensor([[0.25] * 8, [0.75] * 8, [0.25] * 4 + [0.75] * 4])
    y = torch.arange(90) % 3
    x = (centres[y] + 0.06 * torch.randn(90, 8, generator=g)).clamp(0, 1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.Adam(model.parameters(), lr=0.03)
    for _ in range(150):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return model, x, y


# ------------------------------------------------------------------------------- single steps


def test_fgsm_with_eps_zero_is_the_identity():
    model = _linear()
    x = torch.rand(5, 6)
    y = torch.tensor([0, 1, 2, 0, 1])
    assert torch.equal(fgsm(model, x, y, 0.0), x)
    assert torch.equal(fgsm(model, x, y, 0.0, norm="l2"), x)
    u8 = (x * 255).round().to(torch.uint8)
    assert torch.equal(fgsm(model, u8, y, 0.0), u8)


def test_fgsm_on_a_linear_model_is_x_plus_eps_sign_grad():
    model = _linear()
    x = 0.4 + 0.2 * torch.rand(5, 6)  # far from the bounds: no clamping
    y = torch.tensor([0, 1, 2, 0, 1])
    expected = x + 0.05 * _ce_grad(model, x, y).sign()
    torch.testing.assert_close(fgsm(model, x, y, 0.05), expected)


def test_one_l2_step_of_bim_and_pgd_is_the_normalised_gradient_step():
    model = _linear()
    x = 0.4 + 0.2 * torch.rand(5, 6)
    y = torch.tensor([0, 1, 2, 0, 1])
    g = _ce_grad(model, x, y)
    expected = x + 0.03 * g / g.norm(dim=1, keepdim=True)
    torch.testing.assert_close(bim(model, x, y, 0.1, steps=1, step_size=0.03, norm="l2"), expected)
    torch.testing.assert_close(pgd(model, x, y, 0.1, steps=1, step_size=0.03, norm="l2", random_start=False), expected)


def test_a_step_beyond_the_budget_lands_on_the_l2_sphere():
    model = _linear()
    x = 0.4 + 0.2 * torch.rand(5, 6)
    y = torch.tensor([0, 1, 2, 0, 1])
    g = _ce_grad(model, x, y)
    expected = x + 0.05 * g / g.norm(dim=1, keepdim=True)  # step 0.2, projected back to radius 0.05
    torch.testing.assert_close(bim(model, x, y, 0.05, steps=1, step_size=0.2, norm="l2"), expected)


def test_preprocess_runs_inside_the_gradient():
    model = _linear()
    x = 0.4 + 0.2 * torch.rand(5, 6)
    y = torch.tensor([0, 1, 2, 0, 1])
    mean, std = 0.5, 0.25
    composed = nn.Sequential(_Affine(mean, std), model)
    a = pgd(
        model, x, y, 0.05, steps=3, preprocess=lambda t: (t - mean) / std, generator=torch.Generator().manual_seed(3)
    )
    b = pgd(composed, x, y, 0.05, steps=3, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b)


class _Affine(nn.Module):
    def __init__(self, mean, std):
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, t):
        return (t - self.mean) / self.std


# ------------------------------------------------------------------------------- feasible set


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_pgd_never_leaves_its_ball_nor_the_pixel_range(blobs, norm):
    model, x, y = blobs
    eps = 0.1 if norm == "linf" else 0.4
    adv = pgd(model, x, y, eps, norm=norm, steps=8, step_size=eps, generator=torch.Generator().manual_seed(0))
    d = (adv - x).flatten(1)
    size = d.abs().amax(1) if norm == "linf" else d.norm(dim=1)
    assert float(size.max()) <= eps * (1 + 1e-5)
    assert float(adv.min()) >= 0.0 and float(adv.max()) <= 1.0
    assert float(size.max()) > 0.5 * eps  # and it does move


def test_uint8_images_come_back_as_uint8_within_the_budget(blobs):
    model, x, y = blobs
    u8 = (x * 255).round().to(torch.uint8)
    adv = pgd(model, u8, y, 8 / 255, steps=5, generator=torch.Generator().manual_seed(0))
    assert adv.dtype == torch.uint8 and adv.shape == u8.shape
    assert int((adv.int() - u8.int()).abs().max()) == 8


# ------------------------------------------------------------------------------- optimisation


@pytest.mark.parametrize("norm", ["linf", "l2"])
def test_loss_does_not_decrease_along_pgd_steps_on_a_convex_toy(norm):
    """Cross-entropy of a linear model is convex in x; a projected gradient step with the exact
    projection onto the convex feasible set cannot decrease it."""
    model = _linear(d_in=6, classes=4, seed=2)
    x = torch.rand(12, 6)
    y = torch.arange(12) % 4
    losses = []
    for steps in range(1, 9):
        adv = bim(model, x, y, 0.3, steps=steps, step_size=0.02, norm=norm)
        losses.append(F.cross_entropy(model(adv), y, reduction="none").detach())
    losses = torch.stack(losses)
    assert bool((losses[1:] >= losses[:-1] - 1e-6).all())
    assert bool((losses[-1] > losses[0]).all())


def test_a_targeted_attack_moves_the_prediction_to_the_target(blobs):
    model, x, y = blobs
    target = (y + 1) % 3
    adv = pgd(model, x, target, 0.5, steps=20, targeted=True, generator=torch.Generator().manual_seed(0))
    assert float((model(adv).argmax(1) == target).float().mean()) > 0.95


def test_accuracy_drops_weakly_monotonically_with_eps(blobs):
    model, x, y = blobs
    accs = [
        float(
            (model(pgd(model, x, y, e, steps=10, generator=torch.Generator().manual_seed(0))).argmax(1) == y)
            .float()
            .mean()
        )
        for e in (0.0, 0.05, 0.1, 0.2, 0.3)
    ]
    assert accs[0] == 1.0
    assert all(a >= b for a, b in zip(accs, accs[1:]))
    assert accs[-1] < 0.5


# ------------------------------------------------------------------------------- seeding and state


def test_random_start_is_reproducible_and_batch_size_free(blobs):
    model, x, y = blobs

    def run(seed, batch_size):
        return pgd(
            model,
            x,
            y,
            0.1,
            steps=1,
            step_size=1e-3,
            batch_size=batch_size,
            generator=torch.Generator().manual_seed(seed),
        )

    torch.testing.assert_close(run(5, 256), run(5, 7))
    assert not torch.equal(run(5, 256), run(6, 256))


def test_model_state_is_restored_and_no_gradient_is_left():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))
    model.train()
    model[4].eval()  # a mixed state must come back as it was
    model[0].weight.requires_grad_(False)
    stats = model[1].running_mean.clone()
    x, y = torch.rand(10, 6), torch.arange(10) % 3
    a = pgd(model, x, y, 0.1, generator=torch.Generator().manual_seed(0))
    b = pgd(model, x, y, 0.1, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(a, b)  # eval mode: dropout is off during the attack
    assert [m.training for m in model] == [True, True, True, True, False]
    assert torch.equal(model[1].running_mean, stats)
    assert not model[0].weight.requires_grad and model[4].weight.requires_grad
    assert all(p.grad is None for p in model.parameters())


def test_attacks_work_on_qact_models():
    from shiftguard.nn import convert_activations

    torch.manual_seed(0)
    model = convert_activations(
        nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)),
        example_input=torch.rand(16, 6),
        n_tau=16,
        n_samples=64,
    )
    x, y = torch.rand(16, 6), torch.arange(16) % 3
    before = {k: v.clone() for k, v in model.state_dict().items()}
    adv = fgsm(model, x, y, 0.05)
    assert float((adv - x).abs().max()) == pytest.approx(0.05, rel=1e-5)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


# ------------------------------------------------------------------------------- embedding models


def test_embedding_models_are_attacked_through_their_training_loss():
    """[NED, Sec. 5]: a DML model is attacked through its loss on the embedding (ProxyDR here)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))  # returns embeddings
    loss = build_loss("proxydr", num_classes=3, embedding_dim=4)
    x, y = torch.rand(12, 6), torch.arange(12) % 3
    adv = pgd(model, x, y, 0.1, steps=5, loss_fn=loss, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float(loss(model(adv), y)) > float(loss(model(x), y))
    assert float((adv - x).abs().max()) <= 0.1 + 1e-6
    assert all(p.grad is None for p in loss.parameters())

    triplet = build_loss("triplet")
    adv = fgsm(model, x, y, 0.1, loss_fn=triplet)
    assert float((adv - x).abs().max()) == pytest.approx(0.1, rel=1e-5)


# ------------------------------------------------------------------------------- AttackSpec


def test_attack_spec_names_parse_back_and_run_like_the_functions(blobs):
    model, x, y = blobs
    spec = AttackSpec.parse("PGD_L2", eps=0.3, steps=4)
    assert spec.name == "pgd-l2" and spec.random_start and AttackSpec.parse(spec.name, eps=0.3, steps=4) == spec
    assert AttackSpec.parse("bim-linf-targeted").name == "bim-linf-targeted"
    assert AttackSpec.parse("fgsm").random_start is False
    expected = pgd(model, x, y, 0.3, steps=4, norm="l2", generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(spec.run(model, x, y, seed=7), expected)
    torch.testing.assert_close(AttackSpec("fgsm", eps=0.1).run(model, x, y), fgsm(model, x, y, 0.1))
    assert spec.with_eps(0.1).eps == 0.1 and spec.with_eps(0.1).name == spec.name


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m, x, y: fgsm(m, x, y, -0.1), "eps"),
        (lambda m, x, y: bim(m, x, y, 0.1, steps=0), "steps"),
        (lambda m, x, y: pgd(m, x, y, 0.1, norm="l1"), "norm"),
        (lambda m, x, y: fgsm(m, x + 1.0, y, 0.1), "images"),
        (lambda m, x, y: fgsm(m, x, y[:-1], 0.1), "labels"),
        (lambda m, x, y: pgd(m, x, y, 0.1, step_size=0.0), "step_size"),
        (lambda m, x, y: AttackSpec.parse("cw-l2"), "name"),
        (lambda m, x, y: AttackSpec("bim", random_start=True), "random_start"),
    ],
)
def test_errors_name_the_argument(call, match):
    model = _linear()
    x, y = torch.rand(4, 6), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ValueError, match=match):
        call(model, x, y)
