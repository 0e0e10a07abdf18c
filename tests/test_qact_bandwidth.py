"""A fixed KDE bandwidth for QACT's backward (``bandwidth=h``) in place of Silverman's rule.

The forward of QACT [QACT, Alg. 1, eq. (6)] counts quantiles and does not depend on the bandwidth;
the backward [QACT, Alg. 2, eq. (7)] is ``grad_output * f_hat(x)``, the Gaussian KDE of the layer's
KDE samples. With ``bandwidth=h`` the KDE has bandwidth ``h`` in every channel, on the compiled CPU
path (numba) and on the eager torch path alike. Each check compares two computations made in the
same test: the layer's gradient against the exact (slow) KDE of the same samples, one path against
the other, ``bandwidth=h`` against the default.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import shiftguard.functional.quantile as Q
from shiftguard.functional import _qact_cpu as K
from shiftguard.functional import channel_values, kde, qact_apply, qact_statistics, quantile_activation
from shiftguard.models import DenseNet, build_model
from shiftguard.nn import QACTBlock, QuantileActivation, convert_activations, fit_context, make_activation

H = 0.5
PATHS = [pytest.param(True, id="compiled"), pytest.param(False, id="eager")]
SHAPES = [(64, 3), (4, 2, 6, 6)]


@pytest.fixture(params=PATHS)
def compiled(request, monkeypatch):
    """Runs the test on the compiled CPU kernels and on the eager torch code."""
    if request.param and not K.AVAILABLE:
        pytest.skip("numba is not installed: no compiled path")
    monkeypatch.setattr(Q, "USE_COMPILED", request.param)
    return request.param


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def assert_grad_is_exact_kde(grad: torch.Tensor, g: torch.Tensor, x: torch.Tensor, samples: torch.Tensor) -> None:
    """``grad == g * f_hat(x)`` with ``f_hat`` the exact Gaussian KDE of ``samples`` with bandwidth
    ``H``, within the proven error bound of the grid KDE the layer evaluates (kde.py)."""
    xv = channel_values(x.detach()).double()
    s = samples.detach().double()
    h = torch.full((xv.shape[0],), H, dtype=torch.float64)
    exact = kde.gaussian_kde(xv, s, h)
    _, spacing = kde.gaussian_kde_grid(xv, s, h, return_spacing=True)
    bound = kde.kde_grid_error_bound(h, spacing)
    gv = channel_values(g).double()
    got = channel_values(grad).double()
    tol = (bound[:, None] * 1.0001 + 1e-12) * gv.abs()
    assert ((got - gv * exact).abs() <= tol + 1e-15).all(), float(((got - gv * exact).abs() - tol).max())


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize("bad", [0, -0.5, float("nan"), float("inf"), "0.5", True, torch.tensor(0.5)])
def test_bandwidth_must_be_a_positive_finite_number_or_none(bad):
    x = torch.randn(8, 3)
    for call in (
        lambda: QuantileActivation(bandwidth=bad),
        lambda: QACTBlock(3, bandwidth=bad),
        lambda: quantile_activation(x, bandwidth=bad),
        lambda: qact_statistics(x.T, bandwidth=bad),
        lambda: convert_activations(nn.Sequential(nn.Linear(3, 3), nn.ReLU()), bandwidth=bad),
    ):
        with pytest.raises(ValueError, match="^bandwidth: expected a positive finite number or None"):
            call()


def test_bandwidth_is_shown_and_passed_through():
    assert "bandwidth=0.5" in repr(QuantileActivation(bandwidth=0.5))
    assert "bandwidth=None" in repr(QuantileActivation())
    assert QACTBlock(3, bandwidth=2).act.bandwidth == 2.0
    assert make_activation("qact", 3, bandwidth=H).act.bandwidth == H
    net = convert_activations(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), bandwidth=H, example_input=torch.randn(2, 3))
    assert net[1].sites[0].act.bandwidth == H


# ----------------------------------------------------------------------------- forward unchanged
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_and_quantiles_do_not_depend_on_the_bandwidth(shape, dtype, compiled):
    x = torch.randn(shape, dtype=dtype)
    g = torch.randn(shape, dtype=dtype)
    runs = {}
    for bw in (None, H):
        torch.manual_seed(0)  # the layers draw their KDE seeds from the global RNG: the same draws
        layer = QuantileActivation(n_samples=300, bandwidth=bw).train()
        xi = x.clone().requires_grad_(True)
        y = layer(xi)
        y.backward(g)
        with torch.no_grad():
            evaluated = layer.eval()(x)  # batch context without a gradient: no KDE at all
        runs[bw] = (y.detach(), evaluated, layer.running_quantiles.clone(), layer.running_samples.clone(), xi.grad)
    for a, b in zip(runs[None][:4], runs[H][:4]):
        assert torch.equal(a, b)
    assert not torch.equal(runs[None][4], runs[H][4])  # the backward does depend on it


# ----------------------------------------------------------------------------- running bandwidth
def test_running_bandwidth_holds_the_fixed_value(compiled):
    torch.manual_seed(0)
    layer = QuantileActivation(n_samples=200, bandwidth=H, num_features=3).train()
    assert torch.equal(layer.running_bandwidth, torch.full((3,), H))  # from the start
    layer(torch.randn(32, 3, requires_grad=True)).sum().backward()  # the pass that computes the density
    assert torch.equal(layer.running_bandwidth, torch.full((3,), H))
    with torch.no_grad():
        layer(torch.randn(32, 3) * 5)  # a training forward without a gradient
    assert torch.equal(layer.running_bandwidth, torch.full((3,), H))
    assert layer.num_batches_tracked.item() == 2

    lazy = QuantileActivation(n_samples=200, bandwidth=H, momentum=None).train()
    lazy(torch.randn(4, 2, 5, 5, dtype=torch.float64, requires_grad=True)).sum().backward()
    assert torch.equal(lazy.running_bandwidth, torch.full((2,), H, dtype=torch.float64))
    lazy.fit_context(torch.randn(16, 2, 5, 5, dtype=torch.float64))
    assert torch.equal(lazy.running_bandwidth, torch.full((2,), H, dtype=torch.float64))
    stats = lazy.batch_statistics(torch.randn(16, 2, 5, 5, dtype=torch.float64))
    assert torch.equal(stats.bandwidth, torch.full((2,), H, dtype=torch.float64))


def test_default_layer_keeps_silverman_bandwidth(compiled):
    torch.manual_seed(0)
    layer = QuantileActivation(n_samples=200, momentum=1.0).train()
    layer(torch.randn(64, 3, requires_grad=True)).sum().backward()
    # momentum 1: the running statistics are the batch's own
    assert torch.allclose(layer.running_bandwidth, kde.silverman_bandwidth(layer.running_samples), rtol=1e-6)


# ----------------------------------------------------------------------------- gradient = reference
@pytest.mark.parametrize("shape", SHAPES + [(1, 3)])
def test_gradient_is_grad_output_times_the_exact_kde_with_the_fixed_bandwidth(shape, compiled):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(shape, dtype=torch.float64)
    quantile_activation(x, generator=_gen(3), bandwidth=H).backward(g)
    # the samples the layer drew: the same generator seed on the same path
    stats = qact_statistics(channel_values(x.detach()), generator=_gen(3), bandwidth=H)
    assert torch.equal(stats.bandwidth, torch.full((shape[1],), H, dtype=torch.float64))
    assert_grad_is_exact_kde(x.grad, g, x, stats.samples)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_gradient_in_training_is_the_exact_kde_of_its_samples(shape, dtype, compiled):
    torch.manual_seed(5)
    layer = QuantileActivation(n_samples=400, bandwidth=H, momentum=1.0).train()
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    g = torch.randn(shape, dtype=dtype)
    layer(x).backward(g)
    # momentum 1: the running samples are the samples of this batch's KDE
    assert_grad_is_exact_kde(x.grad, g, x, layer.running_samples)


@pytest.mark.parametrize("shape", SHAPES)
def test_frozen_context_gradient_uses_the_fixed_bandwidth(shape, compiled):
    torch.manual_seed(1)
    layer = QuantileActivation(n_samples=300, bandwidth=H).train()
    layer(torch.randn(shape, dtype=torch.float64))
    layer.running_bandwidth.fill_(0.05)  # a stored bandwidth (say, a checkpoint's) is not what is applied
    layer.context = "frozen"
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(shape, dtype=torch.float64)
    layer(x).backward(g)
    assert_grad_is_exact_kde(x.grad, g, x, layer.running_samples)


def test_compiled_and_eager_gradients_agree_with_the_fixed_bandwidth(monkeypatch):
    if not K.AVAILABLE:
        pytest.skip("numba is not installed: no compiled path")
    x = torch.randn(16, 4, 5, 5, dtype=torch.float64)
    g = torch.randn_like(x)
    stats = qact_statistics(channel_values(x), generator=_gen(8), bandwidth=H)
    assert torch.equal(stats.bandwidth, torch.full((4,), H, dtype=torch.float64))
    grads = {}
    for on in (True, False):
        monkeypatch.setattr(Q, "USE_COMPILED", on)
        xi = x.clone().requires_grad_(True)
        qact_apply(xi, stats).backward(g)
        grads[on] = xi.grad
    h = torch.full((4,), H, dtype=torch.float64)
    bound = kde.kde_grid_error_bound(h, h / kde.POINTS_PER_BANDWIDTH)
    diff = channel_values((grads[True] - grads[False]) / g)
    assert (diff.abs() <= 2 * bound[:, None] * 1.0001 + 1e-12).all()
    assert (bound <= 4.6e-3 / (math.sqrt(2 * math.pi) * h)).all()


def test_fixed_and_silverman_bandwidth_share_the_fused_kernels_compiled_variant(monkeypatch):
    # the fused pass takes the fixed bandwidth as a float64 argument either way (0.0: Silverman's
    # rule), so a warm-up with the default compiles what a fixed bandwidth runs
    if not K.AVAILABLE:
        pytest.skip("numba is not installed: no compiled path")
    import numba

    monkeypatch.setattr(Q, "USE_COMPILED", True)
    for bw in (None, H):
        for dtype in (torch.float32, torch.float64):
            x = torch.randn(32, 3, 4, 4, dtype=dtype, requires_grad=True)
            quantile_activation(x, generator=_gen(0), bandwidth=bw).sum().backward()
    signatures = K.fused._batch_channels.signatures
    assert signatures and all(sig[-1] == numba.float64 for sig in signatures)
    assert len({sig[:-1] for sig in signatures}) == len(signatures)


# ----------------------------------------------------------------------------- models
def _small(arch: str, **kw) -> nn.Module:
    if arch == "densenet121":
        return DenseNet(blocks=(1, 1, 1, 1), growth_rate=2, **kw)
    size = {"mlp": {"hidden": (16, 8)}, "resnet18": {"base_width": 4}}.get(arch, {})
    return build_model(arch, **size, **kw)


@pytest.mark.parametrize("arch", ["lenet", "mlp", "resnet18", "vgg11", "densenet121"])
def test_architectures_pass_activation_kwargs_to_every_activation(arch):
    model = _small(arch, activation="qact", activation_kwargs={"bandwidth": H, "n_samples": 50})
    layers = [m for m in model.modules() if isinstance(m, QuantileActivation)]
    assert layers and all(m.bandwidth == H and m.n_samples == 50 for m in layers)
    assert "activation_kwargs={'bandwidth': 0.5, 'n_samples': 50}" in repr(model)
    default = _small(arch, activation="qact")
    assert all(m.bandwidth is None for m in default.modules() if isinstance(m, QuantileActivation))


@pytest.mark.parametrize("arch", ["lenet", "mlp", "resnet18", "vgg11", "densenet121"])
def test_activation_kwargs_an_activation_does_not_take_are_errors_naming_them(arch):
    for act, kwargs in (("relu", {"bandwidth": H}), ("bn-relu-bn", {"bandwidth": H}), ("qact", {"bandwdith": H})):
        with pytest.raises((TypeError, ValueError), match="activation_kwargs"):
            _small(arch, activation=act, activation_kwargs=kwargs)
    with pytest.raises((TypeError, ValueError), match="activation_kwargs"):
        _small(arch, activation="qact", activation_kwargs=[("bandwidth", H)])


def test_build_model_turns_activation_kwargs_errors_into_value_errors():
    with pytest.raises(ValueError, match="^model 'lenet': activation_kwargs: activation 'relu' takes no keyword"):
        build_model("lenet", activation="relu", activation_kwargs={"bandwidth": H})
    with pytest.raises(ValueError, match="bandwidth: expected a positive finite number"):
        build_model("lenet", activation="qact", activation_kwargs={"bandwidth": -1.0})


def test_user_factory_gets_activation_kwargs_through_the_conversion(monkeypatch):
    import sys
    import types

    module = types.ModuleType("bandwidth_factories")
    module.plain = lambda: nn.Sequential(nn.Flatten(), nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 2))
    monkeypatch.setitem(sys.modules, "bandwidth_factories", module)
    x = torch.randn(2, 1, 4, 4)
    model = build_model(
        "bandwidth_factories:plain", activation="qact", example_input=x, activation_kwargs={"bandwidth": H}
    )
    assert [m.bandwidth for m in model.modules() if isinstance(m, QuantileActivation)] == [H]
    with pytest.raises(ValueError, match="activation 'bn-relu-bn': kwargs:"):
        build_model("bandwidth_factories:plain", activation="bn-relu-bn", activation_kwargs={"bandwidth": H})


def test_fit_context_keeps_the_fixed_bandwidth():
    torch.manual_seed(0)
    model = build_model("mlp", activation="qact", hidden=(8,), activation_kwargs={"bandwidth": H, "n_samples": 50})
    fit_context(model, torch.randn(20, 1, 28, 28), batch_size=10)
    layer = next(m for m in model.modules() if isinstance(m, QuantileActivation))
    assert torch.equal(layer.running_bandwidth, torch.full((8,), H)) and layer.context == "frozen"
