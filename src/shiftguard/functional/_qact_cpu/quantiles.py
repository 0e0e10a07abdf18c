"""Stage 2: the weighted quantiles of a sorted grounded context row [QACT, Alg. 1, eqs. (8)-(9)] by the
closed-form midpoint positions of the grounding weights, in float64, rounded once to the row's dtype
(the arithmetic of ``quantile._grounded_quantiles``)."""

from __future__ import annotations

import functools
import math

import numpy as np

from shiftguard._numba import njit
from shiftguard._parallel import parallel_ranges
from shiftguard.functional._qact_cpu.common import _U


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


@njit  # per channel: a call of its own, not inlined in numba's IR (shiftguard._numba)
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


# The bracket of a quantile level (the entries it interpolates between and the weight) depends only
# on the row length and the number of negative entries: for rows of up to _BRACKETS_MAX_ROW entries
# the brackets of all levels for every possible count are computed once per (row length, n_tau) and
# looked up (the same float64 operations, so the same quantiles; computed per channel each level
# branches on three divisions). A table holds (K + 1) n_tau brackets (2.4 MB at K = 2048,
# n_tau = 100) and is built once per (K, n_tau): the bounds below keep it in cache.
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
    parallel_ranges(
        _grounded_quantiles, ctx.shape[0], ctx.shape[0] * n_tau * 16, ctx, n_tau, *_brackets(ctx.shape[1], n_tau), q
    )
    return q
