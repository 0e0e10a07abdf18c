"""The Triton kernels of QACT in Triton's interpreter, on CPU tensors, against the eager torch code.

Run as a script (``python tests/_qact_triton_checks.py``) by ``tests/test_qact_triton.py``: the
interpreter must be switched on (``TRITON_INTERPRET=1``) before triton is imported, which a test
process that may already have imported triton cannot do. Prints one JSON object: for each check,
``"ok"`` or what differed.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

os.environ["TRITON_INTERPRET"] = "1"

import torch

import shiftguard.functional.quantile as Q
from shiftguard.functional import (
    _qact_triton,
    channel_values,
    gaussian_kde,
    kde_grid_error_bound,
)
from shiftguard.functional.kde import grid_layout

CASES = [((24, 3), torch.float64), ((6, 2, 3, 3), torch.float32), ((5, 2), torch.float32)]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _sorted_context(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sorted grounded context of ``values`` ``(C, M)`` (``c = 100``) and each row's count of
    entries below 0, as the eager code makes them."""
    ctx = torch.sort(Q._grounded(values, 100.0), dim=1).values
    return ctx, torch.searchsorted(ctx, ctx.new_zeros(ctx.shape[0], 1))[:, 0]


def check_grounded_context():
    # the one-launch grounded context equals the eager transposed copy with -c, +c bit for bit,
    # including a c that float32 rounds and a tail shorter than a block
    kern = _qact_triton.kernels()
    for shape, dtype in CASES + [((3, 700, 1), torch.float32), ((1, 1), torch.float64)]:
        x = torch.randn(shape, dtype=dtype)
        for c in (100.0, 0.1, 3.0e38 if dtype == torch.float32 else 1e300):
            got = kern.grounded_context(x, c)
            assert torch.equal(got, Q._grounded(channel_values(x), c)), (shape, dtype, c)


def check_non_finite():
    # the output pass flags NaN and +-inf wherever they fall (first, last, in a partial last block);
    # the Triton forward refuses them by name before the running statistics move, with draws from a
    # seed (the flags' verdict) and from a generator (checked first)
    kern = _qact_triton.kernels()
    for shape, dtype in CASES + [((3, 2, 300), torch.float32)]:
        x = torch.randn(shape, dtype=dtype)
        q = torch.sort(torch.randn(shape[1], 9, dtype=dtype), dim=1).values
        assert bool(kern.levels_and_density(x, q)[2].all())
        for at in (0, x.numel() - 1, x.numel() // 2):
            for bad in (float("nan"), float("inf"), float("-inf")):
                y = x.clone()
                y.view(-1)[at] = bad
                assert not bool(kern.levels_and_density(y, q)[2].all()), (shape, at, bad)
    shape, dtype = CASES[1]
    for at, bad in ((-1, float("nan")), (0, float("-inf"))):
        y = torch.randn(shape, dtype=dtype)
        y.view(-1)[at] = bad
        for draws in (torch.tensor([5]), _gen(5)):
            running = [t.clone() for t in Q.default_statistics(shape[1], 9, 20, dtype)]
            try:
                with np.errstate(all="ignore"):  # (the interpreter computes on the NaN before the verdict)
                    Q._triton_forward(y, None, Q._Running(*running, 0.5), 9, 100.0, 20, draws, True)
            except ValueError as e:
                assert str(e).startswith("input: contains non-finite values"), e
            else:
                raise AssertionError(("not refused", at, bad, type(draws)))
            assert all(torch.equal(a, b) for a, b in zip(running, Q.default_statistics(shape[1], 9, 20, dtype)))


def check_half_precision():
    # a float16 input (bfloat16 takes the same lines) is the float32 path on its values made float32
    # (exactly): the same statistics, density and running update, the output rounded to the half
    # dtype, which is also the eager code's on those values; and with given statistics
    x = torch.randn(6, 2, 3, 3).to(torch.float16)
    runs = [Q._Running(*(t.clone() for t in Q.default_statistics(2, 10, 20)), 0.5) for _ in range(2)]
    got = Q._triton_forward(x, None, runs[0], 10, 100.0, 20, torch.tensor([9]), True)
    want = Q._triton_forward(x.float(), None, runs[1], 10, 100.0, 20, torch.tensor([9]), True)
    assert got.output.dtype == torch.float16 and torch.equal(got.output, want.output.half())
    assert all(torch.equal(a, b) for a, b in zip(got.stats, want.stats))
    assert got.density.dtype == torch.float32 and torch.equal(got.density, want.density)
    assert all(torch.equal(a, b) for a, b in zip(runs[0][:3], runs[1][:3]))
    eager = Q._eager_forward(x.float(), None, None, 10, 100.0, 20, torch.tensor([9]))
    assert torch.equal(got.output, eager.output.half())
    y = torch.randn(5, 2, 3, 3).to(torch.float16)
    a = Q._triton_forward(y, want.stats, None, 10, 100.0, 0, None, True)
    b = Q._triton_forward(y.float(), want.stats, None, 10, 100.0, 0, None, True)
    assert torch.equal(a.output, b.output.half()) and torch.equal(a.density, b.density)


def check_quantiles():
    kern = _qact_triton.kernels()
    for shape, dtype in CASES:
        x = torch.randn(shape, dtype=dtype)
        for n_tau in (7, 100):
            ctx, n_neg = _sorted_context(channel_values(x))
            ch = ctx.shape[0]
            levels = Q.quantile_levels(n_tau, dtype)
            want = Q._grounded_quantiles(ctx, n_neg, levels.expand(ch, -1).contiguous())
            got, got_neg, xmin, xmax = kern.grounded_quantiles(ctx, n_tau, 100.0)
            assert torch.equal(got, want), (shape, dtype, n_tau, (got - want).abs().max())
            assert torch.equal(got_neg, n_neg), (shape, dtype)
            lo, hi = torch.aminmax(channel_values(x), dim=1)
            assert torch.equal(xmin, lo) and torch.equal(xmax, hi), (shape, dtype)
    # the count of entries below 0 at its edges: exact zeros (not below), every entry but +c below
    ctx = torch.tensor([[-100.0, -0.0, 0.0, 0.0, 100.0], [-100.0, -3.0, -2.0, -1e-30, 100.0]])
    assert kern.grounded_quantiles(ctx, 5, 100.0)[1].tolist() == [1, 4]
    # the values' range read off the sorted rows where values reach or pass the bounds (rows of 1-3 values)
    rows = [[3.0], [-100.0], [100.0], [-250.0], [250.0], [100.0, 100.0], [-100.0, -100.0], [-100.0, 100.0]]
    rows += [[-300.0, 300.0], [-100.0, 5.0, 100.0], [120.0, 130.0], [-130.0, -120.0], [-100.0, 250.0]]
    for row in rows:
        values = torch.tensor([row], dtype=torch.float64)
        ctx, _ = _sorted_context(values)
        _, _, xmin, xmax = kern.grounded_quantiles(ctx, 3, 100.0)
        assert (float(xmin), float(xmax)) == (min(row), max(row)), row


def check_forward():
    for shape, dtype in CASES:
        x = torch.randn(shape, dtype=dtype)
        # draws from a generator, and from a seed tensor (the module's on CUDA: comb offsets by
        # SplitMix64 on the device)
        for need, draws in ((False, _gen), (True, _gen), (True, lambda s: torch.tensor([s << 40]))):
            got = Q._triton_forward(x, None, None, 20, 100.0, 50 if need else 0, draws(3), need)
            want = Q._eager_forward(x, None, None, 20, 100.0, 50 if need else 0, draws(3))
            assert torch.equal(got.output, want.output), (shape, dtype)
            assert torch.equal(got.stats.quantiles, want.stats.quantiles), (shape, dtype)
            assert torch.equal(got.stats.samples, want.stats.samples), (shape, dtype)
            torch.testing.assert_close(got.stats.bandwidth, want.stats.bandwidth, rtol=_BW_RTOL[dtype], atol=0)
            assert (got.density is not None) == need


def check_draws():
    # the one-kernel systematic draws against the eager code's, from a seed (the CUDA module's; a
    # negative one wraps as uint64 on both) and from offsets drawn from a generator, down to one
    # draw and a two-entry context
    kern = _qact_triton.kernels()
    cases = [((64, 5), torch.float64, 300), ((6, 3, 4, 4), torch.float32, 1000), ((1, 2), torch.float32, 7)]
    for shape, dtype, n in cases + [((3, 2), torch.float64, 1), ((500, 3), torch.float32, 64)]:
        ctx, n_neg = _sorted_context(channel_values(torch.randn(shape, dtype=dtype)))
        for seed in (torch.tensor([12345]), torch.tensor([2**62 - 1]), torch.tensor([-5])):
            want, want_bw = Q._draw_samples(ctx, n_neg, n, seed, None)
            for silverman in (False, True):
                got, bw = kern.systematic_draws(ctx, n_neg, n, seed=seed, silverman=silverman)
                assert torch.equal(got, want), (shape, int(seed))
                if silverman:  # Silverman's rule in the same program: its sums in another order
                    torch.testing.assert_close(bw, want_bw, rtol=_BW_RTOL[dtype], atol=0)
                else:
                    assert bw is None
        want, _ = Q._draw_samples(ctx, n_neg, n, _gen(3), None)
        offsets = Q._comb_offsets(_gen(3), ctx.shape[0], ctx.device)
        assert torch.equal(kern.systematic_draws(ctx, n_neg, n, offsets=offsets)[0], want), shape
    # the bandwidth's fallbacks: a zero IQR (std), a constant row (1e-3 max(1, |v|)), one sample
    for row in ([0.0] * 6 + [1.0, 2.0], [3.0] * 8, [-2.5]):
        for dtype in (torch.float32, torch.float64):
            ctx, n_neg = _sorted_context(torch.tensor([row], dtype=dtype))
            _, want_bw = Q._draw_samples(ctx, n_neg, len(row), torch.tensor([7]), None)
            _, bw = kern.systematic_draws(ctx, n_neg, len(row), seed=torch.tensor([7]), silverman=True)
            torch.testing.assert_close(bw, want_bw, rtol=_BW_RTOL[dtype], atol=0)
    # beyond the fused size the caller computes it
    ctx, n_neg = _sorted_context(torch.randn(2, 50))
    big = kern.systematic_draws(ctx, n_neg, 4097, seed=torch.tensor([1]), silverman=True)
    assert big[1] is None and big[0].shape == (2, 4097)


#: How far the Triton path's Silverman bandwidth may lie from the eager code's (sums in another order).
_BW_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12}


def check_grid_layout():
    # the KDE stage lays out its grid itself: kde.grid_layout's start, spacing and count bit for bit,
    # for sorted and shuffled samples, including a range wide enough to hit the node cap
    from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, TRUNCATE

    kern = _qact_triton.kernels()
    for dtype in (torch.float32, torch.float64):
        samples = torch.sort(torch.randn(5, 70, dtype=dtype), dim=1).values
        h = torch.rand(5, dtype=dtype) * 0.5 + 0.05
        h[3] = 1e-3  # a spacing of h / 8 would need ~40,000 nodes: capped at 256
        xmin = torch.tensor([-3.0, -1.0, 0.5, -100.0, -2.0], dtype=dtype)
        xmax = torch.tensor([3.0, 0.2, 0.6, 100.0, -1.5], dtype=dtype)
        want = grid_layout(samples.min(1).values, samples.max(1).values, h, xmin, xmax, max_points=256)
        for rows in (samples, samples[:, torch.randperm(70)]):
            _, lo, delta, n = kern.kde_grid(rows, h, xmin, xmax, POINTS_PER_BANDWIDTH, TRUNCATE, 256)
            for got, ref in zip((lo, delta, n), want):
                assert torch.equal(got, ref), (dtype, got, ref)
        assert int(n.max()) <= 258 and int(n[3]) > 200


def check_density():
    for shape, dtype in CASES:
        x = torch.randn(shape, dtype=dtype) * 2
        stats = Q.qact_statistics(
            channel_values(torch.randn(30, shape[1], dtype=dtype)), 10, n_samples=40, generator=_gen(1)
        )
        got = Q._triton_forward(x, stats, None, 10, 100.0, 0, None, True)
        want_out = Q._eager_forward(x, stats, None, 10, 100.0, 0, None)
        assert torch.equal(got.output, want_out.output)
        xs = channel_values(x).double()
        exact = gaussian_kde(xs, stats.samples.double(), stats.bandwidth.double())
        eager = channel_values(Q._density(x, stats, None)).double()
        xmin, xmax = torch.aminmax(xs, dim=1)
        s = stats.samples.double()
        _, delta, _ = grid_layout(s.min(1).values, s.max(1).values, stats.bandwidth.double(), xmin, xmax)
        bound = kde_grid_error_bound(stats.bandwidth.double(), delta)[:, None]
        rounding = 1e-5 if dtype == torch.float32 else 1e-12
        d = channel_values(got.density).double()
        assert ((d - exact).abs() <= bound + rounding * exact.abs().max()).all()
        assert ((d - eager).abs() <= 2 * bound + rounding * exact.abs().max()).all()


def check_gradient_through_the_functional():
    # the whole functional on the Triton path (dispatch opened to CPU tensors here) against the eager code
    real = Q._triton
    for shape, dtype in CASES[:2]:
        x = torch.randn(shape, dtype=dtype)
        g = torch.randn(shape, dtype=dtype)
        results = []
        for use in (True, False):
            Q._triton = (lambda t: True) if use else (lambda t: False)
            Q.USE_COMPILED = False
            try:
                xi = x.clone().requires_grad_(True)
                running = [t.clone() for t in Q.default_statistics(shape[1], 10, 40, dtype)]
                y = Q.quantile_activation(xi, *running, training=True, n_tau=10, n_samples=40, generator=_gen(5))
                y.backward(g)
                results.append((y.detach(), xi.grad, running))
            finally:
                Q._triton = real
                Q.USE_COMPILED = True
        (y1, g1, r1), (y0, g0, r0) = results
        assert torch.equal(y1, y0)
        assert torch.equal(r1[0], r0[0]) and torch.equal(r1[1], r0[1])  # running quantiles, samples
        torch.testing.assert_close(r1[2], r0[2], rtol=_BW_RTOL[dtype], atol=0)  # running bandwidth
        # the gradient is g * density: the two densities within the grid bound of the exact KDE each
        stats = Q.qact_statistics(channel_values(x), 10, n_samples=40, generator=_gen(5))
        xs = channel_values(x).double()
        xmin, xmax = torch.aminmax(xs, dim=1)
        s = stats.samples.double()
        _, delta, _ = grid_layout(s.min(1).values, s.max(1).values, stats.bandwidth.double(), xmin, xmax)
        bound = kde_grid_error_bound(stats.bandwidth.double(), delta)[:, None]
        peak = (1.0 / stats.bandwidth.double())[:, None]
        rounding = 1e-5 if dtype == torch.float32 else 1e-12
        diff = channel_values((g1 - g0).double()).abs()
        assert (diff <= channel_values(g.double()).abs() * (2 * bound + rounding * peak)).all()


CHECKS = {
    f.__name__: f
    for f in (
        check_grounded_context,
        check_quantiles,
        check_draws,
        check_grid_layout,
        check_forward,
        check_density,
        check_non_finite,
        check_half_precision,
        check_gradient_through_the_functional,
    )
}


def main(names) -> int:
    report = {}
    for name in names or CHECKS:
        torch.manual_seed(0)
        try:
            CHECKS[name]()
            report[name] = "ok"
        except Exception:  # report every check's outcome, not just the first failure
            report[name] = traceback.format_exc()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
