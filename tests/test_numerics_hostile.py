"""Finite input gives a finite answer or an error naming the argument; dtypes and shapes that used
to crash inside work.

- Heads (DistanceRatioHead, NED) and embedding losses over magnitudes 1e-30..1e30 (and a single
  bit-flipped 3.8e37 coordinate): probabilities / losses / gradients are finite, or a ``ValueError``
  names ``embeddings``; where the method is scale-invariant the answer does not depend on the scale.
- QACT backward in float16/bfloat16, ``QuantileClassifier.forward`` with another input dtype,
  MNIST-C ``canny_edges`` on 3-channel images, ``retrieval_metrics(ks=...)`` with non-integral cut-offs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from shiftguard.corruptions import corrupt
from shiftguard.functional.scaling import normalize_rows
from shiftguard.heads import NED, DistanceRatioHead
from shiftguard.losses import DRLoss, ELKLoss, HIBLoss, MCInfoNCELoss, NivMFProxyLoss, ProxyDRLoss
from shiftguard.losses.probabilistic import split_vmf
from shiftguard.metrics.retrieval import retrieval_metrics
from shiftguard.nn import QuantileActivation, QuantileClassifier

_COMMON = dict(
    deadline=None,
    derandomize=True,
    database=None,
    phases=(Phase.explicit, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
FEW = settings(max_examples=8, **_COMMON)

#: decimal exponents of the scales tried (1e-30 .. 1e30)
EXPONENTS = st.integers(min_value=-30, max_value=30)


def _blobs(n=60, d=6, classes=3, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    centres = torch.randn(classes, d, generator=g, dtype=torch.float64) * 2.0
    x = centres[y] + torch.randn(n, d, generator=g, dtype=torch.float64)
    return x.to(dtype), y


def _finite_or_names_embeddings(fn):
    """Run ``fn``; a ``ValueError`` must name ``embeddings``; otherwise return its result."""
    try:
        return fn()
    except ValueError as exc:
        assert "embeddings" in str(exc), str(exc)
        return None


# -- heads ----------------------------------------------------------------------------------------


@FEW
@given(exp10=EXPONENTS)
def test_distance_ratio_head_is_finite_and_scale_invariant(exp10):
    x, y = _blobs()
    q, _ = _blobs(n=15, seed=1)
    ref = DistanceRatioHead().fit(x, y).predict_proba(q)
    scale = 10.0**exp10
    head = DistanceRatioHead().fit(x * scale, y)
    p = head.predict_proba(q * scale)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(1), torch.ones(15), atol=1e-5, rtol=0)
    torch.testing.assert_close(p, ref, atol=2e-3, rtol=0)  # eq. (6): rho and p do not depend on the scale


@FEW
@given(exp10=EXPONENTS)
def test_ned_is_finite_and_scale_invariant(exp10):
    x, y = _blobs()
    q, _ = _blobs(n=15, seed=1)
    base = NED(k=5).fit(x, y)
    scale = 10.0**exp10
    head = NED(k=5).fit(x * scale, y)
    p = head.predict_proba(q * scale)
    assert np.isfinite(head.temperature_) and head.temperature_ > 0
    assert head.temperature_ == pytest.approx(base.temperature_ * scale**2, rel=1e-3)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p, base.predict_proba(q), atol=2e-3, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "pruned"])
@pytest.mark.parametrize("head_cls", [DistanceRatioHead, NED])
def test_bit_flipped_coordinate_gives_finite_probabilities(head_cls, backend):
    """One 3.8e37 coordinate (a flipped exponent bit) in the support and in a query."""
    x, y = _blobs()
    x[7, 2] = 3.8e37
    q, _ = _blobs(n=10, seed=1)
    q[3, 0] = -3.8e37
    head = head_cls(k=5, backend=backend) if head_cls is NED else head_cls()
    p = head.fit(x, y).predict_proba(q)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(1), torch.ones(10), atol=1e-5, rtol=0)


def test_ned_query_far_from_a_normal_support_goes_to_its_nearest_class():
    x, y = _blobs()
    head = NED(k=5).fit(x, y)
    q = x[:4] * 1e30
    p = head.predict_proba(q)
    assert torch.isfinite(p).all()
    torch.testing.assert_close(p.sum(1), torch.ones(4), atol=1e-5, rtol=0)


# -- losses ---------------------------------------------------------------------------------------


def _loss_and_grad(make, x, y):
    torch.manual_seed(0)
    loss_fn = make()
    e = x.clone().requires_grad_(True)
    loss = loss_fn(e, y)
    loss.backward()
    return loss.detach(), e.grad


LOSSES = {
    "dr": lambda: DRLoss(),
    "dr-sd": lambda: DRLoss(formulation="sd"),
    "dr-proxies": lambda: DRLoss(mode="proxies", num_classes=3, embedding_dim=6),
    "proxydr": lambda: ProxyDRLoss(3, 6),
    "mcinfonce": lambda: MCInfoNCELoss(n_samples=4, generator=torch.Generator().manual_seed(0)),
    "hib": lambda: HIBLoss(n_samples=4, generator=torch.Generator().manual_seed(0)),
    "elk": lambda: ELKLoss(),
    "nivmf": lambda: NivMFProxyLoss(3, 6, n_samples=4, generator=torch.Generator().manual_seed(0)),
}


@pytest.mark.parametrize("name", sorted(LOSSES))
@FEW
@given(exp10=EXPONENTS)
def test_losses_finite_or_refuse_naming_embeddings(name, exp10):
    x, y = _blobs(n=12)
    out = _finite_or_names_embeddings(lambda: _loss_and_grad(LOSSES[name], x * 10.0**exp10, y))
    if out is not None:
        loss, grad = out
        assert torch.isfinite(loss), (name, exp10)
        assert torch.isfinite(grad).all(), (name, exp10)


@pytest.mark.parametrize("scale", [1e18, 1e20, 1e30, 3.8e37])
def test_losses_that_must_compute_at_large_scale(scale):
    """Scale-invariant losses and the vMF losses give finite values and gradients up to float32's top."""
    x, y = _blobs(n=12)
    for name in ("dr", "dr-proxies", "proxydr", "mcinfonce", "hib", "nivmf"):
        loss, grad = _loss_and_grad(LOSSES[name], x * scale, y)
        assert torch.isfinite(loss) and torch.isfinite(grad).all(), (name, scale)


@pytest.mark.parametrize("scale", [1e-2, 1e10, 1e20, 1e30, 3.8e37])
def test_dr_and_proxydr_losses_do_not_depend_on_the_scale(scale):
    """[Kim, Art. II, eq. (6)]: the DR loss is scale-invariant (up to the 1e-10 guard); ProxyDR normalises."""
    x, y = _blobs(n=12)
    for name in ("dr", "proxydr"):
        ref, _ = _loss_and_grad(LOSSES[name], x, y)
        loss, _ = _loss_and_grad(LOSSES[name], x * scale, y)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)


def test_sd_formulation_refuses_an_unrepresentable_loss():
    x, y = _blobs(n=12)
    wrong = torch.arange(12) // 4  # labels across the clusters: -log p ~ d^2 ~ 1e40, beyond float32
    with pytest.raises(ValueError, match="embeddings: values reach"):
        DRLoss(formulation="sd")(x * 1e20, wrong)


def test_elk_refuses_norms_whose_sum_overflows():
    x, y = _blobs(n=12)
    x[0] = 3.0e38
    with pytest.raises(ValueError, match="embeddings"):
        ELKLoss()(x, y)


def test_split_vmf_refuses_an_unrepresentable_norm():
    x = torch.full((2, 64), 3.0e38)
    with pytest.raises(ValueError, match="embeddings: row norms"):
        split_vmf(x)


def test_split_vmf_large_rows_gradcheck():
    """kappa and mu of rows beyond the squaring range (float64 ~1e154) have exact gradients."""
    torch.manual_seed(0)
    u = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    big = 2.0**600
    assert torch.autograd.gradcheck(lambda t: split_vmf(t * big)[0], (u,))
    assert torch.autograd.gradcheck(lambda t: split_vmf(t * big)[1] / big, (u,))


def test_normalize_rows_tiny_rows_gradcheck_and_unit_length():
    torch.manual_seed(0)
    u = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    tiny = 2.0**-200
    assert torch.autograd.gradcheck(lambda t: normalize_rows(t * tiny), (u,))
    out = normalize_rows(torch.randn(5, 4) * 1e-30)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(5))


def test_dr_loss_gradcheck_in_the_widened_path():
    """float32 input beyond the squaring range is computed in float64: gradients match finite differences."""
    x, y = _blobs(n=9)
    x = (x * 1e20).requires_grad_(True)
    loss = DRLoss(learn_rho=False)(x, y)
    (g,) = torch.autograd.grad(loss, x)
    direction = torch.randn_like(x)
    h = 1e17  # relative step 1e-3 of entries of size 1e20
    with torch.no_grad():
        lp = DRLoss(learn_rho=False)(x.double() + h * direction, y)
        lm = DRLoss(learn_rho=False)(x.double() - h * direction, y)
    numeric = float((lp - lm) / (2 * h))
    assert float((g.double() * direction).sum()) == pytest.approx(numeric, rel=1e-2, abs=1e-25)


# -- dtypes and shapes ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_qact_backward_in_half_precision(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 3)
    x_half = x.to(dtype).requires_grad_(True)
    torch.manual_seed(1)  # the KDE samples of the context
    QuantileActivation()(x_half).sum().backward()
    x_ref = x_half.detach().float().requires_grad_(True)
    torch.manual_seed(1)
    QuantileActivation()(x_ref).sum().backward()
    assert x_half.grad.dtype == dtype
    assert torch.isfinite(x_half.grad).all()
    torch.testing.assert_close(x_half.grad.float(), x_ref.grad, rtol=0.05, atol=0.02)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_quantile_classifier_forward_casts_to_its_parameters(dtype):
    torch.manual_seed(0)
    model = QuantileClassifier(5, 3)
    x = torch.randn(40, 5).to(dtype)
    out = model(x)
    assert out.dtype == model.linear.weight.dtype
    torch.testing.assert_close(out, model(x.float()))
    xg = x.clone().requires_grad_(True)
    model(xg).sum().backward()
    assert xg.grad.dtype == dtype


def test_canny_edges_on_three_channel_images():
    torch.manual_seed(0)
    x = torch.rand(2, 3, 28, 28)
    for severity in (1, 3, 5):
        out = corrupt(x, "canny_edges", severity)
        assert out.shape == x.shape
        if severity >= 3:  # edges only: every channel carries the same edge map
            assert torch.equal(out[:, 0], out[:, 1]) and torch.equal(out[:, 1], out[:, 2])


@pytest.mark.parametrize("ks", [(1.7,), (2.0,), (True,), ("1",), 3])
def test_retrieval_ks_must_be_integers(ks):
    x, y = _blobs(n=20)
    with pytest.raises(TypeError, match="ks"):
        retrieval_metrics(x, y, ks=ks)


def test_retrieval_ks_accepts_numpy_integers():
    x, y = _blobs(n=20)
    assert retrieval_metrics(x, y, ks=(np.int64(1), 2)) == retrieval_metrics(x, y, ks=(1, 2))
