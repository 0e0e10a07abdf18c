"""The Voronoi-epsilon adversary [Kim, Art. III]: the projection onto Vor(x) ∩ B(x, eps) ∩ box, its
attack never leaving that region, Observation 1 (VAA equals SAA below d_min / 2) and Theorem 1
(a 1-NN classifier keeps VAA 1 on its own training points at every eps)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _adversarial_helpers import OneNN
from torch import nn

from shiftguard.adversarial import (
    global_voronoi_robustness,
    standard_adversarial_accuracy,
    voronoi_adversarial_accuracy,
    voronoi_inner_radius,
    voronoi_pgd,
    voronoi_project,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")  # conftest.py


def _toy(n=24, dim=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, dim, generator=g)
    y = (x[:, 0] + 0.2 * torch.randn(n, generator=g) > 0.5).long()
    return x, y


def _in_region(z, x, ref, self_index, eps, margin=0.0):
    """Brute force: z nearer to x than to every other reference point (by more than the margin), in the
    L2 ball and in [0, 1]."""
    z64, x64, r64 = z.double(), x.double(), ref.double()
    d_other = torch.cdist(z64, r64, compute_mode="donot_use_mm_for_euclid_dist")
    d_other[torch.arange(len(z)), self_index] = math.inf
    d_self = (z64 - x64).norm(dim=1)
    return (
        bool((d_self < d_other.min(1).values).all())
        and float(d_self.max()) <= eps * (1 + 1e-6) + 1e-7
        and float(z.min()) >= 0.0
        and float(z.max()) <= 1.0
    )


def _mlp(x, y, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(x.shape[1], 32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    for _ in range(200):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    model.zero_grad(set_to_none=True)
    return model


# ------------------------------------------------------------------------------- projection


def test_inner_radius_is_half_the_distance_to_the_nearest_other_point():
    x, _ = _toy()
    d = torch.cdist(x.double(), x.double())
    d.fill_diagonal_(math.inf)
    torch.testing.assert_close(voronoi_inner_radius(x, x), d.min(1).values / 2)


def test_projection_is_the_nearest_feasible_point():
    """Against a general constrained solver on a 2-D problem."""
    optimize = pytest.importorskip("scipy.optimize")
    import numpy as np

    g = torch.Generator().manual_seed(3)
    ref = torch.rand(15, 2, dtype=torch.float64, generator=g)
    x = ref[:6]
    y = x + 0.3 * torch.randn(6, 2, dtype=torch.float64, generator=g)
    margin, eps = 1e-6, 0.15
    z = voronoi_project(y, x, ref, eps, margin=margin)
    for i in range(6):
        xi, yi = x[i].numpy(), y[i].numpy()
        cons = [{"type": "ineq", "fun": lambda v: eps**2 - ((v - xi) ** 2).sum()}]
        for j in range(15):
            a = ref[j].numpy() - xi
            if j != i:
                cons.append(
                    {
                        "type": "ineq",
                        "fun": lambda v, a=a: np.linalg.norm(a) * (np.linalg.norm(a) / 2 - margin) - a @ (v - xi),
                    }
                )
        best = optimize.minimize(
            lambda v: ((v - yi) ** 2).sum(),
            xi,
            jac=lambda v: 2 * (v - yi),
            bounds=[(0, 1)] * 2,
            constraints=cons,
            method="SLSQP",
            options={"ftol": 1e-14, "maxiter": 500},
        )
        np.testing.assert_allclose(z[i].numpy(), best.x, atol=1e-5)


@pytest.mark.parametrize("eps", [0.05, 0.3, math.inf])
def test_projection_stays_in_the_cell_the_ball_and_the_box(eps):
    g = torch.Generator().manual_seed(1)
    ref = torch.rand(60, 10, generator=g)
    x = ref[:20]
    y = (x + 0.4 * torch.randn(20, 10, generator=g)).clamp(-1, 2)
    z = voronoi_project(y, x, ref, eps)
    assert z.dtype == torch.float32
    assert _in_region(z, x, ref, torch.arange(20), eps if math.isfinite(eps) else math.sqrt(10), margin=1e-5)


def test_points_already_in_the_region_do_not_move():
    x, _ = _toy()
    y = x + 1e-3 * torch.randn_like(x)
    y = y.clamp(0, 1)
    torch.testing.assert_close(voronoi_project(y, x, x, 0.5), y)


# ------------------------------------------------------------------------------- the attack


def test_voronoi_pgd_never_leaves_the_cell_nor_the_ball():
    x, y = _toy(dim=3)
    model = _mlp(x, y)
    for eps in (0.05, 0.3):
        adv = voronoi_pgd(model, x, y, x, eps, steps=5, generator=torch.Generator().manual_seed(0))
        assert _in_region(adv, x, x, torch.arange(len(x)), eps)


def test_observation_1_vaa_equals_saa_below_half_the_minimum_distance():
    """[Kim, Art. III, Observation 1]: for eps < d_min / 2 both adversaries have the same region."""
    x, y = _toy(dim=3)
    model = _mlp(x, y)
    d_min = 2 * float(voronoi_inner_radius(x, x).min())
    eps = [0.5 * d_min / 2, 0.99 * d_min / 2]
    kw = dict(steps=5, step_size=0.5 * d_min, seed=1)
    vaa = voronoi_adversarial_accuracy(model, x, y, x, eps, **kw)
    assert vaa == standard_adversarial_accuracy(model, x, y, eps, **kw)
    assert min(vaa.values()) < 1.0  # the attack does something


def test_theorem_1_a_1nn_classifier_keeps_vaa_one_at_every_eps():
    """[Kim, Art. III, Theorem 1]: on its training points the 1-NN classifier is never fooled by the
    Voronoi-epsilon adversary, while the standard adversary fools it at large eps (the trade-off)."""
    x, y = _toy(n=16, dim=3)
    model = OneNN(x, y, 2)
    eps = [0.05, 0.3, math.inf]
    vaa = voronoi_adversarial_accuracy(model, x, y, x, eps, steps=4)
    assert vaa == {0.05: 1.0, 0.3: 1.0, math.inf: 1.0}
    assert global_voronoi_robustness(model, x, y, x, steps=4) == 1.0
    assert standard_adversarial_accuracy(model, x, y, [math.inf], steps=4)[math.inf] < 1.0


# ------------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x, y = _toy()
    with pytest.raises(ValueError, match="margin"):
        voronoi_project(x, x, x, 0.1, margin=1.0)
    with pytest.raises(ValueError, match="x_adv"):
        voronoi_project(x[:3], x, x, 0.1)
    with pytest.raises(ValueError, match="reference"):
        voronoi_project(x, x, torch.rand(5, 7), 0.1)
    with pytest.raises(ValueError, match="eps"):
        voronoi_project(x, x, x, -0.1)
    with pytest.raises(ValueError, match="step_size"):
        voronoi_pgd(OneNN(x, y, 2), x, y, x, math.inf, bounds=None, random_start=False)
    with pytest.raises(ValueError, match="eps_values"):
        voronoi_adversarial_accuracy(OneNN(x, y, 2), x, y, x, [])
