"""Stage 5: the training pass. Stages 2-4 for one channel at a time with its scratch in cache: the
quantiles, the draws and bandwidth, the grid, the running-statistics update, then every value's
output and density."""

from __future__ import annotations

import math

import numpy as np

from shiftguard._numba import njit
from shiftguard._parallel import parallel_ranges
from shiftguard.functional._qact_cpu.common import _U
from shiftguard.functional._qact_cpu.kde import _channel_grid, _channel_samples, _grid_scratch, _layout, _tallied
from shiftguard.functional._qact_cpu.output import (
    _cell_table,
    _count_few,
    _count_many,
    _density_at,
    _density_on_grid,
    _table_size,
)
from shiftguard.functional._qact_cpu.quantiles import _brackets, _channel_quantiles, _levels, _n_negative
from shiftguard.functional._qact_cpu.sort import _gather_and_sort, _row_range
from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, TRUNCATE


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
def _lerp_row(run, new, m):
    # run += m * (new - run), torch.lerp's formula (the form chosen by the weight), in float64
    # and rounded to run's dtype; new is first rounded to run's dtype (by storing it there), as
    # the module's torch update converts it before the lerp
    for i in range(run.shape[0]):
        a = np.float64(run[i])
        run[i] = new[i]
        b = np.float64(run[i])
        run[i] = a + m * (b - a) if m < 0.5 else b - (b - a) * (1.0 - m)


@njit(nogil=True, cache=True)
def _lerp_rows(c0, c1, run, new, m):
    for c in range(c0, c1):
        _lerp_row(run[c], new[c], m)


@njit(nogil=True, cache=True)
def _batch_channels(
    c0,
    c1,
    ctx,
    x3,
    seed,
    c_bound,
    points_per_bandwidth,
    truncate,
    max_points,
    values_by_count,
    kk,
    ww,
    q_out,
    s_dim,
    samples,
    bandwidth,
    out3,
    dens3,
    momentum,
    run_q,
    run_s,
    run_b,
    fixed_h,
):
    # everything the batch context computes for a channel, one channel at a time with its
    # scratch in cache (no per-pass arrays, no Python between passes): the quantiles
    # (_channel_quantiles), the KDE draws and bandwidth (_channel_samples), the KDE grid
    # (_layout, _channel_grid: the grid of kde_grid, the drawn entries binned once each with
    # their number of draws as weight instead of draw by draw), and every value's output and
    # density (as _counts and _density_at). The caller has checked the values are finite; their
    # range, which the grid must cover, is read off the sorted context row (_row_range). With
    # momentum > 0 the channel's running statistics (run_q, run_s, run_b) move towards its batch
    # statistics while these are in cache. samples: (C, s_dim), or no rows (the samples are not
    # kept). fixed_h > 0: every channel's bandwidth is fixed_h instead of Silverman's (always a
    # float64 argument, 0.0 for Silverman's, so that both share one compiled signature).
    n_dim, c_dim, l_dim = x3.shape
    k_dim = ctx.shape[1]
    n_tau = q_out.shape[1]
    tally = np.empty(k_dim, np.int32)
    through = np.empty(k_dim, np.int32)
    levels = _levels(n_tau)
    n_lut = _table_size(n_tau, n_dim * l_dim)
    start = np.zeros(n_lut + 2, np.int64)
    qp = np.empty(n_tau + 2, np.float64)
    # a grid has at most max_points + 2 nodes (kde.grid_layout: ceil((hi - lo) / delta) <=
    # max_points after rounding, tested) and, as delta >= h /
    # points_per_bandwidth, a half-width of at most ceil(truncate * points_per_bandwidth) (+1
    # for the rounding of h / delta)
    max_half = int(math.ceil(truncate * points_per_bandwidth)) + 1
    scratch = _grid_scratch(max_points + 2, max_half, q_out.dtype)
    row_grid = np.empty(max_points + 2, np.float64)
    # without a samples array to keep them in, each channel's sample is drawn into one row that
    # stays in cache (the (C, S) array is neither written nor read back)
    keep = samples.shape[0] > 0
    own_row = np.empty(0 if keep else s_dim, q_out.dtype)
    for c in range(c0, c1):
        row = ctx[c]
        sample_row = samples[c] if keep else own_row
        nn = _n_negative(row)
        _channel_quantiles(row, nn, levels, kk, ww, q_out[c])
        h = _channel_samples(row, nn, c, s_dim, seed, tally, through, sample_row)
        if fixed_h > 0.0:
            h = fixed_h
        bandwidth[c] = h
        xmin, xmax = _row_range(row, c_bound)
        lo, d, g_dim = _layout(
            np.float64(sample_row[0]),
            np.float64(sample_row[s_dim - 1]),
            h,
            xmin,
            xmax,
            points_per_bandwidth,
            truncate,
            max_points,
        )
        _channel_grid(scratch, row, tally, sample_row, _tallied(k_dim, s_dim), lo, d, h, g_dim, truncate, row_grid)
        if momentum > 0.0:
            _lerp_row(run_q[c], q_out[c], momentum)
            _lerp_row(run_s[c], sample_row, momentum)
            _lerp_row(run_b[c : c + 1], bandwidth[c : c + 1], momentum)
        inv_d = 1.0 / d
        q_lo, inv_w, few = _cell_table(q_out[c], qp, start, n_lut, xmin, xmax)
        g_top = g_dim - 1
        # every value on the grid short of its last node (as a rule: the grid covers the value
        # range unless the draws stop more than 4 h short of it), known from the two ends (the
        # position is monotone in the value): the density without checks or clamps
        on_grid = (xmin - lo) * inv_d >= 0.0 and (xmax - lo) * inv_d < g_top
        # one copy of the loop per (count, density) variant, so that no branch on the variant sits
        # inside it: numba does not unswitch a loop with the choice made per value (the copies
        # differ only in the two inlined functions they call)
        if few and on_grid:
            for n in range(n_dim):
                for loc in range(l_dim):
                    v = x3[n, c, loc]
                    out3[n, c, loc] = values_by_count[_U(_count_few(v, qp, start, q_lo, inv_w, n_lut))]
                    dens3[n, c, loc] = _density_on_grid(v, row_grid, lo, inv_d)
        elif few:
            for n in range(n_dim):
                for loc in range(l_dim):
                    v = x3[n, c, loc]
                    out3[n, c, loc] = values_by_count[_U(_count_few(v, qp, start, q_lo, inv_w, n_lut))]
                    dens3[n, c, loc] = _density_at(v, row_grid, lo, inv_d, g_top)
        else:
            for n in range(n_dim):
                for loc in range(l_dim):
                    v = x3[n, c, loc]
                    out3[n, c, loc] = values_by_count[_U(_count_many(v, qp, start, q_lo, inv_w, n_lut))]
                    dens3[n, c, loc] = _density_at(v, row_grid, lo, inv_d, g_top)


def _sort_and_pass(c0: int, c1: int, ctx: np.ndarray, x3: np.ndarray, seed: int, c_bound: float, *rest) -> None:
    _gather_and_sort(c0, c1, x3, c_bound, ctx)
    _batch_channels(c0, c1, ctx, x3, seed, c_bound, *rest)


def batch_channels(
    x3: np.ndarray,
    ctx: np.ndarray | None,
    c: float,
    n_tau: int,
    n_samples: int,
    seed: int,
    values_by_count: np.ndarray,
    points_per_bandwidth: int = POINTS_PER_BANDWIDTH,
    truncate: float = TRUNCATE,
    max_points: int = 4096,
    running=None,
    keep_samples: bool = True,
    bandwidth: float | None = None,
):
    """Everything the batch context of a layer that needs its gradient computes, in one pass per
    channel: the quantiles (as :func:`grounded_quantiles`), the KDE samples and bandwidths (as
    :func:`grounded_samples` with ``seed``), the KDE grid (as :func:`kde_grid`; the drawn entries
    are binned once each, weighted by their number of draws) and every value's forward output (as
    :func:`counts_output`) and KDE density (what the backward multiplies the gradient by).

    ``x3`` ``(N, C, L)``, ``ctx`` its sorted grounded context with bound ``c``
    (:func:`sorted_grounded_context`), finite (:func:`sorted_context_finite`), ``n_samples >= 1``.
    The grid covers each channel's value range, read off its row of ``ctx`` (``_row_range``).
    ``ctx=None``: ``x3`` is finite (:func:`all_finite`) and each thread sorts the context rows of its
    channels right before their pass (one parallel region, the rows still in cache: no wait for
    every channel's sort, and a thread's sort runs beside the other's pass).

    ``running``: optional ``(momentum, quantiles (C, n_tau), samples (C, S), bandwidth (C,))``,
    writable arrays of ``x3``'s dtype, moved in place towards this batch's statistics as
    ``torch.lerp_`` does (a module's running statistics, updated in the same pass).

    ``keep_samples=False``: the samples are not returned (``None``; each channel's is drawn into a
    row in cache, for the grid and the running update, and dropped).

    ``bandwidth``: a positive float, every channel's KDE bandwidth in place of Silverman's rule
    (rounded to the dtype of ``x3`` first, so that the grid uses the bandwidth stored and returned);
    None: Silverman's rule.

    Returns ``quantiles (C, n_tau)``, ``samples (C, S)``, ``bandwidth (C,)`` (computed in float64,
    stored rounded, as the layer keeps it), and the output and the density, shaped like ``x3``; all
    in the dtype of ``x3``.
    """
    ch = x3.shape[1]
    q = np.empty((ch, n_tau), dtype=x3.dtype)
    samples = np.empty((ch if keep_samples else 0, n_samples), dtype=x3.dtype)
    bw = np.empty(ch, dtype=x3.dtype)
    out = np.empty_like(x3)
    dens = np.empty_like(x3)
    if running is None:
        none = np.empty((0, 0), dtype=x3.dtype)
        m, run_q, run_s, run_b = 0.0, none, none, np.empty(0, dtype=x3.dtype)
    else:
        m, run_q, run_s, run_b = running
    work = x3.size * 8 + ch * n_samples * 64
    k_dim = x3.shape[0] * x3.shape[2] + 2  # the context row: every value of a channel and -c, +c
    fixed_h = 0.0 if bandwidth is None else float(np.asarray(bandwidth, dtype=x3.dtype))
    args = (
        x3,
        seed,
        float(c),
        float(points_per_bandwidth),
        float(truncate),
        int(max_points),
        values_by_count,
        *_brackets(k_dim, n_tau),
        q,
        int(n_samples),
        samples,
        bw,
        out,
        dens,
        float(m),
        run_q,
        run_s,
        run_b,
        fixed_h,
    )
    if ctx is None:
        ctx = np.empty((ch, k_dim), dtype=x3.dtype)
        parallel_ranges(_sort_and_pass, ch, work, ctx, *args, tiered=True)
    else:
        parallel_ranges(_batch_channels, ch, work, ctx, *args)
    return q, samples if keep_samples else None, bw, out, dens


def lerp_rows_(run: np.ndarray, new: np.ndarray, m: float) -> None:
    """``run += m * (new - run)`` in place, rows ``(C, K)`` (``new`` rounded to ``run``'s dtype
    first): the running-statistics update of the fused :func:`batch_channels`, the same arithmetic
    for statistics computed apart (DDP, eager), so both give the same buffers bit for bit."""
    parallel_ranges(_lerp_rows, run.shape[0], run.size * 4, run, new, float(m))
