"""QACT under ``torch.compile(fullgraph=True)`` (``backend="aot_eager"``, the CPU): the compiled module,
functional and a small model give the eager results bit for bit -- outputs, input and parameter
gradients, running statistics -- in training and evaluation, because the compiled graph calls the
same kernels through the operator ``torch.ops.shiftguard.qact_forward`` with the
same seed (``docs/qact.md``, "torch.compile"). Every comparison is between two computations of this
run."""

from __future__ import annotations

import pytest
import torch

import shiftguard.functional.quantile as Q
from shiftguard.functional import channel_values, qact_apply, qact_statistics, quantile_activation
from shiftguard.nn import QACTBlock, QuantileActivation

pytest.importorskip("torch._dynamo")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()  # every test compiles its own graphs (no recompile limit carried over)
    yield
    torch._dynamo.reset()


def _compiled(module):
    return torch.compile(module, backend="aot_eager", fullgraph=True)


def _twins(make):
    a = make()
    b = make()
    b.load_state_dict(a.state_dict())
    return a, b


def _step(module, x, seed):
    """Forward (training or not, per the module) and backward of a fixed loss; returns the output,
    the input gradient and every parameter gradient (cleared afterwards)."""
    xi = x.clone().requires_grad_(True)
    torch.manual_seed(seed)
    y = module(xi)
    (y * torch.linspace(-1.0, 2.0, y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return y.detach(), xi.grad, grads


def _assert_same(a, b):
    assert len(a) == len(b)
    for u, v in zip(a, b):
        if isinstance(u, (list, tuple)):
            _assert_same(u, v)
        else:
            assert u.dtype == v.dtype and torch.equal(u, v)


CASES = {
    # name: (input shape, dtype, numba kernels, module keyword arguments)
    "conv-f32": ((16, 4, 5, 5), torch.float32, True, {}),
    "dense-f64-cumulative": ((48, 6), torch.float64, True, {"momentum": None}),
    "dense-f32-fixed-bandwidth": ((40, 5), torch.float32, True, {"bandwidth": 0.5}),
    "conv-f32-eager-torch": ((8, 3, 4, 4), torch.float32, False, {}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_block_trains_and_evaluates_as_the_eager_block(name, monkeypatch):
    shape, dtype, kernels, kwargs = CASES[name]
    monkeypatch.setattr(Q, "USE_COMPILED", kernels)
    torch.manual_seed(0)
    eager, twin = _twins(lambda: QACTBlock(shape[1], **kwargs).to(dtype))
    compiled = _compiled(twin)
    for i in range(2):  # training: batch context, running statistics moved
        x = torch.randn(shape, dtype=dtype) * (1.0 + i)
        _assert_same(_step(eager.train(), x, 10 + i), _step(compiled.train(), x, 10 + i))
    _assert_same(list(eager.state_dict().values()), list(twin.state_dict().values()))
    x = torch.randn(shape, dtype=dtype)
    # evaluation: batch context with and without a gradient, then the frozen context
    _assert_same(_step(eager.eval(), x, 20), _step(compiled.eval(), x, 20))
    with torch.no_grad():
        torch.manual_seed(21)
        want = eager(x)
        torch.manual_seed(21)
        assert torch.equal(want, compiled(x))
    eager.act.context = twin.act.context = "frozen"
    _assert_same(_step(eager.train(), x, 22), _step(compiled.train(), x, 22))
    _assert_same(list(eager.state_dict().values()), list(twin.state_dict().values()))


def test_compiled_functional_with_a_seed_equals_the_eager_functional():
    x = torch.randn(32, 4, 3, dtype=torch.float64)
    stats = qact_statistics(channel_values(torch.randn(64, 4, 3, dtype=torch.float64)))

    def run(fn):
        running = [t.clone() for t in stats]
        xi = x.clone().requires_grad_(True)
        y = fn(xi, running, torch.tensor([123]))
        y.square().sum().backward()
        return [y.detach(), xi.grad, *running]

    def batch(xi, running, seed):
        return quantile_activation(xi, *running, training=True, momentum=0.25, seed=seed)

    def given(xi, running, seed):
        return quantile_activation(xi, *running, training=True, statistics=Q.QACTStatistics(*stats), bandwidth=0.3)

    def apply(xi, running, seed):
        return qact_apply(xi, Q.QACTStatistics(*running))

    for fn in (batch, given, apply):
        want = run(fn)
        torch._dynamo.reset()
        _assert_same(want, run(torch.compile(fn, backend="aot_eager", fullgraph=True)))
    # the seed is the generator's seed
    gen = torch.Generator().manual_seed(123)
    assert torch.equal(quantile_activation(x, generator=gen), quantile_activation(x, seed=torch.tensor([123])))


def test_seed_and_generator_together_are_refused():
    with pytest.raises(ValueError, match="^seed:"):
        quantile_activation(torch.randn(8, 2), seed=torch.tensor([1]), generator=torch.Generator())


def test_the_operator_passes_torch_library_checks():
    x = torch.randn(16, 3, 2)
    seed = torch.tensor([5])
    stats = [t.clone() for t in qact_statistics(channel_values(torch.randn(40, 3, 2)))]
    running = [t.clone() for t in stats]
    n_tau, n_s = stats[0].shape[1], stats[1].shape[1]
    keep = (None, None, None, 0.0, None)
    cases = [
        (x, None, None, None, seed, *keep, 10, 100.0, 50, None, True),
        (x, None, None, None, seed, *running, 0.1, None, n_tau, 100.0, n_s, None, True),
        (x, None, None, None, seed, *running, 0.1, torch.tensor(3), n_tau, 100.0, n_s, None, False),
        (x, *stats, None, *keep, 10, 100.0, 0, 0.5, True),
        (x, None, None, None, seed, *keep, 10, 100.0, 0, None, False),
    ]
    for args in cases:
        # the operator draws from a generator seeded with `seed`: the same result on every call
        # (its gradient is attached outside it, by _TracedQACT: no autograd registration to check)
        torch.library.opcheck(Q._qact_forward_op, args, test_utils=("test_schema", "test_faketensor"))


def test_compiled_lenet_with_qact_trains_as_the_eager_model():
    from shiftguard.models import LeNet5

    torch.manual_seed(0)
    eager, twin = _twins(lambda: LeNet5(activation="qact"))
    compiled = _compiled(twin)
    x = torch.randn(8, 1, 28, 28)
    _assert_same(_step(eager.train(), x, 3), _step(compiled.train(), x, 3))
    _assert_same(list(eager.state_dict().values()), list(twin.state_dict().values()))
    with torch.no_grad():
        torch.manual_seed(4)
        want = eager.eval()(x)
        torch.manual_seed(4)
        assert torch.equal(want, compiled.eval()(x))


def test_lazy_layer_compiles_once_its_statistics_exist():
    layer = QuantileActivation()
    x = torch.randn(16, 3)
    layer(x)  # sizes the statistics (eagerly)
    twin = QuantileActivation(num_features=3)
    twin.load_state_dict(layer.state_dict())
    _assert_same(_step(layer.train(), x, 1), _step(_compiled(twin).train(), x, 1))


def test_the_kde_draws_read_nothing_back_from_a_device():
    """The batch context's draws and Silverman bandwidth run on the device without a read back
    (a synchronisation, refused inside CUDA-graph capture): the drawn rows are sorted by
    construction, so the bandwidth is told so instead of checking. Same draws as on the CPU."""
    from _fake_device import DEVICE, FakeDevice

    from shiftguard.functional.kde import silverman_bandwidth

    ctx = torch.sort(torch.randn(8, 65, generator=torch.Generator().manual_seed(0)), dim=1).values
    n_neg = (ctx < 0).sum(1)
    with FakeDevice() as fd:
        gen = torch.Generator(device=DEVICE).manual_seed(3)
        samples, bw = Q._draw_samples(ctx.to(DEVICE), n_neg.to(DEVICE), 40, gen, None)
        samples, bw = samples.cpu(), bw.cpu()
    assert [h.kind for h in fd.host_reads] == ["copy", "copy"]  # the two .cpu() above, nothing else
    ref_samples, ref_bw = Q._draw_samples(ctx, n_neg, 40, torch.Generator().manual_seed(3), None)
    assert torch.equal(samples, ref_samples) and torch.equal(bw, ref_bw)
    assert torch.equal(bw, silverman_bandwidth(ref_samples))  # the checking path agrees


@pytest.mark.slow
def test_inductor_compiles_qact_whole_and_with_eager_random_draws_gives_the_eager_bits(monkeypatch):
    """``torch.compile``'s default backend (inductor, which generates and compiles C++ on the CPU: slow,
    hence ``slow``): the layer compiles whole (``fullgraph``) in training and evaluation; with
    ``fallback_random`` its seed is torch's eager draw, so the layer's outputs, input gradients and
    running statistics equal the eager layer's bit for bit. In a block the BatchNorms around it are
    fused by inductor (other roundings), so the block is held to training alike, not to equal bits."""
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fallback_random", True)
    torch.manual_seed(0)
    eager, twin = _twins(lambda: QuantileActivation(num_features=4))
    compiled = torch.compile(twin, backend="inductor", fullgraph=True)
    for i in range(2):
        x = torch.randn(16, 4, 3, 3) * (1.0 + i)
        _assert_same(_step(eager.train(), x, 30 + i), _step(compiled.train(), x, 30 + i))
    _assert_same(list(eager.state_dict().values()), list(twin.state_dict().values()))
    _assert_same(_step(eager.eval(), x, 32), _step(compiled.eval(), x, 32))
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager_block, block_twin = _twins(lambda: QACTBlock(4))
    block = torch.compile(block_twin, backend="inductor", fullgraph=True)
    for i in range(2):
        x = torch.randn(16, 4, 3, 3)
        (y0, g0, p0), (y1, g1, p1) = _step(eager_block.train(), x, 40 + i), _step(block.train(), x, 40 + i)
        # the same to rounding, except where a value within rounding of a quantile took the next
        # QACT level (1 / n_tau before the last BatchNorm): rare
        off = (y0 - y1).abs() > 1e-4
        assert off.float().mean() < 0.02, float(off.float().mean())
        torch.testing.assert_close(y1[~off], y0[~off], rtol=0, atol=1e-4)
        # the gradients: the same seed's KDE samples of inputs equal to rounding
        for a, b in zip((g0, *p0), (g1, *p1)):
            assert torch.isfinite(b).all() and torch.cosine_similarity(a.flatten(), b.flatten(), dim=0) > 0.99
    assert int(block_twin.act.num_batches_tracked) == 2
