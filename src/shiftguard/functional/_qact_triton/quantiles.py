"""Stage 1: the weighted quantiles of each sorted grounded context row [QACT, Alg. 1, eqs. (8)-(9)], with
the row's count of negative entries and its values' range."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shiftguard.functional._qact_triton.common import constant, f64_bits, ieee_div


@triton.jit
def _position(k, n_neg, nn, np_):
    # quantile._grounded_position: the midpoint CDF position of sorted entry k (same operations)
    kf = k.to(nn.dtype)
    return tl.where(k < n_neg, ieee_div(kf + 0.5, 2 * nn), 0.5 + ieee_div(kf - nn + 0.5, 2 * np_))


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def _grounded_quantiles_kernel(
    ctx_ptr, nneg_ptr, q_ptr, xmin_ptr, xmax_ptr, K, n_tau, STEPS, c_bits, BLOCK_T: tl.constexpr
):
    # quantile._grounded_quantiles for row c: the bracket k (largest with p_k <= tau) in closed
    # form, two correction steps against the exact positions, linear interpolation, clamping, and
    # the running maximum
    c = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_T)
    live = i < n_tau
    row = ctx_ptr + c * K
    # the levels tau_i = i / (n_tau + 1), i = 1..n_tau, as quantile.quantile_levels rounds them
    # (in float64, then to the row's dtype)
    tau = ieee_div((i + 1).to(tl.float64), tl.cast(n_tau + 1, tl.float64)).to(ctx_ptr.dtype.element_ty)
    # the row's entries below 0 (torch.searchsorted(row, 0) of the sorted row), stored for the draws
    lo = c * 0  # (int64 scalars)
    hi = c * 0 + K
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        negative = (mid < hi) & (tl.load(row + tl.minimum(mid, K - 1)) < 0)
        lo = tl.where(negative, mid + 1, lo)
        hi = tl.where(negative | (mid >= hi), hi, mid)
    n_neg = lo
    tl.store(nneg_ptr + c, n_neg)
    # the smallest and the largest of the row's values, the row without one -c and one +c (for the
    # KDE grid's range): below -c the first entry is a value; else, with one -c taken out, the next
    # is one unless it is +c (a value or the bound), in which case the one after is (K >= 3)
    bound = constant(c_bits, ctx_ptr.dtype.element_ty)
    a0, a1, a2 = tl.load(row), tl.load(row + 1), tl.load(row + 2)
    tl.store(xmin_ptr + c, tl.where(a0 < -bound, a0, tl.where(a1 < bound, a1, a2)))
    b0, b1, b2 = tl.load(row + K - 1), tl.load(row + K - 2), tl.load(row + K - 3)
    tl.store(xmax_ptr + c, tl.where(b0 > bound, b0, tl.where(b1 > -bound, b1, b2)))
    nn = n_neg.to(tau.dtype)
    np_ = K - nn
    k_neg = tl.floor(2.0 * tau * nn - 0.5)
    k_pos = nn + tl.floor((tau - 0.5) * 2.0 * np_ - 0.5)
    k = tl.where(tau < 0.5, k_neg, k_pos).to(tl.int64)
    k = tl.minimum(tl.maximum(k, -1), K - 1)
    for _ in tl.static_range(2):
        up = (k + 1 <= K - 1) & (_position(tl.minimum(k + 1, K - 1), n_neg, nn, np_) <= tau)
        down = (k >= 0) & (_position(tl.maximum(k, 0), n_neg, nn, np_) > tau)
        k = k + up.to(tl.int64) - down.to(tl.int64)
    below = k < 0
    above = k >= K - 1
    k = tl.minimum(tl.maximum(k, 0), K - 2)
    p0 = _position(k, n_neg, nn, np_)
    p1 = _position(k + 1, n_neg, nn, np_)
    v0 = tl.load(row + k, mask=live, other=0.0)
    v1 = tl.load(row + k + 1, mask=live, other=0.0)
    t = ieee_div(tau - p0, p1 - p0)
    q = v0 + t * (v1 - v0)
    q = tl.where(below, tl.load(row), q)
    q = tl.where(above, tl.load(row + K - 1), q)
    q = tl.where(live, q, tl.load(row + K - 1))  # (padding: not stored, keeps the scan's maximum)
    q = tl.associative_scan(q, 0, _maximum)
    tl.store(q_ptr + c * n_tau + i, q, mask=live)


def grounded_quantiles(ctx: torch.Tensor, n_tau: int, c: float) -> tuple[torch.Tensor, ...]:
    """``(quantiles, n_neg, xmin, xmax)``: the ``(C, n_tau)`` weighted quantiles of the sorted grounded
    context ``ctx`` ``(C, K)`` (each row's values with ``-c`` and ``+c``, sorted; ``K >= 3``) at
    ``quantile.quantile_levels(n_tau)`` -- the values of ``quantile._grounded_quantiles`` -- the
    ``(C,)`` int64 count of each row's entries below 0, and the ``(C,)`` smallest and largest of each
    row's values (``torch.aminmax`` of the rows without the bounds; with NaN in a row, unspecified)."""
    ch, k_dim = ctx.shape
    q = torch.empty(ch, n_tau, dtype=ctx.dtype, device=ctx.device)
    n_neg = torch.empty(ch, dtype=torch.int64, device=ctx.device)
    xmin = torch.empty(ch, dtype=ctx.dtype, device=ctx.device)
    xmax = torch.empty_like(xmin)
    _grounded_quantiles_kernel[(ch,)](
        ctx.contiguous(),
        n_neg,
        q,
        xmin,
        xmax,
        k_dim,
        n_tau,
        k_dim.bit_length(),
        f64_bits(float(c)),
        BLOCK_T=triton.next_power_of_2(n_tau),
        enable_fp_fusion=False,  # (no fused multiply-add: the eager code rounds each operation)
    )
    return q, n_neg, xmin, xmax
