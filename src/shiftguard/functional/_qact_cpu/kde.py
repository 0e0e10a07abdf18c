"""Stage 4: the KDE of the backward [QACT, Alg. 2]: the ``S`` systematic draws with the grounding weights
and Silverman's bandwidth, and the grid KDE of :mod:`shiftguard.functional.kde` (linear binning, a
direct convolution with the Gaussian kernel truncated at ``TRUNCATE * h``) per channel."""

from __future__ import annotations

import math

import numpy as np
import torch

from shiftguard._numba import njit, splitmix64
from shiftguard._parallel import parallel_ranges
from shiftguard.functional._qact_cpu.common import _S32, _U, _U1
from shiftguard.functional._qact_cpu.output import _density_at
from shiftguard.functional._qact_cpu.quantiles import _n_negative
from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, TRUNCATE, grid_layout


@njit(inline="always")
def _sorted_quantile(srt, level):
    # linear-interpolation quantile of a sorted row (kde._sorted_quantile)
    p = level * (srt.shape[0] - 1)
    lo = int(math.floor(p))
    hi = min(lo + 1, srt.shape[0] - 1)
    return np.float64(srt[lo]) + (p - lo) * (np.float64(srt[hi]) - np.float64(srt[lo]))


@njit(inline="always")
def _tallied(k_dim, s_dim):
    # whether the draws of a context of k_dim entries are tallied per entry (else each draw's
    # entry is found on its own)
    return k_dim <= 8 * s_dim


# (a function of its own, not inlined: "reassoc" lets the compiler split the sum into vector
# lanes, and only here. The sum's rounding then differs from the strict IEEE order by ~1e-15
# relative, far inside the tests' 1e-12 against the eager bandwidth)
@njit(fastmath={"reassoc"}, nogil=True, cache=True)
def _tally_moment(row, tally, centre, square):
    # sum_k tally[k] * (row[k] - centre) (or its square), in float64
    total = 0.0
    for k in range(row.shape[0]):
        d = np.float64(row[k]) - centre
        if square:
            d = d * d
        total += tally[k] * d
    return total


@njit(inline="always")
def _comb_offset(seed, c):
    # the offset U in [0, 1) of channel c's comb: 32 random bits of SplitMix64(seed + c), exact in
    # float64 (U = r / 2^32)
    return np.float64(splitmix64(np.uint64(seed) + np.uint64(c)) >> _S32) * (1.0 / 4294967296.0)


@njit(inline="always")
def _comb_count(k, nn, k_dim, s_dim, u):
    # c_k = #{s : (s + U) / S < P_k} = ceil(S P_k - U): the draws on sorted entries 0..k, with
    # P_k the cumulative grounding weight through entry k, S P_k = S (k + 1) / (2 n_-) for a
    # negative entry, S / 2 + S (k + 1 - n_-) / (2 n_+) for a non-negative one (float64, these
    # operations in this order; monotone in k); c_-1 = 0, c_{K-1} = S. (quantile._comb_counts:
    # the same arithmetic in torch; the tally loops below inline it per side.)
    if k < 0:
        return 0
    if k >= k_dim - 1:
        return s_dim
    s_f = np.float64(s_dim)
    if k < nn:
        a = (s_f * (k + 1)) / (2.0 * nn)
    else:
        a = 0.5 * s_f + (s_f * (k + 1 - nn)) / (2.0 * (k_dim - nn))
    return int(math.ceil(a - u))


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
def _channel_samples(row, nn, c, s_dim, seed, tally, through, out_row):
    # the S points of one sorted grounded context row drawn with the grounding weights by
    # systematic sampling (quantile.py, "Sampling"), written sorted to out_row; returns
    # Silverman's bandwidth. When _tallied, tally[:k_dim] holds the number of draws of each
    # entry afterwards. tally, through: k_dim int32 scratch.
    k_dim = row.shape[0]
    npos = k_dim - nn
    u = _comb_offset(seed, c)
    if not _tallied(k_dim, s_dim):
        # long context: draw s lies on the entry k with c_{k-1} <= s < c_k; its position in the
        # grounded CDF gives k to within rounding, then the counts decide (monotone in k)
        total = 0.0
        for s in range(s_dim):
            p = 2.0 * (s + u) / s_dim
            if p < 1.0:
                k = int(p * nn)
            else:
                k = nn + int((p - 1.0) * npos)
            k = min(max(k, 0), k_dim - 1)
            while k > 0 and _comb_count(k - 1, nn, k_dim, s_dim, u) > s:
                k -= 1
            while _comb_count(k, nn, k_dim, s_dim, u) <= s:
                k += 1
            v = row[k]
            out_row[s] = v
            total += np.float64(v)
        mean = total / s_dim
        ss = 0.0
        for s in range(s_dim):
            d = np.float64(out_row[s]) - mean
            ss += d * d
    else:
        # the tally c_k - c_{k-1} of every entry: the counts c_k (_comb_count, one vectorised
        # loop per side, into `through`), then their differences (a running difference in the
        # same loop is a carried dependency, which is not vectorised). np.ceil, not math.ceil:
        # math.ceil's int64 result has no AVX2 vector conversion, np.ceil's float does (to int32;
        # the same counts); likewise the entry's index goes to float64 from int32, not int64
        s_f = np.float64(s_dim)
        half = 0.5 * s_f
        for k in range(nn):
            through[k] = np.int32(np.ceil((s_f * np.int32(k + 1)) / (2.0 * nn) - u))
        for k in range(nn, k_dim - 1):  # (k unsigned: see _U)
            through[_U(k)] = np.int32(np.ceil(half + (s_f * np.int32(k + 1 - nn)) / (2.0 * npos) - u))
        through[k_dim - 1] = s_dim
        tally[0] = through[0]
        for k in range(1, k_dim):
            tally[k] = through[k] - through[k - 1]
        # the sorted sample: entry k repeated tally[k] times, written straight into out_row.
        # Four copies are stored whatever the tally (the next entries overwrite the extra ones),
        # so the common case has no branch; the entries within 4 cells of the end take exact
        # stores (out_row has no spare cells, and a scratch row would cost a copy)
        # (pos is unsigned: see _U)
        pos = _U(0)
        k = 0
        while k < k_dim and pos + _U(4) <= _U(s_dim):
            t = tally[k]
            v = row[k]
            out_row[pos] = v
            out_row[pos + _U1] = v
            out_row[pos + _U(2)] = v
            out_row[pos + _U(3)] = v
            if t > 4:
                for i in range(4, t):
                    out_row[pos + _U(i)] = v
            pos += _U(t)
            k += 1
        while k < k_dim:
            v = row[k]
            for i in range(tally[k]):
                out_row[pos + _U(i)] = v
            pos += _U(tally[k])
            k += 1
        # sum and sum of squares over the entries, each weighted by its draws (the values are
        # finite), in separate vectorised loops (_tally_moment; a serial chain of additions in
        # the read-out loop doubled its time)
        mean = _tally_moment(row, tally, 0.0, False) / s_dim
        ss = _tally_moment(row, tally, mean, True)
    big = max(abs(np.float64(out_row[0])), abs(np.float64(out_row[s_dim - 1])))  # (sorted)
    # Silverman's rule on the sorted sample (kde.silverman_bandwidth), in float64
    std = math.sqrt(ss / (s_dim - 1)) if s_dim > 1 else 0.0
    q25 = _sorted_quantile(out_row, 0.25)
    q75 = _sorted_quantile(out_row, 0.75)
    a = min(std, (q75 - q25) / 1.34)
    if not a > 0:
        a = std
    if not a > 0:
        a = 1e-3 * max(1.0, big)
    return 0.9 * a * s_dim ** (-0.2)


@njit(nogil=True, cache=True)
def _grounded_samples(c0, c1, ctx, n_samples, seed, out, bandwidth):
    k_dim = ctx.shape[1]
    tally = np.empty(k_dim, np.int32)
    through = np.empty(k_dim, np.int32)
    for c in range(c0, c1):
        bandwidth[c] = _channel_samples(ctx[c], _n_negative(ctx[c]), c, n_samples, seed, tally, through, out[c])


@njit(inline="always")
def _layout(smin, smax, h, xmin, xmax, points_per_bandwidth, truncate, max_points):
    # kde.grid_layout for one channel (the same float64 operations, so the same grid)
    lo = max(xmin, smin - truncate * h)
    hi = max(min(xmax, smax + truncate * h), lo)
    delta = max(h / points_per_bandwidth, (hi - lo) / (max_points - 1))
    return lo, delta, int(math.ceil((hi - lo) / delta)) + 2


# points binned per chunk of _BIN_CHUNK: first each point's cell and two weights, in one loop
# without stores to the bins (vectorised: the cell is converted to int32, which AVX2 has a vector
# instruction for, int64 not), then the weights added to the bins in a second loop (the adds to
# one bin are a chain through memory, which would keep a single loop from being vectorised)
_BIN_CHUNK = 256


@njit(inline="always")
def _bin_cell(v, lo, inv_d, half, top):
    # the bin of point v (bins[cell] and bins[cell + 1] share its weight) and its weight's share in
    # the upper one, frac, in float64
    u = (np.float64(v) - lo) * inv_d + half
    i0 = np.floor(u)
    frac = u - i0
    i0 = i0 if i0 > -2.0 else -2.0
    i0 = i0 if i0 < top else top
    return np.int32(i0) + 2, frac


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
def _bin_points(bins, points, tally, w, lo, inv_d, half, top, cell, w0, w1):
    # linear binning in float64 of points[k] with weight tally[k] * w (w where tally is empty):
    # bins[2 + e] <-> node lo + (e - half) * delta; two guard cells at each end take the weight of
    # points off the grid, so there is no branch. cell, w0, w1: _BIN_CHUNK scratch. (The points
    # are finite.)
    n_points = points.shape[0]
    weighted = tally.shape[0] > 0
    for k0 in range(0, n_points, _BIN_CHUNK):
        n = min(_BIN_CHUNK, n_points - k0)
        if weighted:
            for k in range(n):
                cell[k], frac = _bin_cell(points[_U(k0 + k)], lo, inv_d, half, top)
                wk = tally[_U(k0 + k)] * w
                w0[k] = (1.0 - frac) * wk
                w1[k] = frac * wk
        else:
            for k in range(n):
                cell[k], frac = _bin_cell(points[_U(k0 + k)], lo, inv_d, half, top)
                w0[k] = (1.0 - frac) * w
                w1[k] = frac * w
        for k in range(n):
            i = _U(cell[k])  # (unsigned: see _U)
            bins[i] += w0[k]
            bins[i + _U1] += w1[k]


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
def _smooth(bins, binned, taps, taps_key, acc, g_dim, half, ratio, truncate):
    # acc[j] = sum_t phi(t delta / h) bins[j + t + 2], t = -half..half, in the precision of
    # `binned` (the samples' dtype: float32 layers have twice the SIMD width; the eager grid
    # of a float32 layer is float32 too). phi(t delta / h) is the same for every channel whose
    # spacing is h / points_per_bandwidth (delta / h is then exact), so the taps are computed
    # again only when the ratio or the half-width changes (taps_key holds both; the rounding
    # of truncate * h / delta can differ between such channels).
    n_taps = 2 * half + 1
    for e in range(g_dim + 2 * half):  # (unsigned indices: see _U)
        binned[_U(e + 2)] = bins[_U(e + 2)]
    if ratio != taps_key[0] or half != taps_key[1]:
        taps_key[0] = ratio
        taps_key[1] = half
        inv_sqrt_2pi = 1.0 / math.sqrt(2.0 * math.pi)
        for t in range(-half, half + 1):
            z = t * ratio
            taps[t + half] = math.exp(-0.5 * z * z) * inv_sqrt_2pi if abs(z) <= truncate else 0.0
    # four taps per pass over acc (vectorised over j)
    for j in range(g_dim):
        acc[j] = 0.0
    t = 0
    while t + 4 <= n_taps:
        k0 = taps[t]
        k1 = taps[t + 1]
        k2 = taps[t + 2]
        k3 = taps[t + 3]
        for j in range(g_dim):
            acc[j] += k0 * binned[j + t + 2] + k1 * binned[j + t + 3] + k2 * binned[j + t + 4] + k3 * binned[j + t + 5]
        t += 4
    while t < n_taps:
        k0 = taps[t]
        for j in range(g_dim):
            acc[j] += k0 * binned[j + t + 2]
        t += 1


@njit(inline="always")
def _grid_scratch(max_g, max_half, dtype):
    # bins (float64), binned (the convolution's precision), taps, acc, the taps' key, and the
    # binning's cells and weights (_bin_points)
    size = max_g + 2 * max_half + 4
    return (
        np.empty(size, np.float64),
        np.zeros(size, dtype),
        np.empty(2 * max_half + 1, dtype),
        np.empty(max_g, dtype),
        np.full(2, -1.0),
        np.empty(_BIN_CHUNK, np.int32),
        np.empty(_BIN_CHUNK, np.float64),
        np.empty(_BIN_CHUNK, np.float64),
    )


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
def _channel_grid(scratch, row, tally, sample_row, tallied, lo, d, h, g_dim, truncate, out_row):
    # one channel's grid KDE on nodes lo + j * d, j < g_dim, into out_row: the points linearly
    # binned (tallied: the sorted entries `row` weighted by their draws `tally`, each binned
    # once; else the S points of `sample_row` one by one), convolved (_smooth), divided by h
    bins, binned, taps, acc, taps_key, cell, w0, w1 = scratch
    s_dim = sample_row.shape[0]
    w = 1.0 / s_dim
    half = int(math.ceil(truncate * h / d))
    length = g_dim + 2 * half
    bins[: length + 4] = 0.0
    inv_d = 1.0 / d
    top = np.float64(length)
    if tallied:  # (entries never drawn add 0)
        _bin_points(bins, row, tally, w, lo, inv_d, half, top, cell, w0, w1)
    else:
        _bin_points(bins, sample_row, tally[:0], w, lo, inv_d, half, top, cell, w0, w1)
    _smooth(bins, binned, taps, taps_key, acc, g_dim, half, d / h, truncate)
    inv_h = 1.0 / h
    for j in range(g_dim):
        out_row[j] = acc[j] * inv_h


@njit(nogil=True, cache=True)
def _kde_grid(c0, c1, samples, bandwidth, lo, delta, n_grid, truncate, grid):
    # kde.kde_grid per channel: linear binning of the samples, convolution with
    # phi(t delta / h) / h on taps |t delta| <= truncate * h, grid = the part on nodes
    # lo + j * delta, j < n_grid[c] (the rest of the row stays 0)
    max_half = 0
    max_g = 0
    for c in range(c0, c1):
        max_half = max(max_half, int(math.ceil(truncate * bandwidth[c] / delta[c])))
        max_g = max(max_g, n_grid[c])
    scratch = _grid_scratch(max_g, max_half, samples.dtype)
    no_tally = np.empty(0, np.int32)
    for c in range(c0, c1):
        _channel_grid(
            scratch,
            samples[c],
            no_tally,
            samples[c],
            False,
            lo[c],
            delta[c],
            bandwidth[c],
            n_grid[c],
            truncate,
            grid[c],
        )


@njit(nogil=True, cache=True)
def _grid_density_times(c0, c1, x3, g3, grid, lo, inv_delta, n_grid, out3):
    n_dim, c_dim, l_dim = x3.shape
    for c in range(c0, c1):
        row = grid[c]
        a = lo[c]
        inv = inv_delta[c]
        top = n_grid[c] - 1
        for n in range(n_dim):
            for loc in range(l_dim):
                out3[n, c, loc] = g3[n, c, loc] * _density_at(x3[n, c, loc], row, a, inv, top)


@njit(nogil=True, cache=True)
def _grid_density(c0, c1, x3, grid, lo, inv_delta, n_grid, out3):
    # _grid_density_times without the gradient: the density itself, in out3's dtype
    n_dim, c_dim, l_dim = x3.shape
    for c in range(c0, c1):
        row = grid[c]
        a = lo[c]
        inv = inv_delta[c]
        top = n_grid[c] - 1
        for n in range(n_dim):
            for loc in range(l_dim):
                out3[n, c, loc] = _density_at(x3[n, c, loc], row, a, inv, top)


def grounded_samples(ctx: np.ndarray, n_samples: int, seed: int):
    """``(C, S)`` sorted KDE points drawn with the grounding weights and their ``(C,)`` Silverman
    bandwidths (float64), from the sorted grounded context ``ctx`` ``(C, M + 2)``."""
    out = np.empty((ctx.shape[0], n_samples), dtype=ctx.dtype)
    bw = np.empty(ctx.shape[0], dtype=np.float64)
    parallel_ranges(_grounded_samples, ctx.shape[0], ctx.shape[0] * n_samples * 8, ctx, n_samples, seed, out, bw)
    return out, bw


def kde_grid(
    samples: np.ndarray,
    bandwidth: np.ndarray,
    xmin: np.ndarray,
    xmax: np.ndarray,
    points_per_bandwidth: int = POINTS_PER_BANDWIDTH,
    truncate: float = TRUNCATE,
    max_points: int = 4096,
):
    """:func:`shiftguard.functional.kde.kde_grid` per channel (the same
    :func:`~shiftguard.functional.kde.grid_layout`; each channel's grid has its own length
    ``n_grid[c]``, so a wide channel does not widen the others). The convolution runs in the
    dtype of ``samples`` (float32 samples: node values within 1.2e-5 relative of float64's).

    Returns ``grid (C, max n_grid)`` float64, ``lo (C,)``, ``delta (C,)``, ``n_grid (C,)`` int64.
    """
    h = np.asarray(bandwidth, dtype=np.float64)
    f64 = [
        torch.from_numpy(np.asarray(a, dtype=np.float64))
        for a in (samples.min(axis=1), samples.max(axis=1), h, xmin, xmax)
    ]
    smin, smax, h64, xmin64, xmax64 = f64
    lo, delta, n_grid = (
        t.numpy() for t in grid_layout(smin, smax, h64, xmin64, xmax64, points_per_bandwidth, truncate, max_points)
    )
    grid = np.zeros((samples.shape[0], int(n_grid.max())), dtype=np.float64)
    parallel_ranges(_kde_grid, samples.shape[0], grid.size * 64, samples, h, lo, delta, n_grid, float(truncate), grid)
    return grid, lo, delta, n_grid


def kde_density_times(
    x3: np.ndarray, g3: np.ndarray, samples: np.ndarray, bandwidth: np.ndarray, xmin: np.ndarray, xmax: np.ndarray
) -> np.ndarray:
    """``g3 * f_grid(x3)`` (Alg. 2, eq. (7)): the grid KDE of ``samples`` (:func:`kde_grid`, with
    ``x3``'s per-channel range ``xmin, xmax``) linearly interpolated at every value of ``x3`` (0
    outside the grid; the grid is a sum of non-negative terms) and multiplied by the incoming
    gradient ``g3``, all ``(N, C, L)``."""
    grid, lo, delta, n_grid = kde_grid(samples, bandwidth, xmin, xmax)
    out = np.empty_like(x3)
    parallel_ranges(_grid_density_times, x3.shape[1], x3.size * 8, x3, g3, grid, lo, 1.0 / delta, n_grid, out)
    return out


def kde_density(
    x3: np.ndarray, samples: np.ndarray, bandwidth: np.ndarray, xmin: np.ndarray, xmax: np.ndarray
) -> np.ndarray:
    """``f_grid(x3)`` (Alg. 2, eq. (7)) in float64: :func:`kde_density_times` without the gradient,
    for a forward that hands the backward its density. Kept in float64 so that the backward's
    ``grad * density``, computed in float64 and rounded once to the gradient's dtype, has the bits of
    :func:`kde_density_times`' product."""
    grid, lo, delta, n_grid = kde_grid(samples, bandwidth, xmin, xmax)
    out = np.empty(x3.shape, dtype=np.float64)
    parallel_ranges(_grid_density, x3.shape[1], x3.size * 8, x3, grid, lo, 1.0 / delta, n_grid, out)
    return out
