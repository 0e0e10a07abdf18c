"""QACT [QACT, Alg. 1-2] against a slow, obviously-correct reference written from the algorithm text.

The reference (numpy, one Python loop per channel and per level) follows Alg. 1 literally:
append -c and +c, weight negatives 1/n_- and non-negatives 1/n_+ (zeros non-negative, eq. (8)),
normalise, sort, put the k-th value at the midpoint of its weight step of the weighted CDF,
interpolate linearly at tau_i = i / (n_tau + 1), output (1/n_tau) * sum_i 1[x >= q_i] (eq. (6)).
The backward reference is grad_output * (exact Gaussian KDE of the layer's own KDE samples with
Silverman's bandwidth computed in numpy) (Alg. 2, eq. (7)).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import shiftguard.functional.quantile as quantile_module
from shiftguard.functional import (
    channel_values,
    gaussian_kde,
    gaussian_kde_grid,
    grounding_weights,
    kde_grid_error_bound,
    qact_apply,
    qact_statistics,
    quantile_activation,
    weighted_quantiles,
)
from shiftguard.nn import QACTBlock, QuantileActivation, make_activation


# ----------------------------------------------------------------------------- reference
def ref_quantiles(z: np.ndarray, n_tau: int = 100, c: float = 100.0) -> np.ndarray:
    v = np.concatenate([np.asarray(z, dtype=np.float64), [-c, c]])
    neg = v < 0
    w = np.where(neg, 1.0 / neg.sum(), 1.0 / (~neg).sum())
    w = w / w.sum()
    order = np.argsort(v, kind="stable")
    v, w = v[order], w[order]
    p = np.cumsum(w) - w / 2
    q = []
    for i in range(1, n_tau + 1):
        tau = i / (n_tau + 1)
        if tau < p[0]:
            q.append(v[0])
        elif tau >= p[-1]:
            q.append(v[-1])
        else:
            k = int(np.nonzero(p <= tau)[0][-1])
            t = (tau - p[k]) / (p[k + 1] - p[k])
            q.append(v[k] + t * (v[k + 1] - v[k]))
    return np.array(q)


def ref_qact(x: np.ndarray, n_tau: int = 100, c: float = 100.0) -> np.ndarray:
    """Batch-context QACT of x (N, C, *) with a loop over channels."""
    out = np.empty_like(x, dtype=np.float64)
    for ch in range(x.shape[1]):
        z = x[:, ch].reshape(-1)
        q = ref_quantiles(z, n_tau, c)
        vals = x[:, ch]
        out[:, ch] = np.array([(xv >= q).sum() / n_tau for xv in vals.reshape(-1)]).reshape(vals.shape)
    return out


def ref_silverman(s: np.ndarray) -> float:
    std = s.std(ddof=1)
    iqr = (np.quantile(s, 0.75) - np.quantile(s, 0.25)) / 1.34
    a = min(std, iqr)
    if a <= 0:
        a = std
    if a <= 0:
        a = 1e-3 * max(1.0, np.abs(s).max())
    return 0.9 * a * len(s) ** (-0.2)


def ref_kde(points: np.ndarray, samples: np.ndarray, h: float) -> np.ndarray:
    u = (points[:, None] - samples[None, :]) / h
    return np.exp(-0.5 * u * u).sum(axis=1) / (len(samples) * h * math.sqrt(2 * math.pi))


SHAPES = [(32, 5), (6, 3, 4, 4), (8, 4, 7), (1, 4), (3, 2, 2, 2)]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


# ----------------------------------------------------------------------------- forward
@pytest.mark.parametrize("shape", SHAPES)
def test_forward_matches_reference_exactly_float64(shape):
    x = torch.randn(shape, dtype=torch.float64) * 2
    out = quantile_activation(x, generator=_gen())
    assert out.shape == x.shape and out.dtype == torch.float64
    np.testing.assert_array_equal(out.numpy(), ref_qact(x.numpy()))


@pytest.mark.parametrize("shape", [(64, 6), (8, 3, 5, 5)])
def test_forward_matches_reference_float32(shape):
    x = torch.randn(shape)
    out = quantile_activation(x, generator=_gen())
    assert out.dtype == torch.float32
    # Compare the counts sum_i 1[x >= q_i]: out is count / 100 rounded to float32.
    counts = np.rint(out.double().numpy() * 100)
    np.testing.assert_array_equal(out.numpy(), (counts / 100).astype(np.float32))
    np.testing.assert_array_equal(counts, np.rint(ref_qact(x.numpy().astype(np.float64)) * 100))


@pytest.mark.parametrize(
    "name, values",
    [
        ("constant", lambda: torch.full((20, 3), 0.7, dtype=torch.float64)),
        ("constant_zero", lambda: torch.zeros(10, 2, dtype=torch.float64)),
        ("all_positive", lambda: torch.rand(30, 3, dtype=torch.float64) + 0.1),
        ("all_negative", lambda: -torch.rand(30, 3, dtype=torch.float64) - 0.1),
        ("single_sample", lambda: torch.randn(1, 5, dtype=torch.float64)),
        (
            "ties_and_zeros",
            lambda: torch.tensor([[0.0, 1.0], [0.0, 1.0], [-1.0, 1.0], [2.0, -3.0]], dtype=torch.float64),
        ),
        ("beyond_c", lambda: torch.tensor([[-150.0], [3.0], [250.0]], dtype=torch.float64)),
    ],
)
def test_corner_cases_match_reference(name, values):
    x = values()
    out = quantile_activation(x, generator=_gen())
    np.testing.assert_array_equal(out.numpy(), ref_qact(x.numpy()))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_forward_from_the_sort_equals_searching_every_value(dtype):
    """The batch-context forward reads each value's count off the context sort; it must equal the
    per-value binary search of qact_apply (ties, zeros, values equal to a quantile, beyond +-c)."""
    from shiftguard.functional.quantile import qact_apply, qact_statistics

    g = _gen(3)
    x = torch.randint(-4, 5, (64, 5, 3, 3), generator=g).to(dtype) / 2  # heavy ties on a grid
    x[:, 0] = 0.0
    x[0, 1, 0, 0] = 500.0
    for inp in (x, torch.randn(33, 7, generator=g, dtype=dtype)):
        fast = quantile_activation(inp, generator=_gen(5))
        stats = qact_statistics(inp.transpose(0, 1).reshape(inp.shape[1], -1), generator=_gen(5))
        torch.testing.assert_close(fast, qact_apply(inp, stats), rtol=0, atol=0)


def test_quantiles_match_reference_and_general_weighted_quantiles():
    x = torch.randn(40, 4, dtype=torch.float64)
    stats = qact_statistics(channel_values(x), generator=_gen())
    for ch in range(4):
        np.testing.assert_allclose(stats.quantiles[ch].numpy(), ref_quantiles(x[:, ch].numpy()), rtol=1e-12, atol=1e-10)
    aug = torch.cat([channel_values(x), torch.tensor([[-100.0, 100.0]], dtype=torch.float64).expand(4, 2)], dim=1)
    general = weighted_quantiles(aug, grounding_weights(aug), torch.arange(1, 101, dtype=torch.float64) / 101)
    torch.testing.assert_close(general, stats.quantiles, rtol=1e-12, atol=1e-10)


def test_equal_weights_reduce_to_hazen_quantiles():
    v = torch.randn(3, 50, dtype=torch.float64)
    levels = torch.tensor([0.05, 0.3, 0.5, 0.77, 0.99], dtype=torch.float64)
    got = weighted_quantiles(v, torch.ones_like(v), levels)
    want = np.quantile(v.numpy(), levels.numpy(), axis=1, method="hazen").T
    np.testing.assert_allclose(got.numpy(), want, atol=1e-12)


def test_grounding_gives_each_sign_half_the_weight():
    v = torch.tensor([[-1.0, 0.0, 2.0, 3.0, -100.0, 100.0]])
    w = grounding_weights(v)
    assert float(w[v < 0].sum()) == pytest.approx(0.5)
    assert float(w[v >= 0].sum()) == pytest.approx(0.5)
    assert float(w[0, 1]) == pytest.approx(0.5 / 4)  # zero counts as non-negative (eq. (8))


# ----------------------------------------------------------------------------- backward
@pytest.mark.parametrize("shape", [(64, 3), (4, 2, 6, 6), (5, 3, 9), (1, 3)])
def test_gradient_is_grad_output_times_reference_kde(shape):
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    g = torch.randn(shape, dtype=torch.float64)
    quantile_activation(x, generator=_gen(3)).backward(g)
    stats = qact_statistics(channel_values(x.detach()), generator=_gen(3))  # same samples
    xv = channel_values(x.detach())
    _, spacing = gaussian_kde_grid(xv, stats.samples, stats.bandwidth, return_spacing=True)
    bound = kde_grid_error_bound(stats.bandwidth, spacing)
    want = torch.empty_like(xv)
    for ch in range(xv.shape[0]):
        s = stats.samples[ch].numpy()
        h = ref_silverman(s)
        assert float(stats.bandwidth[ch]) == pytest.approx(h, rel=1e-12)
        want[ch] = torch.from_numpy(ref_kde(xv[ch].numpy(), s, h))
    got = channel_values(x.grad / g)
    # Tolerance: the proven worst-case error of the grid KDE (kde.py docstring), plus rounding.
    tol = bound[:, None] * 1.0001 + 1e-12
    assert ((got - want).abs() <= tol).all(), float(((got - want).abs() - tol).max())
    # ... and the bound is small: (1/256 + 2 e^-8) < 0.46% of the kernel peak phi(0)/h with the
    # default grid (8 nodes per bandwidth, kernel cut at 4 h).
    assert (bound <= 4.6e-3 / (math.sqrt(2 * math.pi) * stats.bandwidth)).all()


def test_grid_kde_close_to_exact_kde_on_wide_ranges():
    torch.manual_seed(1)
    samples, _ = torch.sort(torch.cat([torch.randn(2, 990), torch.full((2, 10), 100.0)], dim=1).double(), dim=1)
    h = torch.tensor([0.05, 0.3], dtype=torch.float64)
    x = torch.linspace(-5, 105, 3000, dtype=torch.float64).expand(2, -1).contiguous()
    fast, spacing = gaussian_kde_grid(x, samples, h, return_spacing=True)
    exact = gaussian_kde(x, samples, h)
    assert ((fast - exact).abs() <= kde_grid_error_bound(h, spacing)[:, None] * 1.0001 + 1e-12).all()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_kde_samples_are_systematic_draws_with_the_grounding_weights(compiled, monkeypatch):
    monkeypatch.setattr(quantile_module, "USE_COMPILED", compiled)
    # 10 negatives and 990 positives (+-100 appended): grounding gives each side half the draws,
    # and systematic sampling draws each entry floor or ceil of S w_k times
    z = torch.cat([-torch.rand(10) - 0.1, torch.rand(990) + 0.1]).double()[:, None].expand(-1, 4).T.contiguous()
    stats = qact_statistics(z, n_samples=5000, generator=_gen(5))
    assert torch.all(stats.samples[:, 1:] >= stats.samples[:, :-1])
    for ch in range(4):
        grounded = torch.cat([z[ch], torch.tensor([-100.0, 100.0], dtype=torch.float64)])
        expected = 5000 * grounding_weights(grounded[None])[0]
        counts = (stats.samples[ch][:, None] == grounded[None, :]).sum(0).double()
        assert int(counts.sum()) == 5000
        assert bool(((counts >= expected.floor()) & (counts <= expected.ceil())).all())
    # unbiased: over many channels (one offset each) the mean count of each entry is S w_k
    row = torch.tensor([-1.0, 0.5, 2.0], dtype=torch.float64)
    stats = qact_statistics(row.expand(20_000, -1).contiguous(), n_samples=7, generator=_gen(6))
    grounded = torch.cat([row, torch.tensor([-100.0, 100.0], dtype=torch.float64)])
    mean_counts = (stats.samples[:, :, None] == grounded).sum(1).double().mean(0)
    want = 7 * grounding_weights(grounded[None])[0]
    assert torch.allclose(mean_counts, want, atol=5 * 0.5 / math.sqrt(20_000))


def test_same_generator_seed_gives_same_gradient():
    x = torch.randn(16, 3, dtype=torch.float64)
    grads = []
    for _ in range(2):
        xi = x.clone().requires_grad_(True)
        quantile_activation(xi, generator=_gen(11)).sum().backward()
        grads.append(xi.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)


def test_module_is_deterministic_given_torch_seed():
    x = torch.randn(16, 3)
    outs = []
    for _ in range(2):
        torch.manual_seed(7)
        xi = x.clone().requires_grad_(True)
        QuantileActivation()(xi).sum().backward()
        outs.append(xi.grad)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


# ----------------------------------------------------------------------------- modes
def test_eval_does_not_change_the_context_mode():
    layer = QuantileActivation()
    layer.eval()
    assert layer.context == "batch"
    x = torch.randn(20, 3)
    torch.testing.assert_close(layer(x), quantile_activation(x))


def test_frozen_mode_uses_stored_statistics_and_batch_mode_updates_them():
    layer = QuantileActivation(momentum=None)
    x = torch.randn(50, 3) * 3 + 1
    layer.train()(x)  # cumulative average after one batch = that batch's statistics
    want = qact_statistics(channel_values(x)).quantiles
    torch.testing.assert_close(layer.running_quantiles, want)
    layer.eval()(x)  # no update in eval
    assert int(layer.num_batches_tracked) == 1
    layer.context = "frozen"
    single = layer(x[:1])
    assert single.shape == (1, 3)
    counts = torch.searchsorted(want, x[:1].T.contiguous(), right=True).T / 100
    torch.testing.assert_close(single, counts.float())


def test_fit_context_and_context_manager():
    ref = torch.randn(200, 2) + 5
    x = torch.randn(4, 2) + 5
    layer = QuantileActivation()
    before = layer(x)
    with layer.context(ref):
        assert layer.context == "frozen"
        inside = layer(x)
        alone = layer(x[1:2])
    assert layer.context == "batch"
    torch.testing.assert_close(layer(x), before)
    # inside the context, each row is judged against ref, not against the 4-row batch
    want = torch.from_numpy(
        np.stack(
            [
                [(xv >= ref_quantiles(ref[:, c].numpy())).sum() / 100 for c, xv in enumerate(row)]
                for row in x.double().numpy()
            ]
        )
    ).float()
    torch.testing.assert_close(inside, want)
    torch.testing.assert_close(alone, inside[1:2])
    layer.fit_context(ref)
    assert layer.context == "frozen"
    torch.testing.assert_close(layer(x), inside)


def test_context_can_be_assigned_and_validated():
    layer = QuantileActivation(context="frozen")
    assert layer.context == "frozen"
    layer.context = "batch"
    assert layer.context == "batch"
    with pytest.raises(ValueError, match="context"):
        layer.context = "test"
    with pytest.raises(ValueError, match="context"):
        QuantileActivation(context="eval")


def test_lazy_statistics_round_trip_through_state_dict():
    a = QuantileActivation()
    a.train()(torch.randn(30, 4))
    b = QuantileActivation()
    b.load_state_dict(a.state_dict())
    torch.testing.assert_close(b.running_quantiles, a.running_quantiles)


# ----------------------------------------------------------------------------- errors, dtypes
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_input_raises(bad):
    x = torch.randn(5, 3)
    x[2, 1] = bad
    with pytest.raises(ValueError, match="input"):
        QuantileActivation()(x)
    with pytest.raises(ValueError, match="input"):
        quantile_activation(x)


def test_one_dimensional_input_raises():
    with pytest.raises(ValueError, match="input"):
        QuantileActivation()(torch.randn(10))


def test_integer_input_raises_type_error():
    with pytest.raises(TypeError, match="input"):
        QuantileActivation()(torch.ones(4, 2, dtype=torch.long))


def test_wrong_channel_count_for_statistics_raises():
    stats = qact_statistics(torch.randn(3, 10))
    with pytest.raises(ValueError, match="stats"):
        qact_apply(torch.randn(4, 2), stats)


# ----------------------------------------------------------------------------- block, factory
@pytest.mark.parametrize("shape", [(8, 4), (8, 4, 5), (8, 4, 3, 3)])
def test_qact_block_accepts_any_rank_and_backpropagates(shape):
    block = QACTBlock(4)
    x = torch.randn(shape, requires_grad=True)
    y = block(x)
    assert y.shape == x.shape
    y.pow(2).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    assert block.bn_in.weight.grad is not None


def test_qact_block_with_explicit_batchnorm_dim():
    block = QACTBlock(3, dim=2)
    assert isinstance(block.bn_in, torch.nn.BatchNorm2d)
    with pytest.raises(ValueError):
        block(torch.randn(4, 3))


@pytest.mark.parametrize(
    "name, cls",
    [
        ("relu", torch.nn.ReLU),
        ("prelu", torch.nn.PReLU),
        ("selu", torch.nn.SELU),
        ("qact", QACTBlock),
        ("QACT", QACTBlock),
    ],
)
def test_make_activation(name, cls):
    assert isinstance(make_activation(name, 6), cls)


def test_make_activation_unknown_name_lists_valid_ones():
    with pytest.raises(
        ValueError,
        match="name: unknown activation 'gelu'; expected one of bn-prelu-bn, bn-relu-bn, "
        "bn-selu-bn, prelu, qact, relu, selu",
    ):
        make_activation("gelu", 4)


def test_functional_boundaries_validate_their_arguments():
    with pytest.raises(ValueError, match="values"):
        qact_statistics(torch.randn(10))
    with pytest.raises(ValueError, match="values"):
        qact_statistics(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="weights"):
        weighted_quantiles(torch.randn(2, 3), torch.ones(2, 4), torch.tensor([0.5]))
    with pytest.raises(ValueError, match="levels"):
        weighted_quantiles(torch.randn(2, 3), torch.ones(2, 3), torch.tensor([1.5]))


# ----------------------------------------------------------------------------- record
# Everything QACT produces in a fixed sequence of calls: outputs, input gradients and the running
# statistics (quantiles, samples, bandwidth, update count) after three training steps, then an
# evaluation forward in batch context (with and without a gradient), a frozen-context forward with a
# gradient, and the functional with an explicit generator. The cases cover (N, C) and (N, C, H, W)
# inputs, float32 and float64, both implementations (compiled CPU kernels and the eager torch code),
# rows short enough for the precomputed quantile brackets and too long for them, draws tallied per
# entry and found one by one, a cumulative average (momentum=None), and running buffers of another
# dtype than the input (their update then runs apart from the fused pass).
#
# Two checks, both portable across CPUs: the sequence run twice in the same process gives the same
# bits (determinism), and two positive summaries of every tensor (its absolute sum and a
# position-weighted absolute sum) match the values recorded here within a relative tolerance that
# bounds the last-bit differences of float arithmetic between instruction sets (torch's vectorised
# kernels round differently with and without AVX-512) while any change of the arithmetic, the
# sampling, the dispatch or the running update moves them far more.
_RECORD_CASES = {
    # name: (shape, dtype, compiled, layer keyword arguments, buffers' dtype)
    "dense-f32": ((64, 8), torch.float32, True, {}, None),
    "dense-f64": ((300, 4), torch.float64, True, {}, None),
    "conv-f32": ((16, 4, 6, 6), torch.float32, True, {}, None),
    "conv-f64-long-rows": ((4, 2, 30, 30), torch.float64, True, {"n_tau": 37}, None),
    "dense-f32-untallied": ((40, 3), torch.float32, True, {"n_samples": 4}, None),
    "dense-f32-cumulative": ((64, 8), torch.float32, True, {"momentum": None}, None),
    "dense-f64-f32-buffers": ((64, 8), torch.float64, True, {}, torch.float32),
    "dense-f32-eager": ((64, 8), torch.float32, False, {}, None),
    "conv-f64-eager": ((16, 4, 6, 6), torch.float64, False, {"momentum": None}, None),
}


def _record(shape, dtype, compiled, kwargs, buffer_dtype, monkeypatch) -> tuple[str, list[float]]:
    """``(sha-256 of every tensor's bytes, [absolute sum, weighted absolute sum] of each tensor)``."""
    import hashlib

    monkeypatch.setattr(quantile_module, "USE_COMPILED", compiled)
    torch.manual_seed(1234)
    digest = hashlib.sha256()
    summary: list[float] = []

    def feed(*tensors):
        for t in tensors:
            digest.update(t.detach().contiguous().cpu().numpy().tobytes())
            a = t.detach().double().abs().flatten()
            summary.extend([float(a.sum()), float((a * torch.linspace(1.0, 2.0, a.numel(), dtype=a.dtype)).sum())])

    layer = QuantileActivation(num_features=shape[1] if buffer_dtype is not None else None, **kwargs)
    if buffer_dtype is not None:
        layer.to(buffer_dtype)

    def step(x, train, grad):
        layer.train(train)
        x = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = layer(x)
        feed(y)
        if grad:
            (y * torch.linspace(-1.0, 2.0, y.numel(), dtype=dtype).reshape(y.shape)).sum().backward()
            feed(x.grad)
        feed(layer.running_quantiles, layer.running_samples, layer.running_bandwidth, layer.num_batches_tracked)

    for i in range(3):
        step(torch.randn(shape, dtype=dtype) * (1.0 + i) + 0.3 * i, train=True, grad=True)
    x = torch.randn(shape, dtype=dtype)
    step(x, train=False, grad=False)
    step(x, train=False, grad=True)
    layer.context = "frozen"
    step(x, train=True, grad=True)
    xf = x.clone().requires_grad_(True)
    y = quantile_activation(
        xf, n_tau=kwargs.get("n_tau", 100), n_samples=kwargs.get("n_samples", 1000), generator=_gen(77)
    )
    y.sum().backward()
    feed(y, xf.grad)
    return digest.hexdigest(), summary


@pytest.mark.parametrize("name", sorted(_RECORD_CASES))
def test_outputs_gradients_and_running_statistics_are_bit_for_bit_the_same_when_computed_twice(name, monkeypatch):
    assert _record(*_RECORD_CASES[name], monkeypatch)[0] == _record(*_RECORD_CASES[name], monkeypatch)[0]


@pytest.mark.parametrize("name", sorted(_RECORD_CASES))
def test_outputs_gradients_and_running_statistics_match_the_recorded_summaries(name, monkeypatch):
    got = _record(*_RECORD_CASES[name], monkeypatch)[1]
    recorded = _RECORD_SUMMARIES[name]
    assert len(got) == len(recorded)
    rtol = 1e-5 if _RECORD_CASES[name][1] == torch.float32 or _RECORD_CASES[name][4] is not None else 1e-9
    for i, (g, r) in enumerate(zip(got, recorded)):
        assert g == pytest.approx(r, rel=rtol, abs=1e-12), f"summary {i} of {name}"


# Recorded on an AMD EPYC (AVX2, no AVX-512), torch 2.13.0.
_RECORD_SUMMARIES: dict[str, list[float]] = {
    "conv-f32": [
        1123.700000025332,
        1688.616526431246,
        513.3330317447144,
        842.4038811042775,
        311.87968070153147,
        467.8444178759478,
        3359.9451946479967,
        5039.9706704663895,
        0.9089021384716034,
        1.3630351026852925,
        1.0,
        1.0,
        1226.7599998898804,
        1837.9072992814372,
        272.9758896531057,
        449.6550432035523,
        342.7243361668661,
        514.0105620236918,
        3785.051435424364,
        5672.121690779291,
        0.994842067360878,
        1.490322376290957,
        2.0,
        2.0,
        1234.8999998494983,
        1853.1297787317187,
        175.7883110039911,
        288.5462377902506,
        403.10558232013136,
        605.5899776160568,
        4515.807887240779,
        6780.911446687825,
        1.171853244304657,
        1.7581694722175598,
        3.0,
        3.0,
        1135.3399998806417,
        1703.7483668268292,
        403.10558232013136,
        605.5899776160568,
        4515.807887240779,
        6780.911446687825,
        1.171853244304657,
        1.7581694722175598,
        3.0,
        3.0,
        1135.3399998806417,
        1703.7483668268292,
        536.0542258932837,
        881.1189762803087,
        403.10558232013136,
        605.5899776160568,
        4515.807887240779,
        6780.911446687825,
        1.171853244304657,
        1.7581694722175598,
        3.0,
        3.0,
        1128.2399985454977,
        1693.4896329767107,
        458.0536508454825,
        752.7768683622138,
        403.10558232013136,
        605.5899776160568,
        4515.807887240779,
        6780.911446687825,
        1.171853244304657,
        1.7581694722175598,
        3.0,
        3.0,
        1135.3399998806417,
        1703.7483668268292,
        651.090526717715,
        975.273615401756,
    ],
    "conv-f64-eager": [
        1154.5800000000002,
        1733.3864785062963,
        533.3596850098515,
        875.6146329043013,
        317.04550217758367,
        478.80978494086094,
        4620.54488677084,
        7011.61212190676,
        0.9177022039815197,
        1.3947071041574028,
        1.0,
        1.0,
        1230.92,
        1845.7379244463743,
        266.85872789996245,
        437.4292897211187,
        472.18907549218164,
        708.2331461864021,
        6146.334177739631,
        9240.508048455613,
        1.3910749396912925,
        2.080654048330839,
        2.0,
        2.0,
        1241.88,
        1866.0964394268346,
        177.16183614386063,
        291.065289785104,
        628.9020766630422,
        946.9075575978129,
        7815.900808671642,
        11766.301276820637,
        1.839648100147591,
        2.7662656663612695,
        3.0,
        3.0,
        1147.4199999999998,
        1719.723321754234,
        628.9020766630422,
        946.9075575978129,
        7815.900808671642,
        11766.301276820637,
        1.839648100147591,
        2.7662656663612695,
        3.0,
        3.0,
        1147.4199999999998,
        1719.723321754234,
        531.8278893984179,
        874.0243482945224,
        628.9020766630422,
        946.9075575978129,
        7815.900808671642,
        11766.301276820637,
        1.839648100147591,
        2.7662656663612695,
        3.0,
        3.0,
        1116.38,
        1673.7238818931828,
        331.0235354608493,
        544.0878204244832,
        628.9020766630422,
        946.9075575978129,
        7815.900808671642,
        11766.301276820637,
        1.839648100147591,
        2.7662656663612695,
        3.0,
        3.0,
        1147.4199999999998,
        1719.723321754234,
        646.0512646171999,
        968.2784265595626,
    ],
    "conv-f64-long-rows": [
        3610.783783783784,
        5413.143875087757,
        1675.8819736994215,
        2755.1210145052164,
        55.37758500633777,
        83.0736969076537,
        1615.00069734487,
        2422.722230440981,
        0.4527201683276727,
        0.6790885439339818,
        1.0,
        1.0,
        3842.3783783783783,
        5766.975334412062,
        821.3751517312559,
        1350.3914054163918,
        61.101758792385475,
        91.77428176153744,
        1777.3889849666805,
        2669.2447377163026,
        0.498960133946708,
        0.7486243191407433,
        2.0,
        2.0,
        3946.108108108108,
        5918.798297811632,
        548.7535964490901,
        902.2373245795495,
        71.73742067351584,
        108.02055535006498,
        2100.423446213096,
        3161.668521074,
        0.5856680003054952,
        0.879055401816728,
        3.0,
        3.0,
        3556.864864864865,
        5335.448906191927,
        71.73742067351584,
        108.02055535006498,
        2100.423446213096,
        3161.668521074,
        0.5856680003054952,
        0.879055401816728,
        3.0,
        3.0,
        3556.864864864865,
        5335.448906191927,
        1681.791939765703,
        2766.6154924042953,
        71.73742067351584,
        108.02055535006498,
        2100.423446213096,
        3161.668521074,
        0.5856680003054952,
        0.879055401816728,
        3.0,
        3.0,
        3526.3513513513512,
        5289.128565153568,
        1442.9280320609216,
        2373.330734222699,
        71.73742067351584,
        108.02055535006498,
        2100.423446213096,
        3161.668521074,
        0.5856680003054952,
        0.879055401816728,
        3.0,
        3.0,
        3556.864864864865,
        5335.448906191927,
        2020.6290744191597,
        3029.644914121607,
    ],
    "dense-f32": [
        244.39000016450882,
        366.6397849872759,
        116.74252027794137,
        191.36560228360182,
        794.0797669095919,
        1193.1054395018377,
        8866.211856223876,
        13319.886510333858,
        1.8315022140741348,
        2.7468674055167606,
        1.0,
        1.0,
        269.1799998469651,
        403.85491168084906,
        62.88885109851253,
        103.39445401479188,
        1010.1185952229425,
        1518.205773807527,
        11712.753660970833,
        17598.368995989716,
        2.0099341720342636,
        3.019746822970254,
        2.0,
        2.0,
        273.209999922663,
        408.7928179456559,
        40.56152395813842,
        66.67995038503307,
        1267.3255931502208,
        1903.6306980575048,
        14897.786143519916,
        22384.580394063072,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        1267.3255931502208,
        1903.6306980575048,
        14897.786143519916,
        22384.580394063072,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        124.61115957092261,
        204.090731017699,
        1267.3255931502208,
        1903.6306980575048,
        14897.786143519916,
        22384.580394063072,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        249.24999960698187,
        373.08471566835993,
        101.69397529779235,
        166.7255221692273,
        1267.3255931502208,
        1903.6306980575048,
        14897.786143519916,
        22384.580394063072,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        149.93198774568737,
        224.1600734585725,
    ],
    "dense-f32-cumulative": [
        244.39000016450882,
        366.6397849872759,
        116.74252027794137,
        191.36560228360182,
        2350.5746548997704,
        3545.715663806437,
        31227.14761957992,
        47046.40869731826,
        2.04044970870018,
        3.056815439036914,
        1.0,
        1.0,
        269.1799998469651,
        403.85491168084906,
        62.88885109851253,
        103.39445401479188,
        2652.52519413922,
        3994.914889889027,
        34279.38880111091,
        51575.560084943994,
        2.828135848045349,
        4.266238646847861,
        2.0,
        2.0,
        273.209999922663,
        408.7928179456559,
        40.56152395813842,
        66.67995038503307,
        2962.4018644355237,
        4454.08172000979,
        37373.95192628726,
        56203.867549095296,
        3.7659806311130524,
        5.693168044090271,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        2962.4018644355237,
        4454.08172000979,
        37373.95192628726,
        56203.867549095296,
        3.7659806311130524,
        5.693168044090271,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        124.61115957092261,
        204.090731017699,
        2962.4018644355237,
        4454.08172000979,
        37373.95192628726,
        56203.867549095296,
        3.7659806311130524,
        5.693168044090271,
        3.0,
        3.0,
        247.5499996729195,
        370.6192362990354,
        72.5266433164361,
        119.14010527485743,
        2962.4018644355237,
        4454.08172000979,
        37373.95192628726,
        56203.867549095296,
        3.7659806311130524,
        5.693168044090271,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        149.93198774568737,
        224.1600734585725,
    ],
    "dense-f32-eager": [
        244.39000016450882,
        366.6397849872759,
        116.72219587047584,
        191.33220628961314,
        794.0798278851435,
        1193.1055474284703,
        8866.177903581876,
        13318.628304109654,
        1.8315022140741348,
        2.7468674055167606,
        1.0,
        1.0,
        269.1799998469651,
        403.85491168084906,
        62.88216739651398,
        103.3834158806738,
        1010.1186910877004,
        1518.205951916392,
        11712.807604921982,
        17605.840660031357,
        2.0099341720342636,
        3.019746822970254,
        2.0,
        2.0,
        273.209999922663,
        408.7928179456559,
        40.57020803738851,
        66.69553014201944,
        1267.3257102053612,
        1903.6309050272891,
        14879.2576439064,
        22359.99781397428,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        1267.3257102053612,
        1903.6309050272891,
        14879.2576439064,
        22359.99781397428,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        124.60393680463312,
        204.0741475513442,
        1267.3257102053612,
        1903.6309050272891,
        14879.2576439064,
        22359.99781397428,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        249.24999960698187,
        373.08471566835993,
        101.69437420897884,
        166.72558056557978,
        1267.3257102053612,
        1903.6309050272891,
        14879.2576439064,
        22359.99781397428,
        2.373107761144638,
        3.5724748075008392,
        3.0,
        3.0,
        252.43999989144504,
        377.9352248170087,
        149.9243026636541,
        224.1528762033621,
    ],
    "dense-f32-untallied": [
        58.54000001959503,
        88.68411763442852,
        26.810319907963276,
        43.80524971792787,
        346.66909654811025,
        520.5758181488527,
        8.934482008218765,
        13.411252219568599,
        1.6255069375038147,
        2.43906706571579,
        1.0,
        1.0,
        60.45000001229346,
        90.3168907971004,
        12.926679928994417,
        21.412233548190432,
        481.35442751226947,
        721.9200950112929,
        10.076456159353256,
        15.22015594081445,
        1.8527660965919495,
        2.7891508042812347,
        2.0,
        2.0,
        56.98000001721084,
        86.69008408045443,
        5.526308369677281,
        9.10339272677744,
        621.2772644432262,
        936.9743468875008,
        30.909630089998245,
        49.26215774904598,
        4.63162487745285,
        7.002244859933853,
        3.0,
        3.0,
        62.02000010386109,
        92.93890768810793,
        621.2772644432262,
        936.9743468875008,
        30.909630089998245,
        49.26215774904598,
        4.63162487745285,
        7.002244859933853,
        3.0,
        3.0,
        62.02000010386109,
        92.93890768810793,
        24.402688625992596,
        39.92473582278194,
        621.2772644432262,
        936.9743468875008,
        30.909630089998245,
        49.26215774904598,
        4.63162487745285,
        7.002244859933853,
        3.0,
        3.0,
        58.80999995581806,
        88.10294109848994,
        16.14741278241854,
        26.466200236976533,
        621.2772644432262,
        936.9743468875008,
        30.909630089998245,
        49.26215774904598,
        4.63162487745285,
        7.002244859933853,
        3.0,
        3.0,
        62.02000010386109,
        92.93890768810793,
        27.11592005752027,
        40.39780156123413,
    ],
    "dense-f64": [
        602.9200000000001,
        905.5512260216848,
        280.85648125115256,
        462.36088671859216,
        311.2487840785796,
        466.77752437572997,
        3469.7021259252206,
        5203.414999033728,
        0.9049606574538974,
        1.3573409602219186,
        1.0,
        1.0,
        633.28,
        954.648623853211,
        140.8937666522085,
        231.96278500572154,
        343.50269653943514,
        515.4964147848145,
        4021.943208301631,
        6034.52234951961,
        0.9978588026873387,
        1.494776507015806,
        2.0,
        2.0,
        646.46,
        970.8146455379483,
        94.09569922649561,
        154.65940344927313,
        403.3023580710444,
        606.1917818524213,
        4835.02128853242,
        7264.768592225319,
        1.1770776593303514,
        1.7648326962327057,
        3.0,
        3.0,
        607.5799999999999,
        913.3762468723937,
        403.3023580710444,
        606.1917818524213,
        4835.02128853242,
        7264.768592225319,
        1.1770776593303514,
        1.7648326962327057,
        3.0,
        3.0,
        607.5799999999999,
        913.3762468723937,
        271.7301698635729,
        446.0150324520097,
        403.3023580710444,
        606.1917818524213,
        4835.02128853242,
        7264.768592225319,
        1.1770776593303514,
        1.7648326962327057,
        3.0,
        3.0,
        605.51,
        910.2097164303586,
        237.28915933113933,
        389.74950763138463,
        403.3023580710444,
        606.1917818524213,
        4835.02128853242,
        7264.768592225319,
        1.1770776593303514,
        1.7648326962327057,
        3.0,
        3.0,
        607.5799999999999,
        913.3762468723937,
        328.03370374695095,
        491.07421152656275,
    ],
    "dense-f64-f32-buffers": [
        255.51999999999998,
        383.82363992172213,
        122.24509933930676,
        200.98847438618844,
        789.8268085774034,
        1184.8114448039187,
        8817.247776128585,
        13217.426037991294,
        1.8171845972537994,
        2.7258203221218924,
        1.0,
        1.0,
        262.12,
        391.00949119373774,
        62.40361402014966,
        102.7919969547612,
        1007.1038836399093,
        1508.3013084364381,
        11655.950764555251,
        17453.870947852818,
        2.028509810566902,
        3.031399667263031,
        2.0,
        2.0,
        277.3,
        410.0638356164383,
        40.74826596637185,
        67.02981749545444,
        1275.6216925960034,
        1903.484484995212,
        14943.710923417471,
        22307.64220360569,
        2.400262176990509,
        3.5868047518389563,
        3.0,
        3.0,
        253.98,
        381.21545988258316,
        1275.6216925960034,
        1903.484484995212,
        14943.710923417471,
        22307.64220360569,
        2.400262176990509,
        3.5868047518389563,
        3.0,
        3.0,
        253.98,
        381.21545988258316,
        122.44432583271404,
        201.52916248960386,
        1275.6216925960034,
        1903.484484995212,
        14943.710923417471,
        22307.64220360569,
        2.400262176990509,
        3.5868047518389563,
        3.0,
        3.0,
        253.64999999999998,
        380.89549902152646,
        100.72890339329604,
        165.84195013901106,
        1275.6216925960034,
        1903.484484995212,
        14943.710923417471,
        22307.64220360569,
        2.400262176990509,
        3.5868047518389563,
        3.0,
        3.0,
        253.98,
        381.21545988258316,
        144.7430734066862,
        217.42093559646935,
    ],
}


# ----------------------------------------------------------------------------- functional contract
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_functional_moves_running_statistics_in_training_only(compiled, grad, monkeypatch):
    # F.batch_norm's contract: in training the running statistics move towards the batch's in place
    # (from zeros with weight 1/2: exactly half the batch's), otherwise they are left alone
    monkeypatch.setattr(quantile_module, "USE_COMPILED", compiled)
    x = torch.randn(48, 5, 3, dtype=torch.float64, requires_grad=grad)
    batch = qact_statistics(channel_values(x.detach()), generator=_gen(4))
    running = [
        torch.zeros(5, 100, dtype=torch.float64),
        torch.zeros(5, 1000, dtype=torch.float64),
        torch.zeros(5, dtype=torch.float64),
    ]
    y = quantile_activation(x, *running, training=True, momentum=0.5, generator=_gen(4))
    assert torch.equal(y, quantile_activation(x.detach(), generator=_gen(4)))
    for got, want in zip(running, batch):
        assert torch.equal(got, 0.5 * want)
    before = [r.clone() for r in running]
    quantile_activation(x, *running, training=False, momentum=0.5, generator=_gen(5))
    assert all(torch.equal(a, b) for a, b in zip(running, before))


def test_functional_frozen_context_applies_the_running_statistics_and_never_moves_them():
    x = torch.randn(32, 4)
    stats = qact_statistics(channel_values(torch.randn(200, 4)), generator=_gen(1))
    running = [t.clone() for t in stats]
    y = quantile_activation(x, *running, training=True, momentum=1.0, context="frozen")
    assert torch.equal(y, qact_apply(x, stats))
    assert all(torch.equal(a, b) for a, b in zip(running, stats))


def test_module_forward_equals_the_functional_with_its_buffers():
    layer = QuantileActivation(num_features=3).train()
    x = torch.randn(40, 3)
    running = [t.clone() for t in (layer.running_quantiles, layer.running_samples, layer.running_bandwidth)]
    torch.manual_seed(9)
    y = layer(x)
    torch.manual_seed(9)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**62, (1,)).item()))  # the layer's own draw
    want = quantile_activation(x, *running, training=True, momentum=0.1, generator=g)
    assert torch.equal(y, want) and int(layer.num_batches_tracked) == 1
    assert torch.equal(layer.running_quantiles, running[0]) and torch.equal(layer.running_samples, running[1])


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"context": "global"}, "context"),
        ({"context": "frozen"}, "running_quantiles"),
        ({"running": (0, 1)}, "running_bandwidth"),
        ({"running": (0, 1, 2), "training": True, "momentum": 1.5}, "momentum"),
        ({"running": (0, 1, 2), "training": True, "n_samples": 7}, "running_samples"),
        ({"statistics_channels": 5}, "statistics"),
        ({"c": -1.0}, "c"),
    ],
)
def test_functional_names_the_argument_it_refuses(kwargs, name):
    x = torch.randn(16, 3)
    full = [torch.zeros(3, 100), torch.zeros(3, 1000), torch.ones(3)]
    kwargs = dict(kwargs)
    given = kwargs.pop("running", ())
    running = [full[i] if i in given else None for i in range(3)]
    if "statistics_channels" in kwargs:
        kwargs["statistics"] = qact_statistics(torch.randn(kwargs.pop("statistics_channels"), 50))
    with pytest.raises(ValueError, match=rf"^{name}:"):
        quantile_activation(x, *running, **kwargs)


def test_functional_momentum_none_is_the_cumulative_average_of_the_given_count():
    """``momentum=None`` with ``num_batches_tracked=n`` moves the running statistics as
    ``momentum=1 / (n + 1)`` does, and without the count it is refused, naming it."""
    from shiftguard.functional import quantile_activation

    x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
    stats = lambda: (torch.zeros(3, 100), torch.zeros(3, 1000), torch.ones(3))
    a, b = stats(), stats()
    quantile_activation(
        x, *a, training=True, momentum=None, num_batches_tracked=torch.tensor(3), seed=torch.tensor([7])
    )
    quantile_activation(x, *b, training=True, momentum=0.25, seed=torch.tensor([7]))
    for u, v in zip(a, b):
        assert torch.equal(u, v)
    with pytest.raises(ValueError, match="^num_batches_tracked:"):
        quantile_activation(x, *stats(), training=True, momentum=None)
