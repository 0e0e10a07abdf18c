"""2x2 max pooling (``functional.pool.max_pool2x2``, ``nn.MaxPool2d``) and the adaptive pool's
identity case (``nn.AdaptiveAvgPool2d``): torch's values and gradients, bit for bit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shiftguard import _numba
from shiftguard.functional import pool
from shiftguard.functional.pool import max_pool2x2, max_pool2x2_applies
from shiftguard.models import LeNet5
from shiftguard.nn import AdaptiveAvgPool2d, MaxPool2d

NAN, INF = float("nan"), float("inf")
needs_numba = pytest.mark.skipif(not _numba.AVAILABLE, reason="numba is not installed")


def literal_pool(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each window read element by element in row-major order; an element is taken when it is
    greater than the running maximum or NaN (the rule of torch's CPU kernel), starting from the first."""
    n, c, height, width = x.shape
    vals = torch.empty(n, c, height // 2, width // 2, dtype=x.dtype)
    idx = torch.empty(vals.shape, dtype=torch.long)
    for a in range(n):
        for b in range(c):
            for i in range(height // 2):
                for j in range(width // 2):
                    best, where = None, None
                    for r, s in ((2 * i, 2 * j), (2 * i, 2 * j + 1), (2 * i + 1, 2 * j), (2 * i + 1, 2 * j + 1)):
                        v = float(x[a, b, r, s])
                        if best is None or v > best or math.isnan(v):
                            best, where = v, r * width + s
                    vals[a, b, i, j], idx[a, b, i, j] = best, where
    return vals, idx


def inputs(kind: str, shape, dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=dtype)
    if kind == "ties":
        x = torch.randint(0, 3, shape, generator=gen).to(dtype)
    elif kind == "relu":  # many windows of zeros, the case after a ReLU
        x = x.clamp_min(0)
    elif kind == "nan":
        x[torch.rand(shape, generator=gen) < 0.3] = NAN
    elif kind == "inf":
        x[torch.rand(shape, generator=gen) < 0.5] = -INF
        x[torch.rand(shape, generator=gen) < 0.1] = INF
    return x


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int64)


KINDS = ["randn", "ties", "relu", "nan", "inf"]


@needs_numba
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 3, 6, 8), (1, 2, 7, 5)])
def test_recorded_argmax_is_the_literal_rule_and_torchs(kind, dtype, shape):
    x = inputs(kind, shape, dtype)
    out, idx = pool._with_indices(x)
    want_out, want_idx = literal_pool(x)
    assert torch.equal(idx, want_idx)
    assert torch.equal(bits(out), bits(want_out))
    _, torch_idx = F.max_pool2d(x, 2, return_indices=True)
    assert torch.equal(idx, torch_idx)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(3, 2, 6, 6), (2, 3, 7, 5), (4, 6, 28, 28), (70, 1, 4, 4)])
@pytest.mark.parametrize("grad", [False, True])
def test_values_and_gradients_equal_max_pool2d(kind, dtype, shape, grad):
    x = inputs(kind, shape, dtype, seed=shape[0])
    x1, x2 = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
    want, got = F.max_pool2d(x1, 2), max_pool2x2(x2)
    assert got.shape == want.shape
    assert torch.equal(bits(got.detach()), bits(want.detach()))
    if grad:
        g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
        want.backward(g)
        got.backward(g)
        assert torch.equal(x2.grad, x1.grad)


def test_strided_and_channels_last_inputs():
    x = inputs("ties", (3, 4, 10, 12), torch.float32)
    for view in (x.contiguous(memory_format=torch.channels_last), x[:, ::2, 1:, :-1], x.transpose(2, 3)):
        a, b = view.clone().requires_grad_(), view.clone().requires_grad_()
        assert torch.equal(max_pool2x2(a), F.max_pool2d(b, 2))
        max_pool2x2(a).sum().backward()
        F.max_pool2d(b, 2).sum().backward()
        assert torch.equal(a.grad, b.grad)


def test_gradcheck_and_gradgradcheck_float64():
    x = torch.randn(2, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(max_pool2x2, (x,))
    assert torch.autograd.gradgradcheck(max_pool2x2, (x,))


def test_second_derivative_equals_max_pool2ds():
    x = inputs("ties", (2, 3, 6, 6), torch.float64)
    grads = []
    for fn in (max_pool2x2, lambda t: F.max_pool2d(t, 2)):
        a = x.clone().requires_grad_()
        g = torch.autograd.grad((fn(a) ** 2).sum(), a, create_graph=True)[0]
        grads.append((g, torch.autograd.grad((g**3).sum(), a)[0]))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])


def test_without_numba_the_gradient_path_is_max_pool2d(monkeypatch):
    monkeypatch.setattr(_numba, "AVAILABLE", False)
    calls = []
    monkeypatch.setattr(pool, "_with_indices", lambda x: calls.append(x))
    x = inputs("ties", (2, 3, 6, 6), torch.float32).requires_grad_()
    y = max_pool2x2(x)
    y.sum().backward()
    assert not calls and y.grad_fn is not None
    assert torch.equal(y, F.max_pool2d(x, 2))


def test_applies_only_to_float_cpu_4d_of_two_pixels_or_more():
    assert max_pool2x2_applies(torch.zeros(1, 1, 2, 2))
    assert max_pool2x2_applies(torch.zeros(1, 1, 2, 2, dtype=torch.float64))
    assert not max_pool2x2_applies(torch.zeros(1, 2, 2))  # 3-D
    assert not max_pool2x2_applies(torch.zeros(1, 1, 2, 2, dtype=torch.bfloat16))
    assert not max_pool2x2_applies(torch.zeros(1, 1, 1, 4))
    # and whatever it does not apply to is max_pool2d's: the same result, errors included
    x = torch.randn(3, 4, 6)
    assert torch.equal(max_pool2x2(x), F.max_pool2d(x, 2))
    with pytest.raises(RuntimeError):
        max_pool2x2(torch.zeros(1, 1, 1, 1))
    with pytest.raises(TypeError, match="x"):
        max_pool2x2([[1.0]])


def test_warm_up_checks_dtypes_and_compiles():
    assert pool.warm_up((torch.float32, torch.float64)) >= 0.0
    with pytest.raises(ValueError, match="dtypes"):
        pool.warm_up((torch.int64,))


@pytest.mark.parametrize(
    "kwargs, shape, fast",
    [
        ({"kernel_size": 2}, (2, 3, 8, 8), True),
        ({"kernel_size": (2, 2), "stride": 2}, (2, 3, 7, 9), True),
        ({"kernel_size": 2, "ceil_mode": True}, (2, 3, 8, 6), True),
        ({"kernel_size": 2, "ceil_mode": True}, (2, 3, 7, 7), False),  # ceil and floor differ
        ({"kernel_size": 2, "stride": 1}, (2, 3, 8, 8), False),
        ({"kernel_size": 2, "padding": 1}, (2, 3, 8, 8), False),
        ({"kernel_size": 3}, (2, 3, 9, 9), False),
        ({"kernel_size": 2, "dilation": 2}, (2, 3, 9, 9), False),
    ],
)
def test_module_takes_the_fast_path_only_where_torchs_result_is_the_same(monkeypatch, kwargs, shape, fast):
    calls = []
    real = max_pool2x2
    monkeypatch.setattr("shiftguard.nn.pool.max_pool2x2", lambda x: calls.append(1) or real(x))
    ours, theirs = MaxPool2d(**kwargs), nn.MaxPool2d(**kwargs)
    x = inputs("ties", shape, torch.float32)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    assert torch.equal(ours(a), theirs(b))
    ours(a).sum().backward()
    theirs(b).sum().backward()
    assert torch.equal(a.grad, b.grad)
    assert bool(calls) == fast
    assert isinstance(ours, nn.MaxPool2d) and repr(ours) == repr(theirs)


def test_module_with_indices_is_torchs():
    x = inputs("ties", (2, 2, 6, 6), torch.float32)
    got, want = MaxPool2d(2, return_indices=True)(x), nn.MaxPool2d(2, return_indices=True)(x)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize(
    "size, shape",
    [
        (5, (2, 3, 5, 5)),
        ((5, None), (2, 3, 5, 7)),
        (1, (2, 4, 1, 1)),
        (5, (2, 3, 6, 6)),
        (1, (2, 4, 3, 3)),
        ((None, 2), (3, 5, 4)),
    ],
)
def test_adaptive_pool_equals_torchs(size, shape):
    x = torch.randn(shape).requires_grad_()
    y = x.detach().clone().requires_grad_()
    got, want = AdaptiveAvgPool2d(size)(x), nn.AdaptiveAvgPool2d(size)(y)
    assert torch.equal(bits(got.detach()), bits(want.detach()))
    got.sum().backward()
    want.sum().backward()
    assert torch.equal(x.grad, y.grad)


def test_adaptive_pool_returns_an_input_of_the_output_size_itself():
    x = torch.randn(2, 3, 5, 5)
    assert AdaptiveAvgPool2d(5)(x) is x
    assert AdaptiveAvgPool2d(4)(x) is not x


def _torch_pools(model: nn.Module) -> nn.Module:
    for name, child in model.named_children():
        if isinstance(child, MaxPool2d):
            setattr(model, name, nn.MaxPool2d(child.kernel_size, child.stride, ceil_mode=child.ceil_mode))
        elif isinstance(child, AdaptiveAvgPool2d):
            setattr(model, name, nn.AdaptiveAvgPool2d(child.output_size))
        else:
            _torch_pools(child)
    return model


@pytest.mark.parametrize("activation", ["relu", "qact"])
def test_lenet_trains_exactly_as_with_torchs_pools(activation):
    torch.manual_seed(0)
    ours = LeNet5(activation=activation)
    theirs = _torch_pools(LeNet5(activation=activation))
    theirs.load_state_dict(ours.state_dict())
    assert not any(isinstance(m, (MaxPool2d, AdaptiveAvgPool2d)) for m in theirs.modules())
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(5, 32, 1, 28, 28, generator=gen)
    x[..., :4, :] = 0.0  # blank rows: tied windows
    y = torch.randint(0, 10, (5, 32), generator=gen)
    for model in (ours, theirs):
        torch.manual_seed(1)  # QACT's KDE draws
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.train()
        for xb, yb in zip(x, y):
            opt.zero_grad()
            F.cross_entropy(model(xb), yb).backward()
            opt.step()
    for (name, p), q in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(p, q), name
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        assert torch.equal(ours(x[0]), theirs(x[0]))
