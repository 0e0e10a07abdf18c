"""The compiled CPU kernels of QACT (shiftguard.functional._qact_cpu) against the eager torch
implementation they replace and against the slow references (exact KDE, searchsorted, the
sampling law)."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

import shiftguard.functional.quantile as Q
from shiftguard.functional import _qact_cpu as K
from shiftguard.functional import kde
from shiftguard.nn import QuantileActivation

pytestmark = pytest.mark.skipif(
    not K.AVAILABLE, reason="numba is not installed: QACT runs on the eager torch path only"
)

# kernel taps of the default grid: 2 * ceil(truncate * points_per_bandwidth) + 1 (kde.py)
_N_TAPS = 2 * math.ceil(kde.TRUNCATE * kde.POINTS_PER_BANDWIDTH) + 1


def _contexts():
    """(name, x3 (N, C, L)) inputs covering the corner cases of [QACT, Alg. 1] (float64)."""
    g = np.random.default_rng(0)
    yield "normal", g.standard_normal((50, 4, 3))
    yield "ties", g.integers(-3, 4, size=(40, 3, 5)).astype(float)  # many equal values and quantiles
    yield "positive", g.random((30, 2, 1)) + 0.5
    yield "negative", -g.random((30, 2, 1)) - 0.5
    yield "constant", np.full((20, 2, 2), 0.7)
    yield "one sample", g.standard_normal((1, 5, 1))
    yield (
        "beyond c",
        np.concatenate([g.standard_normal((10, 2, 1)), np.full((2, 2, 1), 250.0), np.full((1, 2, 1), -250.0)]),
    )
    yield "zeros", np.concatenate([np.zeros((10, 3, 1)), -np.zeros((5, 3, 1)), g.standard_normal((10, 3, 1))])


def _eager_quantiles(ctx: np.ndarray, n_tau: int) -> torch.Tensor:
    t = torch.from_numpy(ctx)
    levels = Q.quantile_levels(n_tau, t.dtype).expand(t.shape[0], -1).contiguous()
    return Q._grounded_quantiles(t, (t < 0).sum(1), levels)


@pytest.mark.parametrize("n", [256, 300, 13, 1])
@pytest.mark.parametrize("channels", [7, 61])
def test_sorted_context_is_numpy_sort_of_the_grounded_rows(n, channels):
    # up to 256 values only the values are sorted, -c and +c placed after (_place_bounds); longer
    # rows are sorted whole: either way the rows numpy gives, for values beyond, equal to and
    # inside the bounds, infinities and NaN (last). (N, C) inputs are gathered in tiles of 8 x 8
    # (_grounded_context): channel and sample counts that are not multiples of 8, and 61 channels
    # of 256 or more values, which are split into parallel channel ranges (_run)
    g = np.random.default_rng(11)
    x = (g.standard_normal((n, channels, 1)) * 50).astype(np.float32)
    x[:, 0, 0] = -150.0  # all below -c
    x[:, 5, 0] = 150.0  # all above +c
    if n > 8:
        x[0, 1, 0], x[1, 1, 0] = -100.0, 100.0  # equal to the bounds
        x[:5, 2, 0] = [-300.0, -200.0, 250.0, 1e4, -1e4]
        x[3, 3, 0], x[4, 3, 0] = np.inf, -np.inf
        x[7, 4, 0], x[8, 4, 0] = np.nan, 500.0
    got = K.sorted_grounded_context(x, 100.0)
    want = np.sort(np.concatenate([x[:, :, 0].T, np.tile(np.float32([-100.0, 100.0]), (channels, 1))], axis=1), axis=1)
    np.testing.assert_array_equal(got, want)
    if n > 8:
        assert not K.sorted_context_finite(got[3:5]) and K.sorted_context_finite(got[:3])


@pytest.mark.parametrize("brackets", ["table", "computed"])
@pytest.mark.parametrize("case", list(_contexts()), ids=lambda c: c[0])
def test_quantiles_equal_the_eager_implementation(case, brackets, monkeypatch):
    # rows of up to _BRACKETS_MAX_ROW entries look their brackets up in a table (_brackets), longer
    # ones compute them per channel: both must be the eager code's arithmetic
    if brackets == "computed":
        monkeypatch.setattr(K.quantiles, "_BRACKETS_MAX_ROW", 0)
    _, x3 = case
    ctx = K.sorted_grounded_context(np.ascontiguousarray(x3), 100.0)
    want_ctx = np.sort(
        np.concatenate(
            [x3.transpose(1, 0, 2).reshape(x3.shape[1], -1), np.tile([-100.0, 100.0], (x3.shape[1], 1))], axis=1
        ),
        axis=1,
    )
    np.testing.assert_array_equal(ctx, want_ctx)
    for n_tau in (100, 7, 1):
        got = K.grounded_quantiles(ctx, n_tau)
        # float64: the same operations in the same order as the eager code
        np.testing.assert_array_equal(got, _eager_quantiles(ctx, n_tau).numpy())
    # float32: computed in float64 and rounded once, so within one float32 ulp of the float64 value
    q32 = K.grounded_quantiles(ctx.astype(np.float32), 100).astype(np.float64)
    q64 = K.grounded_quantiles(ctx.astype(np.float32).astype(np.float64), 100)
    assert (np.abs(q32 - q64) <= np.spacing(np.abs(q64).astype(np.float32)).astype(np.float64)).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bracket_table_gives_the_computed_quantiles_for_every_negative_count(dtype):
    # every row length 3..40 and every count of negative entries 1..K-1 (-c and +c are always in the
    # row), n_tau 100 and 7: the looked-up brackets give the quantiles bit for bit
    g = np.random.default_rng(5)
    for k_dim in range(3, 41):
        rows = []
        for nn in range(1, k_dim):
            v = np.sort(np.concatenate([-g.random(nn - 1) * 3 - 1e-3, g.random(k_dim - nn - 1) * 3]))
            rows.append(np.concatenate([[-100.0], v, [100.0]]))
        ctx = np.sort(np.array(rows), axis=1).astype(dtype)
        assert ((ctx < 0).sum(1) == np.arange(1, k_dim)).all()
        for n_tau in (100, 7):
            kk, ww = K.quantiles._brackets(k_dim, n_tau)
            assert kk.shape == (k_dim + 1, n_tau)
            got = np.empty((ctx.shape[0], n_tau), dtype)
            K.quantiles._grounded_quantiles(0, ctx.shape[0], ctx, n_tau, kk, ww, got)
            want = np.empty_like(got)
            K.quantiles._grounded_quantiles(0, ctx.shape[0], ctx, n_tau, *K.quantiles._NO_BRACKETS, want)
            np.testing.assert_array_equal(got, want)
    if dtype == np.float64:
        np.testing.assert_array_equal(want, _eager_quantiles(ctx, 7).numpy())


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", list(_contexts()), ids=lambda c: c[0])
def test_counts_equal_searchsorted_of_the_quantiles(case, dtype):
    _, x3 = case
    x3 = np.ascontiguousarray(x3.astype(dtype))
    q = K.grounded_quantiles(K.sorted_grounded_context(x3, 100.0), 100)
    # also query the quantiles themselves (ties between values and quantiles) and values around them
    extra = np.concatenate([q.T, np.nextafter(q, -np.inf).T, np.nextafter(q, np.inf).T])[:, :, None]
    for queries in (x3, np.ascontiguousarray(np.broadcast_to(extra, extra.shape[:2] + (x3.shape[2],)))):
        vbc = Q._values_by_count(100, torch.float32 if dtype == np.float32 else torch.float64)
        out, xmin, xmax = K.counts_output(queries, q, vbc)
        t = torch.from_numpy(queries)
        counts = torch.searchsorted(torch.from_numpy(q), Q.channel_values(t).contiguous(), right=True)
        want = Q._from_channel_values(counts, t).numpy()
        np.testing.assert_array_equal(out, vbc[want])
        np.testing.assert_array_equal(xmin, queries.min(axis=(0, 2)))
        np.testing.assert_array_equal(xmax, queries.max(axis=(0, 2)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_input_is_a_value_error(bad):
    x = torch.randn(8, 3, 4)
    x[2, 1, 3] = bad
    q = np.sort(np.random.default_rng(0).standard_normal((3, 100)), axis=1).astype(np.float32)
    with pytest.raises(ValueError, match="input: contains non-finite values"):
        K.counts_output(Q._as3(x), q, Q._values_by_count(100, torch.float32))
    for context in ("batch", "frozen"):
        layer = QuantileActivation(context=context, num_features=3)
        with pytest.raises(ValueError, match="input: contains non-finite"):
            layer(x)
        assert layer.num_batches_tracked == 0  # nothing stored


def _grounding_weights(row: np.ndarray) -> np.ndarray:
    nn = (row < 0).sum()
    return np.where(row < 0, 0.5 / nn, 0.5 / (row.size - nn))


def test_samples_are_systematic_draws_with_the_grounding_weights():
    # one channel: 3 negatives (-100 appended) and 5 non-negatives (+100 appended)
    row = np.array([[-100.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 100.0]])
    expected = _grounding_weights(row[0])
    for n_samples in (240_000, 1000, 7):
        s, _ = K.grounded_samples(row, n_samples, seed=11)
        assert (np.diff(s[0]) >= 0).all()
        counts = np.array([(s[0] == v).sum() for v in row[0]])
        # stratified: each entry is drawn floor or ceil of S w_k times
        assert ((counts >= np.floor(n_samples * expected)) & (counts <= np.ceil(n_samples * expected))).all()
    # unbiased: over many offsets (one per channel) the mean count is S w_k
    many = np.repeat(row, 20_000, axis=0)
    s, _ = K.grounded_samples(many, 7, seed=3)
    mean_counts = np.array([(s == v).sum(axis=1).mean() for v in row[0]])
    np.testing.assert_allclose(mean_counts, 7 * expected, atol=5 * 0.5 / np.sqrt(20_000))


def _offset(seed: int, channel: int) -> Fraction:
    """The comb offset U of a channel: the top 32 bits of SplitMix64(seed + channel), over 2^32."""
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.uint64(channel)
        z = z * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return Fraction(int(z >> np.uint64(32)), 2**32)


def _reference_draws(row: np.ndarray, channel: int, n_samples: int, seed: int) -> np.ndarray:
    """The draws of grounded_samples written out from the definition, in exact rational arithmetic:
    draw s is the first sorted entry whose cumulative grounding weight P_k exceeds (s + U) / S."""
    u = _offset(seed, channel)
    nn = int((row < 0).sum())
    k_dim = row.size
    out = np.empty(n_samples, row.dtype)
    k = 0
    cum = Fraction(1, 2 * nn)  # P_0
    for s in range(n_samples):
        level = (s + u) / n_samples
        while cum <= level:
            k += 1
            cum = Fraction(k + 1, 2 * nn) if k < nn else Fraction(1, 2) + Fraction(k + 1 - nn, 2 * (k_dim - nn))
        out[s] = row[k]
    return out


@pytest.mark.parametrize(
    "case", list(_contexts()) + [("long", np.random.default_rng(3).standard_normal((9000, 2, 1)))], ids=lambda c: c[0]
)
def test_samples_equal_the_reference_draws(case):
    # covers the tally read-out (an entry drawn more than 4 times: the +-c of one-sided channels)
    # and, for contexts longer than 8 S ("long"), the draws found one by one; the eager code's
    # counts (quantile._comb_counts) give the same sample for the same offsets
    _, x3 = case
    ctx = K.sorted_grounded_context(np.ascontiguousarray(x3), 100.0)
    samples, bw = K.grounded_samples(ctx, 1000, seed=123)
    for ch in range(ctx.shape[0]):
        np.testing.assert_array_equal(samples[ch], _reference_draws(ctx[ch], ch, 1000, 123))
        u = torch.tensor([[float(_offset(123, ch))]], dtype=torch.float64)
        counts = Q._comb_counts(torch.tensor([int((ctx[ch] < 0).sum())]), ctx.shape[1], 1000, u)
        eager = torch.searchsorted(counts, torch.arange(1000)[None], right=True)[0].numpy()
        np.testing.assert_array_equal(samples[ch], ctx[ch][eager])
    np.testing.assert_allclose(bw, kde.silverman_bandwidth(torch.from_numpy(samples)).numpy(), rtol=1e-12)


@pytest.mark.parametrize("ppb, truncate", [(kde.POINTS_PER_BANDWIDTH, kde.TRUNCATE), (16, 6.0)])
def test_grid_layout_equals_the_eager_layout(ppb, truncate):
    g = np.random.default_rng(6)
    n = 400
    smin = g.standard_normal(n) * 3
    smax = smin + g.exponential(2.0, n)
    h = g.exponential(0.3, n) + 1e-6
    xmin = smin + g.standard_normal(n)
    xmax = np.maximum(smax + g.standard_normal(n), xmin)
    h[:20] = 1e-7  # wide ranges in bandwidths: capped at max_points nodes
    lo, delta, nodes = kde.grid_layout(*(torch.from_numpy(a) for a in (smin, smax, h, xmin, xmax)), ppb, truncate)
    for c in range(n):
        got = K.kde._layout(smin[c], smax[c], h[c], xmin[c], xmax[c], float(ppb), truncate, 4096)
        assert got == (lo[c].item(), delta[c].item(), nodes[c].item())
    # ceil((hi - lo) / delta) with delta = (hi - lo) / 4095 rounds to at most 4096: at most 4098
    # nodes, the scratch size of the fused kernel (_batch_channels)
    assert nodes[:20].max().item() <= 4096 + 2


def test_samples_are_deterministic_sorted_and_match_silverman():
    x3 = np.random.default_rng(1).standard_normal((100, 70, 9))
    ctx = K.sorted_grounded_context(x3, 100.0)
    a, bw = K.grounded_samples(ctx, 1000, seed=5)
    b, _ = K.grounded_samples(ctx, 1000, seed=5)
    c, _ = K.grounded_samples(ctx, 1000, seed=6)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert (np.diff(a, axis=1) >= 0).all()
    assert np.isin(a[3], ctx[3]).all()
    np.testing.assert_allclose(bw, kde.silverman_bandwidth(torch.from_numpy(a)).numpy(), rtol=1e-12)


def test_results_do_not_depend_on_the_thread_count():
    x = torch.randn(64, 16, 12, 12)  # large enough to be split over threads
    g = torch.randn_like(x)
    results = []
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            xi = x.clone().requires_grad_(True)
            y = Q.quantile_activation(xi, generator=torch.Generator().manual_seed(0))
            y.backward(g)
            results.append((y, xi.grad))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_results_do_not_depend_on_the_thread_back_end(monkeypatch):
    # torch's OpenMP team (shiftguard._parallel, where available) or the thread-pool fallback
    from shiftguard import _parallel

    x = torch.randn(64, 16, 12, 12)  # large enough to be split over threads
    g = torch.randn_like(x)
    results = []
    for env in (None, "pool"):
        monkeypatch.setattr(_parallel, "_STATE", {})
        if env is None:
            monkeypatch.delenv("SHIFTGUARD_THREADS", raising=False)
        else:
            monkeypatch.setenv("SHIFTGUARD_THREADS", env)
        xi = x.clone().requires_grad_(True)
        y = Q.quantile_activation(xi, generator=torch.Generator().manual_seed(0))
        y.backward(g)
        results.append((_parallel.backend(), y, xi.grad))
    assert results[1][0] == "pool"
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])


def test_grid_equals_the_eager_grid():
    x3 = np.random.default_rng(2).standard_normal((200, 5, 1)) * np.array([0.1, 1.0, 3.0, 10.0, 1.0])[None, :, None]
    ctx = K.sorted_grounded_context(x3, 100.0)
    samples, bw = K.grounded_samples(ctx, 1000, seed=3)
    xmin, xmax = x3.min(axis=(0, 2)), x3.max(axis=(0, 2))
    grid, lo, delta, n_grid = K.kde_grid(samples, bw, xmin, xmax)
    eg, elo, edelta = kde.kde_grid(
        torch.from_numpy(samples), torch.from_numpy(bw), torch.from_numpy(xmin), torch.from_numpy(xmax)
    )
    np.testing.assert_allclose(lo, elo.numpy(), rtol=1e-14)
    np.testing.assert_allclose(delta, edelta.numpy(), rtol=1e-14)
    for c in range(5):
        peak = 1 / (np.sqrt(2 * np.pi) * bw[c])
        np.testing.assert_allclose(grid[c, : n_grid[c]], eg[c, : n_grid[c]].numpy(), rtol=0, atol=1e-12 * peak)


def test_grid_equals_the_eager_grid_on_many_channels():
    # the kernel reuses one table of taps across channels with the same spacing / bandwidth ratio;
    # the half-width (rounding of truncate * h / delta) can still differ between them
    rng = np.random.default_rng(5)
    x3 = rng.standard_normal((150, 96, 1)) * np.exp(rng.uniform(-4, 4, 96))[None, :, None]
    ctx = K.sorted_grounded_context(x3, 100.0)
    samples, bw = K.grounded_samples(ctx, 1000, seed=9)
    xmin, xmax = x3.min(axis=(0, 2)), x3.max(axis=(0, 2))
    grid, lo, delta, n_grid = K.kde_grid(samples, bw, xmin, xmax)
    eg, _, _ = kde.kde_grid(*(torch.from_numpy(a) for a in (samples, bw, xmin, xmax)))
    for c in range(96):
        peak = 1 / (np.sqrt(2 * np.pi) * bw[c])
        np.testing.assert_allclose(grid[c, : n_grid[c]], eg[c, : n_grid[c]].numpy(), rtol=0, atol=1e-12 * peak)


def test_float32_grid_is_the_float64_grid_to_float32_rounding():
    # a float32 layer's grid is convolved in float32: every node is a sum of <= _N_TAPS (65)
    # non-negative products, each rounded a few times, so its relative error is below
    # (_N_TAPS + 4) * 2**-24 (and the node value is at most the kernel peak)
    x3 = np.random.default_rng(6).standard_normal((3000, 8, 1)).astype(np.float32)
    ctx = K.sorted_grounded_context(x3, 100.0)
    samples, bw = K.grounded_samples(ctx, 1000, seed=2)
    xmin, xmax = x3.min(axis=(0, 2)).astype(np.float64), x3.max(axis=(0, 2)).astype(np.float64)
    g32, _, _, n_grid = K.kde_grid(samples, bw, xmin, xmax)
    g64, _, _, _ = K.kde_grid(samples.astype(np.float64), bw, xmin, xmax)
    for c in range(8):
        ref = g64[c, : n_grid[c]]
        assert np.all(np.abs(g32[c, : n_grid[c]] - ref) <= (_N_TAPS + 4) * 2.0**-24 * ref + 1e-12 / bw[c])


@pytest.mark.parametrize("shape", [(64, 3), (4, 2, 6, 6), (300, 5), (1, 3)])
def test_backward_is_grad_times_exact_kde_within_the_grid_bound(shape):
    x = torch.randn(shape, dtype=torch.float64)
    g = torch.randn(shape, dtype=torch.float64)
    stats = Q.qact_statistics(Q.channel_values(x), generator=torch.Generator().manual_seed(4))
    xi = x.clone().requires_grad_(True)
    Q.qact_apply(xi, stats).backward(g)
    xv = Q.channel_values(x)
    exact = kde.gaussian_kde(xv, stats.samples, stats.bandwidth)
    _, spacing = kde.gaussian_kde_grid(xv, stats.samples, stats.bandwidth, return_spacing=True)
    bound = kde.kde_grid_error_bound(stats.bandwidth, spacing)
    got = Q.channel_values(xi.grad)
    want = Q.channel_values(g) * exact
    tol = (bound[:, None] * 1.0001 + 1e-12) * Q.channel_values(g).abs()
    assert ((got - want).abs() <= tol + 1e-15).all()


def test_compiled_and_eager_layers_agree(monkeypatch):
    x = torch.randn(32, 6, 5, 5, dtype=torch.float64)
    g = torch.randn_like(x)
    stats = Q.qact_statistics(Q.channel_values(x), generator=torch.Generator().manual_seed(8))
    outs = {}
    for compiled in (True, False):
        monkeypatch.setattr(Q, "USE_COMPILED", compiled)
        xi = x.clone().requires_grad_(True)
        y = Q.qact_apply(xi, stats)
        y.backward(g)
        outs[compiled] = (y, xi.grad)
        # the batch forward of either path equals the forward with its own statistics
        fwd = Q._forward(x, None, None, 100, 100.0, 0, None, False)
        torch.testing.assert_close(fwd.output, Q.qact_apply(x, fwd.stats), rtol=0, atol=0)
    assert torch.equal(outs[True][0], outs[False][0])
    bound = kde.kde_grid_error_bound(stats.bandwidth, stats.bandwidth / kde.POINTS_PER_BANDWIDTH)
    diff = Q.channel_values((outs[True][1] - outs[False][1]) / g)
    assert (diff.abs() <= 2 * bound[:, None] * 1.0001 + 1e-12).all()


def test_works_in_a_forked_child_after_the_parent_used_threads(run_forked):
    x = torch.randn(64, 16, 12, 12)  # large enough to be split over threads
    Q.quantile_activation(x)

    def child():  # the parent's threads do not exist here; this must not hang
        return Q.quantile_activation(x, generator=torch.Generator().manual_seed(0)).shape == x.shape

    assert run_forked(child, "QACT") == 0


@pytest.mark.parametrize("case", list(_contexts()), ids=lambda c: c[0])
def test_value_range_read_off_the_sorted_context(case):
    _, x3 = case
    for extra in (None, -100.0, 100.0):  # values equal to the grounding bounds too
        v = x3.copy()
        if extra is not None:
            v[0, :, 0] = extra
        ctx = K.sorted_grounded_context(np.ascontiguousarray(v), 100.0)
        assert K.sorted_context_finite(ctx)
        ranges = np.array([K.sort._row_range(row, 100.0) for row in ctx])  # what the fused pass reads
        np.testing.assert_array_equal(ranges[:, 0], v.min(axis=(0, 2)))
        np.testing.assert_array_equal(ranges[:, 1], v.max(axis=(0, 2)))
    v = x3.copy()
    v[-1, 0, 0] = np.nan
    assert not K.sorted_context_finite(K.sorted_grounded_context(np.ascontiguousarray(v), 100.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(64, 3), (40, 4, 6, 6), (1, 3), (3, 2, 40, 40), (128, 20), (16, 5), (2, 7)])
def test_density_computed_in_the_forward_equals_the_separate_backward(shape, dtype):
    # (3, 2, 40, 40): a context longer than 8 S, whose draws are sorted rather than tallied.
    # (128, 20), (16, 5), (2, 7), (1, 3): few values a channel, whose outer quantiles lie beyond
    # the values (the fused pass's count table leaves them out, _cell_table); the forward output
    # is compared exactly with the separate pass, which counts against all quantiles
    x = torch.randn(shape, dtype=dtype)
    g = torch.randn(shape, dtype=dtype)
    fwd = Q._forward(x, None, None, 100, 100.0, 1000, torch.Generator().manual_seed(2), True)
    stats = fwd.stats
    assert fwd.density is not None
    # the same statistics as the separate kernels with the same seed
    ctx = K.sorted_grounded_context(Q._as3(x), 100.0)
    seed = Q._draw_seed(torch.Generator().manual_seed(2))
    samples, bw = K.grounded_samples(ctx, 1000, seed)
    np.testing.assert_array_equal(stats.quantiles.numpy(), K.grounded_quantiles(ctx, 100))
    np.testing.assert_array_equal(stats.samples.numpy(), samples)
    np.testing.assert_array_equal(stats.bandwidth.numpy(), bw.astype(stats.bandwidth.numpy().dtype))
    # the separate path: output and backward from the same statistics
    xi = x.clone().requires_grad_(True)
    y = Q.qact_apply(xi, stats)
    y.backward(g)
    assert torch.equal(fwd.output, y.detach())
    fused = g * fwd.density
    # Same grid layout and interpolation. The fused pass bins each drawn entry once, weighted by
    # its number of draws, where the separate grid bins draw by draw: the float64 bins differ by
    # rounding (~1e-16), so in float64 the two agree to ~1e-13. A float32 layer convolves in
    # float32; each grid is then within the convolution's rounding bound, (_N_TAPS + 4) * 2^-24
    # relative, of the float64 grid, so the two within twice that.
    rtol = 1e-12 if dtype == torch.float64 else 2 * (_N_TAPS + 4) * 2.0**-24
    torch.testing.assert_close(fused, xi.grad, rtol=rtol, atol=1e-12)


def test_fused_density_on_a_grid_capped_at_max_points():
    # a tight cluster and far outliers: the bandwidth is tiny against the range, so the grid is
    # capped at max_points nodes (the fused kernel's scratch size) and coarser than h / kde.POINTS_PER_BANDWIDTH
    g = np.random.default_rng(8)
    v = np.concatenate([g.standard_normal(997) * 1e-4, [-50.0, 40.0, 50.0]])
    x = torch.from_numpy(np.stack([v, g.standard_normal(1000)], axis=1))
    fwd = Q._forward(x, None, None, 100, 100.0, 1000, torch.Generator().manual_seed(1), True)
    stats = fwd.stats
    xi = x.clone().requires_grad_(True)
    Q.qact_apply(xi, stats).backward(torch.ones_like(x))
    torch.testing.assert_close(fwd.density, xi.grad, rtol=1e-12, atol=1e-12)
    xmin, xmax = torch.aminmax(Q.channel_values(x), dim=1)
    _, _, nodes = kde.grid_layout(stats.samples.min(1).values, stats.samples.max(1).values, stats.bandwidth, xmin, xmax)
    assert nodes[0].item() > 4096  # the cap was reached


def test_fused_density_of_values_off_the_grid():
    # 5000 values a channel, one far out at 50: the draws (1000 for ~2500 entries a side) often
    # miss it and stop more than 4 h short of it, where the grid ends: its density is 0, in the
    # fused pass (the loop that checks each value, _density_at) as in the separate backward; the
    # channels whose grid covers every value take the loop without checks (_density_on_grid)
    g = np.random.default_rng(3)
    v = g.standard_normal((5000, 8))
    v[0] = 50.0
    x = torch.from_numpy(v)
    fwd = Q._forward(x, None, None, 100, 100.0, 1000, torch.Generator().manual_seed(1), True)
    stats = fwd.stats
    xi = x.clone().requires_grad_(True)
    y = Q.qact_apply(xi, stats)
    y.backward(torch.ones_like(x))
    assert torch.equal(fwd.output, y.detach())
    torch.testing.assert_close(fwd.density, xi.grad, rtol=1e-12, atol=1e-12)
    xmin, xmax = torch.aminmax(Q.channel_values(x), dim=1)
    lo, delta, nodes = kde.grid_layout(
        stats.samples.min(1).values, stats.samples.max(1).values, stats.bandwidth, xmin, xmax
    )
    off = xmax > lo + (nodes - 1) * delta
    assert off.any() and not off.all()  # both loops ran
    assert (fwd.density[0][off] == 0).all()


def test_non_finite_input_with_gradient_is_a_value_error():
    x = torch.randn(16, 3)
    x[4, 2] = float("nan")
    with pytest.raises(ValueError, match="input: contains non-finite values"):
        Q.quantile_activation(x.requires_grad_(True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("momentum", [0.1, 0.7, None])
def test_running_statistics_moved_in_the_fused_pass_equal_the_torch_update(momentum, dtype):
    # a layer whose input needs a gradient updates its running statistics inside the fused pass;
    # one whose input does not takes the separate kernels (same statistics for the same seed) and
    # then the separate update (_running_lerp): the same buffers, bit for bit
    a = QuantileActivation(momentum=momentum).to(dtype)
    b = QuantileActivation(momentum=momentum).to(dtype)
    g = torch.Generator().manual_seed(0)
    for step in range(3):
        x = torch.randn(80, 6, dtype=dtype, generator=g) * (step + 1)
        torch.manual_seed(10 + step)
        a(x.clone().requires_grad_(True))
        torch.manual_seed(10 + step)
        b(x)
    assert int(a.num_batches_tracked) == int(b.num_batches_tracked) == 3
    for name in ("running_quantiles", "running_samples", "running_bandwidth"):
        got, want = getattr(a, name), getattr(b, name)
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not torch.equal(a.running_samples, QuantileActivation(num_features=6).running_samples.to(dtype))


@pytest.mark.parametrize("shape", [(256, 40, 1), (13, 61, 1), (1, 9, 1), (30, 5, 4)])
def test_pass_that_sorts_its_own_rows_equals_the_pass_on_the_sorted_context(shape):
    # batch_channels(ctx=None), the route of an (N, C) input: each thread sorts its channels' rows
    # right before their pass; the same statistics, outputs, densities and running buffers
    g = np.random.default_rng(4)
    x3 = (g.standard_normal(shape) * 3).astype(np.float32)
    vbc = Q._values_by_count(100, torch.float32)
    got, want = [], []
    for ctx, into in ((None, got), (K.sorted_grounded_context(x3, 100.0), want)):
        run = (
            0.3,
            np.ones((shape[1], 100), np.float32),
            np.ones((shape[1], 1000), np.float32),
            np.ones(shape[1], np.float32),
        )
        into.extend(K.batch_channels(x3, ctx, 100.0, 100, 1000, 11, vbc, running=run, keep_samples=False))
        into.extend(run[1:])
    assert got[1] is None and want[1] is None  # (samples not kept)
    for a, b in zip(got, want):
        if a is not None:
            np.testing.assert_array_equal(a, b)


def test_running_statistics_of_another_dtype_are_moved_after_the_pass():
    # buffers the fused pass cannot update in place (float64 buffers, float32 input) are moved by
    # the separate update from the kept samples; buffers of the input's dtype inside the pass, and
    # then the samples are not kept. Either way the dispatch moves them: the same statistics
    x = torch.randn(40, 3)
    buffers = (
        torch.zeros(3, 100, dtype=torch.float64),
        torch.zeros(3, 1000, dtype=torch.float64),
        torch.ones(3, dtype=torch.float64),
    )
    apart = Q._forward(x, None, Q._Running(*buffers, 0.5), 100, 100.0, 1000, torch.Generator().manual_seed(1), True)
    assert apart.stats.samples.shape == (3, 1000)
    same = (torch.zeros(3, 100), torch.zeros(3, 1000), torch.ones(3))
    in_pass = Q._forward(x, None, Q._Running(*same, 0.5), 100, 100.0, 1000, torch.Generator().manual_seed(1), True)
    assert in_pass.stats.samples.shape == (3, 0)
    # lerp from 0 with weight 1/2: exact in either dtype
    assert torch.equal(buffers[1], 0.5 * apart.stats.samples.double())
    assert torch.equal(same[1], 0.5 * apart.stats.samples)
    assert torch.equal(in_pass.stats.quantiles, apart.stats.quantiles)
    assert torch.equal(in_pass.stats.bandwidth, apart.stats.bandwidth)
    assert torch.equal(in_pass.output, apart.output) and torch.equal(in_pass.density, apart.density)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("m", [0.1, 0.5, 0.9, 1.0])
def test_running_update_follows_torch_lerp(m, dtype):
    # the compiled update computes torch.lerp's formula in float64 and rounds once: within one
    # rounding of torch's own lerp_, and exact at the ends (m = 1 gives the new value)
    g = torch.Generator().manual_seed(3)
    buf = torch.randn(7, 300, dtype=dtype, generator=g) * 10
    new = torch.randn(7, 300, dtype=torch.float64, generator=g) * 10
    want = buf.clone().lerp_(new.to(dtype), m)
    Q._running_lerp(buf, new, m)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(buf, want, rtol=2 * eps, atol=2 * eps * float(want.abs().max()))
    if m == 1.0:
        assert torch.equal(buf, new.to(dtype))


def test_frozen_context_gradient_is_the_fused_product_rounded_once():
    """With given statistics the forward hands the backward a float64 density, so a float32
    gradient is ``grad * density`` computed in float64 and rounded once: the bits of the kernels'
    fused product (``kde_density_times``), not a product of two roundings."""
    import numpy as np

    from shiftguard.functional._qact_cpu import kde_density_times
    from shiftguard.nn import QuantileActivation

    gen = torch.Generator().manual_seed(0)
    act = QuantileActivation(3)
    act.train()
    act(torch.randn(256, 3, 4, 4, generator=gen))
    act.context = "frozen"
    x = torch.randn(64, 3, 4, 4, generator=gen).requires_grad_()
    g = torch.randn(64, 3, 4, 4, generator=gen)
    act(x).backward(g)
    x3, g3 = x.detach().reshape(64, 3, 16).numpy(), g.reshape(64, 3, 16).numpy()
    lo, hi = x3.min(axis=(0, 2)).astype(np.float64), x3.max(axis=(0, 2)).astype(np.float64)
    samples = act.running_samples.to(torch.float32).numpy()
    expected = kde_density_times(x3, g3, samples, act.running_bandwidth.to(torch.float32).double().numpy(), lo, hi)
    assert torch.equal(x.grad, torch.from_numpy(expected).reshape(x.shape))
