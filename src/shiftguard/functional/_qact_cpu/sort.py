"""Stage 1: the sorted grounded context. Every value of a channel and ``-c, +c`` [QACT, Alg. 1], gathered
channel-major and sorted by numpy's value sort; its ends reveal NaN/inf and the value range."""

from __future__ import annotations

import numpy as np

from shiftguard._numba import njit
from shiftguard._parallel import parallel_ranges
from shiftguard.functional._qact_cpu.common import _U


@njit(inline="always")
def _row_range(row, c_bound):
    # (min, max) in float64 of the values of a finite sorted grounded row (the row without one -c
    # and one +c). min: row[0] if below -c; else row[0] is a -c (drop it): row[1], unless that
    # is the +c (row[1] >= c: then row[1] == c), then row[2]; max likewise from the top
    k_dim = row.shape[0]
    first = row[0] if row[0] < -c_bound else (row[1] if row[1] < c_bound else row[2])
    last = (
        row[k_dim - 1]
        if row[k_dim - 1] > c_bound
        else (row[k_dim - 2] if row[k_dim - 2] > -c_bound else row[k_dim - 3])
    )
    return np.float64(first), np.float64(last)


@njit(nogil=True, cache=True)
def _grounded_context(c0, c1, x3, c_bound, ctx, bounds_outside):
    # ctx[c] = every value of channel c (unsorted) and -c, +c: bounds_outside: -c, values, +c;
    # else values, -c, +c (the values then start on the row's alignment: vector stores one
    # element off it are split across cache lines)
    n_dim, c_dim, l_dim = x3.shape
    m = n_dim * l_dim
    first = 1 if bounds_outside else 0
    if l_dim == 1:
        # (N, C): a transpose, in tiles of 8 x 8 (read channel by channel, the values of a
        # channel lie C apart, and with C a multiple of 512 all on the same few cache sets)
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
                for loc in range(l_dim):
                    ctx[c, first + n * l_dim + loc] = x3[n, c, loc]
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
    # whether the first and the last entry of every row are finite, in one call (numpy's
    # isfinite and all over both columns are four calls)
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


# numpy's sort (x86-simd-sort) sorts rows of up to 256 float32 values by a sorting network, longer
# ones by quicksort: 256 values and their two bounds would leave the network. Short rows therefore
# sort the values only and place -c and +c after; long ones are sorted whole.
_SORT_VALUES_ONLY = 256


def _gather_and_sort(c0: int, c1: int, x3: np.ndarray, c: float, ctx: np.ndarray) -> None:
    values_only = ctx.shape[1] - 2 <= _SORT_VALUES_ONLY
    _grounded_context(c0, c1, x3, c, ctx, values_only)
    if values_only:
        ctx[c0:c1, 1:-1].sort(axis=1)  # releases the GIL
        _place_bounds(c0, c1, ctx, c)
    else:
        ctx[c0:c1].sort(axis=1)


def sorted_grounded_context(x3: np.ndarray, c: float) -> np.ndarray:
    """``(C, M + 2)`` sorted rows: every value of channel ``c`` of ``x3`` ``(N, C, L)``, and ``-c, +c``
    [QACT, Alg. 1], by numpy's sort of the values alone (x86-simd-sort; no permutation is kept).
    Each thread gathers and sorts its own range of rows (one parallel region, the rows still in
    cache when sorted)."""
    n, ch, length = x3.shape
    ctx = np.empty((ch, n * length + 2), dtype=x3.dtype)
    parallel_ranges(_gather_and_sort, ch, ctx.size * 4, x3, c, ctx)
    return ctx


def all_finite(x3: np.ndarray) -> bool:
    """Whether every value of ``x3`` is finite (one vectorised pass)."""
    return bool(_all_finite(x3.reshape(-1)))


def sorted_context_finite(ctx: np.ndarray) -> bool:
    """Whether the sorted grounded context ``ctx`` holds no NaN or inf (sorted rows keep them at the
    ends: numpy sorts NaN last)."""
    return bool(_ends_finite(ctx))
