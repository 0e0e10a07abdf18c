"""Stage 3: every value's forward output ``#{i : q_i <= x} / n_tau`` [QACT, eq. (6)] through a cell table
over the quantiles, and the linear interpolation of a KDE grid at a value (the density of eq. (7))."""

from __future__ import annotations

import numpy as np

from shiftguard._numba import njit
from shiftguard._parallel import parallel_ranges
from shiftguard.functional._qact_cpu.common import _U, _U1

# The kernels read x3 (and write their results) in place, also where a channel's values are
# scattered (a dense (N, C) input, stride C): channels are walked in order, so the cache lines a
# channel touches are still cached for its neighbours; a transposed copy in and two out would be
# three more passes over the data.


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
    # 4-8 table cells per quantile (finer for longer channels, where the per-value cost dominates):
    # enough that as a rule no cell holds more than two quantiles, the branch-free count
    # (_count_few); with 2 cells per quantile about half of the channels of a typical context
    # have a crowded cell and take the slower count
    return max(4 * n_tau, min(8 * n_tau, n_values // 2))


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
def _cell_table(q, qp, start, n_lut, xmin, xmax):
    # qp = the quantiles q, then +inf twice (for the fixed steps); start = the cumulative counts
    # per cell; returns (q_lo, 1 / cell width, whether no cell holds more than two quantiles).
    # Values known to lie in [xmin, xmax]: the quantiles below xmin are <= every value and
    # those above xmax > every value, so the table covers only the others, qp[a:b], its counts
    # starting at a. (With few values a channel, the outer quantiles interpolate with -c or +c,
    # far from the values, and would crowd the table's end cells, sending every channel to the
    # slower count.)
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
        # one copy of the loop per count variant, so that no branch on the variant sits inside it
        # (numba does not unswitch a loop with the choice made per value)
        if few:
            for n in range(n_dim):
                for loc in range(l_dim):
                    v = x3[n, c, loc]
                    bad += not (v - v == 0)
                    lo_v = min(lo_v, v)
                    hi_v = max(hi_v, v)
                    out3[n, c, loc] = values_by_count[_U(_count_few(v, qp, start, q_lo, inv_w, n_lut))]
        else:
            for n in range(n_dim):
                for loc in range(l_dim):
                    v = x3[n, c, loc]
                    bad += not (v - v == 0)
                    lo_v = min(lo_v, v)
                    hi_v = max(hi_v, v)
                    out3[n, c, loc] = values_by_count[_U(_count_many(v, qp, start, q_lo, inv_w, n_lut))]
        xmin[c] = lo_v
        xmax[c] = hi_v
        n_bad[c] = bad


def counts_output(x3: np.ndarray, quantiles: np.ndarray, values_by_count: np.ndarray, name: str = "input"):
    """Forward output of every value of ``x3`` ``(N, C, L)`` given ``quantiles`` ``(C, n_tau)``:
    ``values_by_count[#{i : q_i <= x}]`` (``values_by_count[k] = k / n_tau`` in the dtype), and the
    per-channel range ``xmin, xmax`` (float64) of ``x3``. Raises ``ValueError`` naming ``name`` if
    ``x3`` holds NaN or inf (checked in the same pass)."""
    out = np.empty_like(x3)
    xmin = np.empty(x3.shape[1], dtype=np.float64)
    xmax = np.empty(x3.shape[1], dtype=np.float64)
    n_bad = np.zeros(x3.shape[1], dtype=np.int64)
    parallel_ranges(_counts, x3.shape[1], x3.size * 8, x3, quantiles, values_by_count, out, xmin, xmax, n_bad)
    if n_bad.any():
        n_nan = int(np.isnan(x3).sum())
        raise ValueError(f"{name}: contains non-finite values ({n_nan} NaN, {int(n_bad.sum()) - n_nan} inf)")
    return out, xmin, xmax
