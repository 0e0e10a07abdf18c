"""Compiled CPU kernels of QACT (numba): the same mathematics as :mod:`shiftguard.functional.quantile`
and :mod:`shiftguard.functional.kde`, fused into a few passes over the data.

Why: in eager PyTorch the batch-context QACT is ~40 small tensor operations, an argsort of the
``(C, M)`` context and a scatter through its permutation; here the context is sorted by numpy's
vectorised sort (values only, no permutation) and each value is then read once, for its output and
(when a gradient will be needed) its KDE density. Channels run in parallel as contiguous channel
ranges on torch's thread count, on torch's own OpenMP threads (:mod:`shiftguard._parallel`; the
kernels release the GIL).

What is computed, per channel ``c`` (000, Alg. 1-2; module doc of ``quantile.py``):

- :func:`sorted_grounded_context`: the channel's values and ``-c, +c``, sorted;
  :func:`sorted_context_finite` reads the values' finiteness off its ends (and the fused pass each
  channel's range, ``_row_range``).
- :func:`grounded_quantiles`: ``n_-`` (values < 0 in the sorted grounded context) and the weighted
  quantiles ``q_1..q_{n_tau}`` by the closed-form midpoint positions of the grounding weights
  (eqs. (8)-(9)) with linear interpolation, made non-decreasing (running max) -- the arithmetic of
  ``_grounded_quantiles`` done in float64 and rounded once to the tensor dtype. The bracket of each
  level (the two entries and the weight) depends only on the row length and ``n_-``: for rows of
  up to ``_BRACKETS_MAX_ROW`` entries it is looked up in a table built once (``_brackets``).
- :func:`counts_output`: every value's forward output ``#{i : q_i <= x} / n_tau`` (eq. (6)): a
  table over ``[q_1, q_n]`` holds, per cell, the number of quantiles in earlier cells; the cell
  index is monotone in ``x``, so only the quantiles in ``x``'s own cell are compared and the count
  equals ``torch.searchsorted(q, x, right=True)`` whatever the rounding. The same pass checks for
  NaN/inf and records the range.
- :func:`grounded_samples`: the ``S`` KDE points of Alg. 2, drawn with the grounding weights by
  systematic sampling (``quantile.py``, "Sampling"): draw ``s`` takes the sorted entry whose
  cumulative grounding weight first exceeds ``(s + U) / S``, one offset ``U`` per channel. Entry
  ``k`` is drawn ``c_k - c_{k-1}`` times, ``c_k = ceil(S P_k - U)`` in float64 (the eager code's
  arithmetic: the same sample for the same ``U``); short contexts tally every entry and read the
  tally out in order, long ones find each draw's entry from its CDF position. ``U`` is 32 bits of
  SplitMix64 of ``seed + channel``, so the result is deterministic given ``seed`` (drawn from the caller's
  ``torch.Generator``) and independent of the thread count. Silverman's bandwidth of the sorted
  sample (``kde.py``) is computed on the way.
- :func:`kde_grid`, :func:`kde_density_times`: the grid KDE of ``kde.py`` (linear binning, Gaussian
  kernel truncated at ``4 h``, 8 nodes per bandwidth: same nodes, weights and error bound; a
  direct convolution per channel instead of one FFT over all, in the samples' precision like the
  eager grid) and, for statistics that did not come
  with the density (frozen context, DDP), ``grad_output * f_grid(x)`` in one pass.
- :func:`batch_channels`: all of the above for a batch context whose gradient will be needed, one
  channel at a time (quantiles, draws and bandwidth, grid, then every value's output and density,
  Alg. 2 eq. (7), for the backward), with the channel's scratch in cache and no Python between
  the steps. The drawn entries are binned once each with their number of draws as weight; the count
  table covers the quantiles inside the channel's value range only. For an ``(N, C)`` input
  (checked finite first, :func:`all_finite`) each thread sorts its channels' context rows right
  before their pass (``ctx=None``: one parallel region).

The tests check each kernel against the eager implementation it replaces and against the slow
references (``tests/test_qact_cpu.py``).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from shiftguard._numba import AVAILABLE, njit  # numba is a dependency; the eager torch path works without it
from shiftguard._parallel import parallel_parts
from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, TRUNCATE, grid_layout

if AVAILABLE:
    from shiftguard._numba import splitmix64

__all__ = [
    "AVAILABLE", "lerp_rows_", "sorted_grounded_context", "all_finite", "sorted_context_finite", "grounded_quantiles",
    "counts_output",
    "grounded_samples", "kde_grid", "kde_density_times", "batch_channels",
]

if AVAILABLE:
    _S32 = np.uint64(32)
    # An index known to be >= 0 is made unsigned: numba wraps a signed index that the compiler cannot
    # prove non-negative (one computed from data, or offset from a loop variable that does not start
    # at 0: range(a, b), k0 + k, c0 + i) around to the array's end if negative, on every access,
    # which also keeps the loop from being vectorised. Measured at (256, 512), one thread: the value
    # pass 10% faster; the gather 0.11 -> 0.064 ms; the sample write 0.43 -> 0.33 ms; the binning's
    # first loop and the grid's copy into the convolution's precision vectorised; the fused pass
    # 2.97 -> 2.60 ms in all.
    _U = np.uint64
    _U1 = np.uint64(1)

    @njit(inline="always")
    def _n_negative(row):
        lo, hi = 0, row.shape[0]
        while lo < hi:
            mid = (lo + hi) >> 1
            if row[mid] < 0:
                lo = mid + 1
            else:
                hi = mid
        return lo

    @njit(inline="always")
    def _position(k, nn, k_dim):
        # midpoint CDF position of sorted entry k in the grounded context (quantile.py)
        if k < nn:
            return (k + 0.5) / (2.0 * nn)
        return 0.5 + (k - nn + 0.5) / (2.0 * (k_dim - nn))

    @njit(inline="always")
    def _levels(n_tau):
        # tau_i = i / (n_tau + 1), i = 1..n_tau (quantile.quantile_levels), computed once per call
        levels = np.empty(n_tau, np.float64)
        for i in range(n_tau):
            levels[i] = (i + 1.0) / (n_tau + 1.0)
        return levels

    @njit(inline="always")
    def _level_bracket(tau, nn, k_dim):
        # the quantile at level tau of a sorted grounded row with nn negative entries is
        # row[k] + w (row[k + 1] - row[k]); w < 0 marks the ends, where it is row[k] itself
        if tau < 0.5:
            k = int(math.floor(2.0 * tau * nn - 0.5))
        else:
            k = nn + int(math.floor((tau - 0.5) * 2.0 * (k_dim - nn) - 0.5))
        k = min(max(k, -1), k_dim - 1)
        # enforce p_k <= tau < p_{k+1} (guards the rounding of the inversion), keeping p_k and
        # p_{k+1} for the interpolation (p_-1 = -inf, p_K = +inf)
        p_next = _position(k + 1, nn, k_dim) if k + 1 <= k_dim - 1 else np.inf
        while p_next <= tau:
            k += 1
            p_next = _position(k + 1, nn, k_dim) if k + 1 <= k_dim - 1 else np.inf
        p_here = _position(k, nn, k_dim) if k >= 0 else -np.inf
        while p_here > tau:
            k -= 1
            p_next = p_here
            p_here = _position(k, nn, k_dim) if k >= 0 else -np.inf
        if k < 0:
            return 0, -1.0
        if k >= k_dim - 1:
            return k_dim - 1, -1.0
        return k, (tau - p_here) / (p_next - p_here)

    @njit(inline="always")
    def _quantile_at(row, k, w):
        # row[k] + w (row[k + 1] - row[k]) in float64 (row[k] where w < 0: no read past the row)
        v0 = np.float64(row[_U(k)])
        v1 = np.float64(row[_U(k + (w >= 0.0))])
        return v0 if w < 0.0 else v0 + w * (v1 - v0)

    @njit(inline="always")
    def _bracketed_quantiles(row, kk, ww, q_row):
        # q_row[i] = the running max of row[k] + w (row[k + 1] - row[k]) over levels <= i, with
        # (k, w) = (kk[i], ww[i]) from _level_bracket, in float64, rounded once to q_row's dtype
        run = -np.inf
        for i in range(q_row.shape[0]):
            run = max(run, _quantile_at(row, kk[i], ww[i]))
            q_row[i] = run

    @njit(nogil=True, cache=True)
    def _fill_brackets(k_dim, n_tau, kk, ww):
        # kk[nn], ww[nn]: the brackets of every level for a row with nn negative entries,
        # 1 <= nn <= k_dim - 1 (-c and +c are always there); rows 0 and k_dim are not used
        levels = _levels(n_tau)
        for nn in range(1, k_dim):
            for i in range(n_tau):
                kk[nn, i], ww[nn, i] = _level_bracket(levels[i], nn, k_dim)

    @njit(inline="always")
    def _channel_quantiles(row, nn, levels, kk, ww, q_row):
        # the weighted quantiles of one sorted grounded context row with nn negative entries at
        # `levels` (_levels; grounded_quantiles): the brackets from the table kk, ww when there is
        # one (_brackets), else computed here (the same float64 operations either way)
        if kk.shape[0] > 0:
            _bracketed_quantiles(row, kk[nn], ww[nn], q_row)
            return
        k_dim = row.shape[0]
        run = -np.inf
        for i in range(levels.shape[0]):
            k, w = _level_bracket(levels[i], nn, k_dim)
            run = max(run, _quantile_at(row, k, w))
            q_row[i] = run

    @njit(nogil=True, cache=True)
    def _grounded_quantiles(c0, c1, ctx, n_tau, kk, ww, q_out):
        levels = _levels(n_tau)
        for c in range(c0, c1):
            _channel_quantiles(ctx[c], _n_negative(ctx[c]), levels, kk, ww, q_out[c])

    @njit(inline="always")
    def _cell(v, q_lo, inv_w, top):
        # cell index of v in the table over [q_lo, q_hi]: monotone non-decreasing in v (rounding
        # is monotone, clamping too), which is all the exactness argument below needs
        # (selects, not branches: the count loops stay branch-free)
        t = (np.float64(v) - q_lo) * inv_w
        t = t if t > 0.0 else 0.0  # also NaN (reported by the caller), which must not index the table
        t = t if t < top else np.float64(top)
        return int(t)

    # #{i : q_i <= v}. start[j] = #{i : cell(q_i) < j}; for v in cell j, a q_i in an earlier cell is
    # < v and one in a later cell is > v (v <= q_i would give cell(v) <= cell(q_i), by monotonicity),
    # so the count is start[j] + #{i in cell j : q_i <= v}: exact, whatever the rounding.
    @njit(inline="always")
    def _count_few(v, qp, start, q_lo, inv_w, n_lut):
        # no cell holds more than two quantiles: two comparisons without branches (a quantile of a
        # later cell, or the +inf padding, is > v and adds nothing). (Indices unsigned: see _U.)
        k = start[_U(_cell(v, q_lo, inv_w, n_lut))]
        return k + (qp[_U(k)] <= v) + (qp[_U(k) + _U1] <= v)

    @njit(inline="always")
    def _count_many(v, qp, start, q_lo, inv_w, n_lut):
        j = _U(_cell(v, q_lo, inv_w, n_lut))
        k = start[j]
        for i in range(k, start[j + _U1]):
            k += qp[_U(i)] <= v
        return k

    @njit(inline="always")
    def _table_size(n_tau, n_values):
        # ~4-8 table cells per quantile (finer for longer channels, where the per-value cost
        # dominates; with 2 per quantile, half the channels of a (256, 512) input had a cell with
        # more than two quantiles and took the slower count, 1.7x the pass)
        return max(4 * n_tau, min(8 * n_tau, n_values // 2))

    @njit(inline="always")
    def _cell_table(q, qp, start, n_lut, xmin, xmax):
        # qp = the quantiles q, then +inf twice (for the fixed steps); start = the cumulative counts
        # per cell; returns (q_lo, 1 / cell width, whether no cell holds more than two quantiles).
        # Values known to lie in [xmin, xmax]: the quantiles below xmin are <= every value and
        # those above xmax > every value, so the table covers only the others, qp[a:b], its counts
        # starting at a. (With few values a channel, the outer quantiles interpolate with -c or +c,
        # far from the values, and would crowd the table's end cells: at (128, 512) every channel
        # had a cell with more than two quantiles and took the slower count.)
        n_tau = q.shape[0]
        for i in range(n_tau):
            qp[i] = q[i]
        qp[n_tau] = np.inf
        qp[n_tau + 1] = np.inf
        a = 0
        while a < n_tau and qp[a] < xmin:
            a += 1
        b = n_tau
        while b > a and qp[b - 1] > xmax:
            b -= 1
        start[:] = 0
        start[0] = a
        if b == a:  # no quantile in the values' range: every count is a
            start[1:] = a
            return xmin, 0.0, True
        q_lo = qp[a]
        q_hi = qp[b - 1]
        inv_w = n_lut / (q_hi - q_lo) if q_hi > q_lo else 0.0
        for i in range(a, b):
            start[_U(_cell(qp[i], q_lo, inv_w, n_lut) + 1)] += 1
        occupancy = 0
        for j in range(1, n_lut + 2):
            occupancy = max(occupancy, start[j])
            start[j] += start[j - 1]
        return q_lo, inv_w, occupancy <= 2

    @njit(inline="always")
    def _interpolate(row, p, i):
        # row at position p by linear interpolation between nodes i = floor(p) and i + 1. i comes as
        # an int64 (a float <-> uint64 conversion has no instruction in AVX2: ~8 of them each way)
        # and indexes as unsigned (see _U)
        j = _U(i)
        return row[j] + (p - np.float64(i)) * (row[j + _U1] - row[j])

    @njit(inline="always")
    def _density_at(v, row, origin, inv_delta, top):
        # linear interpolation of the grid row on nodes origin + j / inv_delta (0 outside); the grid
        # is a sum of non-negative terms, so no clamp is needed
        # (selects, not branches; NaN gives 0 like a value off the grid)
        p = (np.float64(v) - origin) * inv_delta
        inside = (p >= 0.0) & (p <= top)
        pc = p if p > 0.0 else 0.0
        pc = pc if pc < top - 1 else np.float64(top - 1)
        d = _interpolate(row, p, int(pc))
        return d if inside else 0.0

    @njit(inline="always")
    def _density_on_grid(v, row, origin, inv_delta):
        # _density_at for a value known to lie on the grid short of its last node, 0 <= p < top:
        # the same interpolation without the checks and clamps (the same result there)
        p = (np.float64(v) - origin) * inv_delta
        return _interpolate(row, p, int(p))

    @njit(nogil=True, cache=True)
    def _counts(c0, c1, x3, quantiles, values_by_count, out3, xmin, xmax, n_bad):
        # the forward output of every value, its range, and NaN/inf
        n_dim, c_dim, l_dim = x3.shape
        n_tau = quantiles.shape[1]
        n_lut = _table_size(n_tau, n_dim * l_dim)
        start = np.zeros(n_lut + 2, np.int64)
        qp = np.empty(n_tau + 2, np.float64)
        for c in range(c0, c1):
            q_lo, inv_w, few = _cell_table(quantiles[c], qp, start, n_lut, -np.inf, np.inf)  # (range not known yet)
            lo_v = np.inf
            hi_v = -np.inf
            bad = 0
            # two copies of the loop so that no branch on the count sits inside it (one loop with
            # the choice per value was not unswitched by the compiler: the fused pass ran 1.3-2x slower)
            if few:
                for n in range(n_dim):
                    for l in range(l_dim):
                        v = x3[n, c, l]
                        bad += not (v - v == 0)
                        lo_v = min(lo_v, v)
                        hi_v = max(hi_v, v)
                        out3[n, c, l] = values_by_count[_U(_count_few(v, qp, start, q_lo, inv_w, n_lut))]
            else:
                for n in range(n_dim):
                    for l in range(l_dim):
                        v = x3[n, c, l]
                        bad += not (v - v == 0)
                        lo_v = min(lo_v, v)
                        hi_v = max(hi_v, v)
                        out3[n, c, l] = values_by_count[_U(_count_many(v, qp, start, q_lo, inv_w, n_lut))]
            xmin[c] = lo_v
            xmax[c] = hi_v
            n_bad[c] = bad

    @njit(inline="always")
    def _row_range(row, c_bound):
        # (min, max) in float64 of the values of a finite sorted grounded row (the row without one -c
        # and one +c). min: row[0] if below -c; else row[0] is a -c (drop it): row[1], unless that
        # is the +c (row[1] >= c: then row[1] == c), then row[2]; max likewise from the top
        k_dim = row.shape[0]
        first = row[0] if row[0] < -c_bound else (row[1] if row[1] < c_bound else row[2])
        last = row[k_dim - 1] if row[k_dim - 1] > c_bound else (row[k_dim - 2] if row[k_dim - 2] > -c_bound
                                                                 else row[k_dim - 3])
        return np.float64(first), np.float64(last)

    @njit(nogil=True, cache=True)
    def _grounded_context(c0, c1, x3, c_bound, ctx, bounds_outside):
        # ctx[c] = every value of channel c (unsorted) and -c, +c: bounds_outside: -c, values, +c;
        # else values, -c, +c (the values then start on the row's alignment: stores 1 element off
        # it made the gather of a (256, 64, 144) input 1.6x slower)
        n_dim, c_dim, l_dim = x3.shape
        m = n_dim * l_dim
        first = 1 if bounds_outside else 0
        if l_dim == 1:
            # (N, C): a transpose, in tiles of 8 x 8 (read channel by channel, the values of a
            # channel lie C apart, and with C a multiple of 512 all on the same few cache sets: 2x
            # the time at (256, 512), 0.22 vs 0.11 ms of one thread)
            x2 = x3.reshape(n_dim, c_dim)
            n8 = n_dim - n_dim % 8
            # (channel indices unsigned: see _U)
            for cb in range(c0, c1, 8):
                if cb + 8 <= c1:
                    ub = _U(cb)
                    for nb in range(0, n8, 8):
                        for i in range(8):
                            for j in range(8):
                                ctx[ub + _U(i), first + nb + j] = x2[nb + j, ub + _U(i)]
                    for n in range(n8, n_dim):
                        for i in range(8):
                            ctx[ub + _U(i), first + n] = x2[n, ub + _U(i)]
                else:
                    for n in range(n_dim):
                        for c in range(cb, c1):
                            ctx[c, first + n] = x2[n, c]
        else:
            for c in range(c0, c1):
                for n in range(n_dim):
                    for l in range(l_dim):
                        ctx[c, first + n * l_dim + l] = x3[n, c, l]
        for c in range(c0, c1):
            ctx[c, 0 if bounds_outside else m] = -c_bound
            ctx[c, m + 1] = c_bound

    @njit(nogil=True, cache=True)
    def _all_finite(values):
        # whether every entry of the 1-d array is finite (vectorised: no branch in the loop)
        ok = True
        for i in range(values.shape[0]):
            v = values[i]
            ok &= v - v == 0
        return ok

    @njit(nogil=True, cache=True)
    def _ends_finite(ctx):
        # whether the first and the last entry of every row are finite (one call: numpy's isfinite
        # and all on both columns took ~15 us of a training step, this ~5 us)
        last = ctx.shape[1] - 1
        ok = True
        for c in range(ctx.shape[0]):
            a = ctx[c, 0]
            b = ctx[c, last]
            ok &= (a - a == 0) & (b - b == 0)
        return ok

    @njit(nogil=True, cache=True)
    def _place_bounds(c0, c1, ctx, c_bound):
        # rows -c, sorted values, +c (numpy's order: -inf first, inf and NaN last): move -c after
        # the values below it and +c before the values above it (and NaN), so that each row is
        # sorted as numpy would sort it whole; rows within (-c, c) are left as they are
        k_dim = ctx.shape[1]
        for c in range(c0, c1):
            row = ctx[c]
            k = 0
            while k + 1 < k_dim - 1 and row[k + 1] < -c_bound:
                row[k] = row[k + 1]
                k += 1
            row[k] = -c_bound
            k = k_dim - 1
            while k - 1 > 0 and not (row[k - 1] <= c_bound):
                row[k] = row[k - 1]
                k -= 1
            row[k] = c_bound

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
    # lanes, and only here. Four interleaved partial sums in the caller's strict IEEE order took
    # 0.18 ms of one thread at (256, 512) for both moments, this 0.05 ms; the sum's rounding differs,
    # within ~1e-15 relative, far inside the tests' 1e-12 against the eager bandwidth)
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

    @njit(inline="always")
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
            # same loop is a carried dependency: not vectorised, 1.6x the time). np.ceil, not math.ceil:
            # math.ceil's int64 result has no AVX2 vector conversion, np.ceil's float does (to int32;
            # the same counts, the loops 0.25 -> 0.18 ms at (256, 512)); likewise the entry's index
            # goes to float64 from int32, not int64 (the same value: 0.18 -> 0.12 ms)
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
            # so the common case has no branch (a branch per copy cost 1.4 ms at (256, 512)); the
            # entries within 4 cells of the end take exact stores (out_row has no spare cells;
            # through a scratch row and a copy, the copy cost 0.16 ms at (256, 512))
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
    # one bin are a chain through memory, which kept the loop of both at ~14 cycles a point): 0.67
    # -> 0.34 ms of one thread at (256, 512), the same bins
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

    @njit(inline="always")
    def _bin_points(bins, points, tally, w, lo, inv_d, half, top, cell, w0, w1):
        # linear binning in float64 of points[k] with weight tally[k] * w (w where tally is empty):
        # bins[2 + e] <-> node lo + (e - half) * delta; two guard cells at each end take the weight of
        # points off the grid, so there is no branch (summing runs of equal bins behind a branch cost
        # ~15-25% more). cell, w0, w1: _BIN_CHUNK scratch. (The points are finite.)
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

    @njit(inline="always")
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
        return (np.empty(size, np.float64), np.zeros(size, dtype), np.empty(2 * max_half + 1, dtype),
                np.empty(max_g, dtype), np.full(2, -1.0), np.empty(_BIN_CHUNK, np.int32),
                np.empty(_BIN_CHUNK, np.float64), np.empty(_BIN_CHUNK, np.float64))

    @njit(inline="always")
    def _channel_grid(scratch, row, tally, sample_row, tallied, lo, d, h, g_dim, truncate, out_row):
        # one channel's grid KDE on nodes lo + j * d, j < g_dim, into out_row: the points linearly
        # binned (tallied: the sorted entries `row` weighted by their draws `tally`, each binned
        # once; else the S points of `sample_row` one by one), convolved (_smooth), divided by h
        bins, binned, taps, acc, taps_key, cell, w0, w1 = scratch
        s_dim = sample_row.shape[0]
        w = 1.0 / s_dim
        half = int(math.ceil(truncate * h / d))
        length = g_dim + 2 * half
        bins[:length + 4] = 0.0
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
            _channel_grid(scratch, samples[c], no_tally, samples[c], False, lo[c], delta[c], bandwidth[c], n_grid[c],
                          truncate, grid[c])

    @njit(nogil=True, cache=True)
    def _grid_density_times(c0, c1, x3, g3, grid, lo, inv_delta, n_grid, out3):
        n_dim, c_dim, l_dim = x3.shape
        for c in range(c0, c1):
            row = grid[c]
            a = lo[c]
            inv = inv_delta[c]
            top = n_grid[c] - 1
            for n in range(n_dim):
                for l in range(l_dim):
                    out3[n, c, l] = g3[n, c, l] * _density_at(x3[n, c, l], row, a, inv, top)

    @njit(inline="always")
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
    def _batch_channels(c0, c1, ctx, x3, seed, c_bound, points_per_bandwidth, truncate, max_points,
                        values_by_count, kk, ww, q_out, s_dim, samples, bandwidth, out3, dens3, momentum, run_q, run_s,
                        run_b):
        # everything the batch context computes for a channel, one channel at a time with its
        # scratch in cache (no per-pass arrays, no Python between passes): the quantiles
        # (_channel_quantiles), the KDE draws and bandwidth (_channel_samples), the KDE grid
        # (_layout, _channel_grid: the grid of kde_grid, the drawn entries binned once each with
        # their number of draws as weight instead of draw by draw), and every value's output and
        # density (as _counts and _density_at). The caller has checked the values are finite; their
        # range, which the grid must cover, is read off the sorted context row (_row_range). With
        # momentum > 0 the channel's running statistics (run_q, run_s, run_b) move towards its batch
        # statistics while these are in cache. samples: (C, s_dim), or no rows (the samples are not
        # kept).
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
        # without a samples array to keep them in, each channel's sample is drawn into one row in
        # cache (2 MB less written and read back at (256, 512): the block 2-5% faster)
        keep = samples.shape[0] > 0
        own_row = np.empty(0 if keep else s_dim, q_out.dtype)
        for c in range(c0, c1):
            row = ctx[c]
            sample_row = samples[c] if keep else own_row
            nn = _n_negative(row)
            _channel_quantiles(row, nn, levels, kk, ww, q_out[c])
            h = _channel_samples(row, nn, c, s_dim, seed, tally, through, sample_row)
            bandwidth[c] = h
            xmin, xmax = _row_range(row, c_bound)
            lo, d, g_dim = _layout(np.float64(sample_row[0]), np.float64(sample_row[s_dim - 1]), h, xmin, xmax,
                                   points_per_bandwidth, truncate, max_points)
            _channel_grid(scratch, row, tally, sample_row, _tallied(k_dim, s_dim), lo, d, h, g_dim, truncate, row_grid)
            if momentum > 0.0:
                _lerp_row(run_q[c], q_out[c], momentum)
                _lerp_row(run_s[c], sample_row, momentum)
                _lerp_row(run_b[c:c + 1], bandwidth[c:c + 1], momentum)
            inv_d = 1.0 / d
            q_lo, inv_w, few = _cell_table(q_out[c], qp, start, n_lut, xmin, xmax)
            g_top = g_dim - 1
            # every value on the grid short of its last node (as a rule: the grid covers the value
            # range unless the draws stop more than 4 h short of it), known from the two ends (the
            # position is monotone in the value): the density without checks or clamps, 6
            # instructions less a value
            on_grid = (xmin - lo) * inv_d >= 0.0 and (xmax - lo) * inv_d < g_top
            # copies of the loop so that no branch on the count sits inside it (one loop with the
            # choice per value was not unswitched by the compiler: the fused pass ran 1.3-2x slower)
            if few and on_grid:
                for n in range(n_dim):
                    for l in range(l_dim):
                        v = x3[n, c, l]
                        out3[n, c, l] = values_by_count[_U(_count_few(v, qp, start, q_lo, inv_w, n_lut))]
                        dens3[n, c, l] = _density_on_grid(v, row_grid, lo, inv_d)
            elif few:
                for n in range(n_dim):
                    for l in range(l_dim):
                        v = x3[n, c, l]
                        out3[n, c, l] = values_by_count[_U(_count_few(v, qp, start, q_lo, inv_w, n_lut))]
                        dens3[n, c, l] = _density_at(v, row_grid, lo, inv_d, g_top)
            else:
                for n in range(n_dim):
                    for l in range(l_dim):
                        v = x3[n, c, l]
                        out3[n, c, l] = values_by_count[_U(_count_many(v, qp, start, q_lo, inv_w, n_lut))]
                        dens3[n, c, l] = _density_at(v, row_grid, lo, inv_d, g_top)


_PARTS_PER_THREAD = 4


def _threads() -> int:
    return max(1, torch.get_num_threads())


def _run(kernel, n_channels: int, work: int, *args, tiered: bool = False) -> None:
    """``kernel(c0, c1, *args)`` over channels ``[0, n_channels)``: inline when the work is small,
    else split into contiguous channel ranges over torch's thread count, run on torch's own OpenMP
    threads (:mod:`shiftguard._parallel`; the kernels release the GIL). Not numba's parallel
    runtime: that one starts an OpenMP team of its own, whose spinning workers then compete with
    torch's for the cores.

    ``tiered``: two ranges per thread, the first half of them 3/4 of the channels, the rest 1/4
    (for a pass whose ranges cost enough each that more of them cost more than the balance they
    buy, and that needs the small ones at the end to balance)."""
    threads = min(_threads(), n_channels)
    if threads < 2 or work < (1 << 16):
        kernel(0, n_channels, *args)
        return
    if tiered and n_channels >= 4 * threads:
        # (the fused pass that sorts its own rows, at (256, 512) and (1024, 128) on two threads:
        # four ranges of 3/8, 3/8, 1/8, 1/8 of the channels 1-3% faster in the block than eight
        # even ones, and than four even ones; measured in turns, noisy)
        big = 3 * n_channels // 4
        bounds = [big * i // threads for i in range(threads)]
        bounds += [big + (n_channels - big) * i // threads for i in range(threads + 1)]
    else:
        # _PARTS_PER_THREAD contiguous channel ranges per thread, each thread taking the next range
        # left when done with its last: one of two threads often ran ~25% slower than the other here
        # (QACT's fused pass at (256, 512) after a BatchNorm: two halves 5.4 ms, eight ranges 4.2 ms;
        # measured 2, 4 and 8 ranges per thread in the whole block: 4 was best at (1024, 128))
        parts = min(n_channels, _PARTS_PER_THREAD * threads)
        bounds = [n_channels * i // parts for i in range(parts + 1)]  # (np.linspace: ~35 us a call)
    parallel_parts(lambda i: kernel(bounds[i], bounds[i + 1], *args), len(bounds) - 1, threads)


# numpy's sort (x86-simd-sort) sorts rows of up to 256 float32 values by a sorting network, longer
# ones by quicksort: 512 rows of 256 values and their two bounds, sorted whole, took 1.5x as long as
# the 256 values alone (0.46 vs 0.31 ms, measured). Short rows therefore sort the values only and
# place -c and +c after; long ones are sorted whole.
_SORT_VALUES_ONLY = 256


def _gather_and_sort(c0: int, c1: int, x3: np.ndarray, c: float, ctx: np.ndarray) -> None:
    values_only = ctx.shape[1] - 2 <= _SORT_VALUES_ONLY
    _grounded_context(c0, c1, x3, c, ctx, values_only)
    if values_only:
        ctx[c0:c1, 1:-1].sort(axis=1)  # releases the GIL
        _place_bounds(c0, c1, ctx, c)
    else:
        ctx[c0:c1].sort(axis=1)


def _sort_and_pass(c0: int, c1: int, ctx: np.ndarray, x3: np.ndarray, seed: int, c_bound: float, *rest) -> None:
    _gather_and_sort(c0, c1, x3, c_bound, ctx)
    _batch_channels(c0, c1, ctx, x3, seed, c_bound, *rest)


def sorted_grounded_context(x3: np.ndarray, c: float) -> np.ndarray:
    """``(C, M + 2)`` sorted rows: every value of channel ``c`` of ``x3`` ``(N, C, L)``, and ``-c, +c``
    (000, Alg. 1). numpy's sort of the values alone (x86-simd-sort) is ~4x faster than an argsort.
    Each thread gathers and sorts its own range of rows (one parallel region, the rows still in
    cache when sorted)."""
    n, ch, length = x3.shape
    ctx = np.empty((ch, n * length + 2), dtype=x3.dtype)
    _run(_gather_and_sort, ch, ctx.size * 4, x3, c, ctx)
    return ctx


# The bracket of a quantile level (the entries it interpolates between and the weight) depends only
# on the row length and the number of negative entries: for rows of up to _BRACKETS_MAX_ROW entries
# the brackets of all levels for every possible count are computed once per (row length, n_tau) and
# looked up (the same float64 operations, so the same quantiles). Computed per channel they took
# 0.5 ms of one thread at (256, 512), ~10 ns a level (branches on three divisions); looked up,
# 0.07 ms. A table holds (K + 1) n_tau brackets (2.4 MB at K = 2048, n_tau = 100), built in
# ~K n_tau * 10 ns.
_BRACKETS_MAX_ROW = 2048
_BRACKETS_MAX_ENTRIES = 1 << 18
_NO_BRACKETS = (np.zeros((0, 0), dtype=np.int32), np.zeros((0, 0)))


@functools.lru_cache(maxsize=8)
def _bracket_table(k_dim: int, n_tau: int):
    kk = np.zeros((k_dim + 1, n_tau), dtype=np.int32)
    ww = np.full((k_dim + 1, n_tau), -1.0)
    _fill_brackets(k_dim, n_tau, kk, ww)
    kk.flags.writeable = False
    ww.flags.writeable = False
    return kk, ww


def _brackets(k_dim: int, n_tau: int):
    """``(kk, ww)`` bracket tables for rows of ``k_dim`` entries (``_fill_brackets``), or two empty
    arrays where the table would be too large (then each kernel computes the brackets itself)."""
    if k_dim <= _BRACKETS_MAX_ROW and (k_dim + 1) * n_tau <= _BRACKETS_MAX_ENTRIES:
        return _bracket_table(k_dim, n_tau)
    return _NO_BRACKETS


def grounded_quantiles(ctx: np.ndarray, n_tau: int) -> np.ndarray:
    """``(C, n_tau)`` weighted quantiles (dtype of ``ctx``) of the sorted grounded context ``ctx``
    ``(C, M + 2)`` (the values and ``+-c``)."""
    q = np.empty((ctx.shape[0], n_tau), dtype=ctx.dtype)
    _run(_grounded_quantiles, ctx.shape[0], ctx.shape[0] * n_tau * 16, ctx, n_tau, *_brackets(ctx.shape[1], n_tau), q)
    return q


# The kernels read x3 (and write their results) in place, also where a channel's values are
# scattered (a dense (N, C) input, stride C): channels are walked in order, so the cache lines a
# channel touches are still cached for its neighbours. A transposed copy in and out cost more
# (measured at (256, 512), (1024, 128), (4096, 64): the output pass 1.9-2.7x, the density pass
# 1.2-2.1x, the whole (1024, 128) QACT block 4.2 -> 3.3 ms).


def counts_output(x3: np.ndarray, quantiles: np.ndarray, values_by_count: np.ndarray, name: str = "input"):
    """Forward output of every value of ``x3`` ``(N, C, L)`` given ``quantiles`` ``(C, n_tau)``:
    ``values_by_count[#{i : q_i <= x}]`` (``values_by_count[k] = k / n_tau`` in the dtype), and the
    per-channel range ``xmin, xmax`` (float64) of ``x3``. Raises ``ValueError`` naming ``name`` if
    ``x3`` holds NaN or inf (checked in the same pass)."""
    out = np.empty_like(x3)
    xmin = np.empty(x3.shape[1], dtype=np.float64)
    xmax = np.empty(x3.shape[1], dtype=np.float64)
    n_bad = np.zeros(x3.shape[1], dtype=np.int64)
    _run(_counts, x3.shape[1], x3.size * 8, x3, quantiles, values_by_count, out, xmin, xmax, n_bad)
    if n_bad.any():
        n_nan = int(np.isnan(x3).sum())
        raise ValueError(f"{name}: contains non-finite values ({n_nan} NaN, {int(n_bad.sum()) - n_nan} inf)")
    return out, xmin, xmax


def batch_channels(x3: np.ndarray, ctx: np.ndarray, c: float, n_tau: int, n_samples: int, seed: int,
                   values_by_count: np.ndarray, points_per_bandwidth: int = POINTS_PER_BANDWIDTH,
                   truncate: float = TRUNCATE, max_points: int = 4096, running=None, keep_samples: bool = True):
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

    ``running``: optional ``(momentum, quantiles (C, n_tau), samples (C, S), bandwidth (C,), count)``,
    writable arrays of ``x3``'s dtype, moved in place towards this batch's statistics as
    ``torch.lerp_`` does (a module's running statistics, updated in the same pass), and a 0-d int64
    array (its count of updates), to which 1 is added after the pass.

    ``keep_samples=False``: the samples are not returned (``None``; each channel's is drawn into a
    row in cache, for the grid and the running update, and dropped).

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
        m, run_q, run_s, run_b, count = 0.0, none, none, np.empty(0, dtype=x3.dtype), None
    else:
        m, run_q, run_s, run_b, count = running
    work = x3.size * 8 + ch * n_samples * 64
    k_dim = x3.shape[0] * x3.shape[2] + 2  # the context row: every value of a channel and -c, +c
    args = (x3, seed, float(c), float(points_per_bandwidth), float(truncate), int(max_points), values_by_count,
            *_brackets(k_dim, n_tau), q, int(n_samples), samples, bw, out, dens, float(m), run_q, run_s, run_b)
    if ctx is None:
        ctx = np.empty((ch, k_dim), dtype=x3.dtype)
        _run(_sort_and_pass, ch, work, ctx, *args, tiered=True)
    else:
        _run(_batch_channels, ch, work, ctx, *args)
    if count is not None:
        count[()] += 1
    return q, samples if keep_samples else None, bw, out, dens


def lerp_rows_(run: np.ndarray, new: np.ndarray, m: float) -> None:
    """``run += m * (new - run)`` in place, rows ``(C, K)`` (``new`` rounded to ``run``'s dtype
    first): the running-statistics update of the fused :func:`batch_channels`, the same arithmetic
    for statistics computed apart (DDP, eager), so both give the same buffers bit for bit."""
    _run(_lerp_rows, run.shape[0], run.size * 4, run, new, float(m))


def all_finite(x3: np.ndarray) -> bool:
    """Whether every value of ``x3`` is finite (one vectorised pass)."""
    return bool(_all_finite(x3.reshape(-1)))


def sorted_context_finite(ctx: np.ndarray) -> bool:
    """Whether the sorted grounded context ``ctx`` holds no NaN or inf (sorted rows keep them at the
    ends: numpy sorts NaN last)."""
    return bool(_ends_finite(ctx))


def grounded_samples(ctx: np.ndarray, n_samples: int, seed: int):
    """``(C, S)`` sorted KDE points drawn with the grounding weights and their ``(C,)`` Silverman
    bandwidths (float64), from the sorted grounded context ``ctx`` ``(C, M + 2)``."""
    out = np.empty((ctx.shape[0], n_samples), dtype=ctx.dtype)
    bw = np.empty(ctx.shape[0], dtype=np.float64)
    _run(_grounded_samples, ctx.shape[0], ctx.shape[0] * n_samples * 8, ctx, n_samples, seed, out, bw)
    return out, bw


def kde_grid(samples: np.ndarray, bandwidth: np.ndarray, xmin: np.ndarray, xmax: np.ndarray,
             points_per_bandwidth: int = POINTS_PER_BANDWIDTH, truncate: float = TRUNCATE, max_points: int = 4096):
    """:func:`shiftguard.functional.kde.kde_grid` per channel (the same
    :func:`~shiftguard.functional.kde.grid_layout`; each channel's grid has its own length
    ``n_grid[c]``, so a wide channel does not widen the others). The convolution runs in the
    dtype of ``samples`` (float32 samples: node values within 1.2e-5 relative of float64's).

    Returns ``grid (C, max n_grid)`` float64, ``lo (C,)``, ``delta (C,)``, ``n_grid (C,)`` int64.
    """
    h = np.asarray(bandwidth, dtype=np.float64)
    f64 = [torch.from_numpy(np.asarray(a, dtype=np.float64)) for a in
           (samples.min(axis=1), samples.max(axis=1), h, xmin, xmax)]
    lo, delta, n_grid = (t.numpy() for t in grid_layout(*f64, points_per_bandwidth, truncate, max_points))
    grid = np.zeros((samples.shape[0], int(n_grid.max())), dtype=np.float64)
    _run(_kde_grid, samples.shape[0], grid.size * 64, samples, h, lo, delta, n_grid, float(truncate), grid)
    return grid, lo, delta, n_grid


def kde_density_times(x3: np.ndarray, g3: np.ndarray, samples: np.ndarray, bandwidth: np.ndarray,
                      xmin: np.ndarray, xmax: np.ndarray) -> np.ndarray:
    """``g3 * f_grid(x3)`` (Alg. 2, eq. (7)): the grid KDE of ``samples`` (:func:`kde_grid`, with
    ``x3``'s per-channel range ``xmin, xmax``) linearly interpolated at every value of ``x3`` (0
    outside the grid; the grid is a sum of non-negative terms) and multiplied by the incoming gradient ``g3``, all ``(N, C, L)``."""
    grid, lo, delta, n_grid = kde_grid(samples, bandwidth, xmin, xmax)
    out = np.empty_like(x3)
    _run(_grid_density_times, x3.shape[1], x3.size * 8, x3, g3, grid, lo, 1.0 / delta, n_grid, out)
    return out
