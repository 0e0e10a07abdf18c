"""vMF normaliser against mpmath/SciPy Bessel functions, its gradient, and Wood's sampler."""

import math

import pytest
import torch

from shiftguard.functional.vmf import (
    log_vmf_normalizer,
    sample_vmf,
    vmf_log_prob,
    vmf_mean_resultant_length,
)

mpmath = pytest.importorskip("mpmath")


def mp_log_c(kappa, m):
    with mpmath.workdps(60):
        v = mpmath.mpf(m) / 2 - 1
        k = mpmath.mpf(kappa)
        return float(
            v * mpmath.log(k) - (mpmath.mpf(m) / 2) * mpmath.log(2 * mpmath.pi) - mpmath.log(mpmath.besseli(v, k))
        )


def mp_ratio(kappa, m):
    with mpmath.workdps(60):
        k = mpmath.mpf(kappa)
        return float(mpmath.besseli(mpmath.mpf(m) / 2, k) / mpmath.besseli(mpmath.mpf(m) / 2 - 1, k))


GRID = [(m, k) for m in (2, 3, 10, 64, 128, 512) for k in (1e-6, 0.01, 0.7, 5.0, 40.0, 900.0, 1e4)]


@pytest.mark.parametrize("m, kappa", GRID)
def test_log_normalizer_matches_mpmath(m, kappa):
    got = float(log_vmf_normalizer(torch.tensor(kappa, dtype=torch.float64), m))
    assert got == pytest.approx(mp_log_c(kappa, m), rel=1e-10, abs=1e-10)


def test_log_normalizer_matches_scipy_where_the_plain_bessel_function_is_finite():
    from scipy.special import iv

    kappa = torch.tensor([0.5, 3.0, 20.0, 100.0], dtype=torch.float64)
    for m in (3, 16, 64):
        ref = (
            (m / 2 - 1) * torch.log(kappa)
            - m / 2 * math.log(2 * math.pi)
            - torch.log(torch.from_numpy(iv(m / 2 - 1, kappa.numpy())))
        )
        torch.testing.assert_close(log_vmf_normalizer(kappa, m), ref, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("m", [3, 10, 128, 512])
def test_kappa_zero_gives_the_inverse_surface_area(m):
    area = 2 * math.pi ** (m / 2) / math.gamma(m / 2) if m < 300 else None
    got = float(log_vmf_normalizer(torch.tensor(0.0, dtype=torch.float64), m))
    if area is not None:
        assert got == pytest.approx(-math.log(area), rel=1e-12)
    assert got == pytest.approx(float(log_vmf_normalizer(torch.tensor(1e-12, dtype=torch.float64), m)), rel=1e-9)


def test_m3_has_the_closed_form_kappa_over_4pi_sinh_kappa():
    kappa = torch.tensor([0.3, 2.0, 30.0], dtype=torch.float64)
    ref = torch.log(kappa / (4 * math.pi * torch.sinh(kappa)))
    torch.testing.assert_close(log_vmf_normalizer(kappa, 3), ref)


@pytest.mark.parametrize("m", [3, 32, 512])
def test_gradient_passes_gradcheck(m):
    kappa = torch.tensor([0.05, 1.3, 17.0, 260.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda k: log_vmf_normalizer(k, m), (kappa,), eps=1e-6, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("m, kappa", [(3, 0.2), (64, 10.0), (512, 3.0), (512, 8000.0)])
def test_gradient_is_minus_the_bessel_ratio(m, kappa):
    k = torch.tensor(kappa, dtype=torch.float64, requires_grad=True)
    log_vmf_normalizer(k, m).backward()
    assert float(k.grad) == pytest.approx(-mp_ratio(kappa, m), rel=1e-9)
    assert float(vmf_mean_resultant_length(k.detach(), m)) == pytest.approx(mp_ratio(kappa, m), rel=1e-9)


def test_log_normalizer_keeps_shape_dtype_and_rejects_bad_input():
    k = torch.rand(2, 3) * 10
    out = log_vmf_normalizer(k, 16)
    assert out.shape == (2, 3) and out.dtype == torch.float32
    with pytest.raises(ValueError, match="kappa"):
        log_vmf_normalizer(torch.tensor([-1.0]), 8)
    with pytest.raises(ValueError, match="kappa"):
        log_vmf_normalizer(torch.tensor([float("nan")]), 8)
    with pytest.raises(ValueError, match="dim"):
        log_vmf_normalizer(torch.tensor([1.0]), 1)


def test_log_prob_integrates_to_one_on_the_circle():
    theta = torch.linspace(-math.pi, math.pi, 20001, dtype=torch.float64)
    x = torch.stack([torch.cos(theta), torch.sin(theta)], 1)
    mu = torch.tensor([0.6, 0.8], dtype=torch.float64)
    dens = vmf_log_prob(x, mu, torch.tensor(4.0, dtype=torch.float64)).exp()
    assert float(torch.trapezoid(dens, theta)) == pytest.approx(1.0, abs=1e-8)


@pytest.mark.parametrize("m, kappa", [(3, 0.0), (3, 2.0), (16, 10.0), (64, 200.0), (512, 1000.0)])
def test_sample_mean_resultant_length_matches_the_bessel_ratio(m, kappa):
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(m, generator=g, dtype=torch.float64)
    x = sample_vmf(mu, kappa, 20000, generator=g)
    assert x.shape == (20000, m)
    torch.testing.assert_close(x.norm(dim=1), torch.ones(20000, dtype=torch.float64))
    cos = x @ (mu / mu.norm())
    expected = float(vmf_mean_resultant_length(torch.tensor(kappa, dtype=torch.float64), m))
    stderr = float(cos.std()) / math.sqrt(20000)
    assert abs(float(cos.mean()) - expected) < 5 * stderr + 1e-12
    # the mean direction is mu: the component orthogonal to mu averages out
    resid = x.mean(0) - cos.mean() * mu / mu.norm()
    assert float(resid.norm()) < (
        6 * math.sqrt(m / 20000) * float((1 - cos**2).mean().sqrt()) / math.sqrt(m - 1) + 1e-9
    )


def test_sampling_a_batch_of_directions_and_concentrations():
    g = torch.Generator().manual_seed(1)
    mu = torch.nn.functional.normalize(torch.randn(3, 8, generator=g), dim=1)
    kappa = torch.tensor([1.0, 30.0, 300.0])
    x = sample_vmf(mu, kappa, 4000, generator=g)
    assert x.shape == (4000, 3, 8) and x.dtype == torch.float32
    means = (x * mu).sum(-1).mean(0)
    torch.testing.assert_close(means, vmf_mean_resultant_length(kappa, 8), atol=0.02, rtol=0)


def test_sampling_is_reproducible_with_a_generator():
    mu = torch.randn(2, 5)
    a = sample_vmf(mu, torch.tensor([3.0, 4.0]), 10, generator=torch.Generator().manual_seed(7))
    b = sample_vmf(mu, torch.tensor([3.0, 4.0]), 10, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_sample_gradient_with_respect_to_mu_is_exact():
    # E[x] = A_M(kappa) mu for unit mu, so d/dmu of the MC mean of (c . x) is A_M (I - mu mu^T) c.
    m, kappa = 6, 5.0
    mu = torch.nn.functional.normalize(torch.randn(m, dtype=torch.float64), dim=0).requires_grad_(True)
    c = torch.randn(m, dtype=torch.float64)
    x = sample_vmf(mu, kappa, 200000, generator=torch.Generator().manual_seed(3))
    (x @ c).mean().backward()
    a = float(vmf_mean_resultant_length(torch.tensor(kappa, dtype=torch.float64), m))
    expected = a * (c - (c @ mu.detach()) * mu.detach())
    torch.testing.assert_close(mu.grad, expected, atol=0.01, rtol=0)


@pytest.mark.parametrize("m, kappa", [(16, 20.0), (64, 200.0)])
def test_sample_gradient_with_respect_to_kappa_is_close_to_the_true_derivative(m, kappa):
    # Documented approximation (reparameterised part only): within 6% of dA_M/dkappa here.
    k = torch.tensor(kappa, dtype=torch.float64, requires_grad=True)
    mu = torch.zeros(m, dtype=torch.float64)
    mu[0] = 1.0
    sample_vmf(mu, k, 100000, generator=torch.Generator().manual_seed(0))[:, 0].mean().backward()
    a = lambda q: float(vmf_mean_resultant_length(torch.tensor(q, dtype=torch.float64), m))
    h = 1e-4 * kappa
    true = (a(kappa + h) - a(kappa - h)) / (2 * h)
    assert float(k.grad) == pytest.approx(true, rel=0.06)


def test_sample_rejects_bad_input():
    with pytest.raises(ValueError, match="kappa"):
        sample_vmf(torch.randn(2, 4), torch.tensor([1.0, 2.0, 3.0]), 5)
    with pytest.raises(ValueError, match="mu"):
        sample_vmf(torch.zeros(4), 1.0, 5)
    with pytest.raises(ValueError, match="kappa"):
        sample_vmf(torch.randn(4), -1.0, 5)
    with pytest.raises(ValueError, match="n_samples"):
        sample_vmf(torch.randn(4), 1.0, 0)
