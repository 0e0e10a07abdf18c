"""Stage 1b: the KDE samples of each sorted grounded context row, drawn by systematic sampling with the
grounding weights [QACT, Alg. 2; ``quantile.py``, "Sampling"], in one kernel.

Draw ``s`` of channel ``c`` is the first sorted entry ``k`` whose comb count ``c_k = ceil(S P_k - U)``
exceeds ``s`` (``torch.searchsorted(counts, s, right=True)`` of ``quantile._draw_samples``): found by a
binary search over ``k`` whose counts are computed on the fly with the operations of
``quantile._comb_counts`` in the same order (float64, no fused multiply-add), so the samples are the
eager code's bit for bit. The comb offset ``U`` comes in as a tensor (drawn from a generator) or is
computed here from a seed: 32 bits of ``SplitMix64(seed + c)``, as ``quantile._comb_offsets`` and the
compiled CPU kernels compute it. One launch in place of the eager code's two dozen.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from shiftguard.functional._qact_triton.common import constant, f64_bits, ieee_div, ieee_sqrt


@triton.jit
def _splitmix64(key):
    # shiftguard._numba.splitmix64 on uint64 (wrapping products, logical shifts)
    z = key * 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _comb_count(k, last, kf_dim, nn, s_f, u):
    # quantile._comb_counts for entries k (same operations); the last entry's count is S
    kf = k.to(tl.float64)
    neg = (s_f * (kf + 1.0)) / (2.0 * nn)
    pos = 0.5 * s_f + (s_f * (kf + 1.0 - nn)) / (2.0 * (kf_dim - nn))
    count = tl.ceil(tl.where(kf < nn, neg, pos) - u)
    return tl.where(k == last, s_f, count)


@triton.jit
def _sorted_quantile(vz, s, lo, hi, frac):
    # kde._sorted_quantile: v[lo] + (pos - lo) * (v[hi] - v[lo]), the entries picked out of the row
    v_lo = tl.sum(tl.where(s == lo, vz, 0.0), axis=0)
    v_hi = tl.sum(tl.where(s == hi, vz, 0.0), axis=0)
    return v_lo + constant(frac, vz.dtype) * (v_hi - v_lo)


@triton.jit
def _silverman(v, s, live, S, lo25, hi25, frac25, lo75, hi75, frac75, c_iqr, c_floor, c_scale, c_pow):
    # kde.silverman_bandwidth of one sorted row held whole in v (S >= 1 values where live):
    # 0.9 * A * S^(-1/5), A = min(std, IQR / 1.34), falling back to std, then to 1e-3 max(1, max|v|)
    dt = v.dtype
    vz = tl.where(live, v, 0.0)
    mean = ieee_div(tl.sum(vz, axis=0), tl.cast(S, dt))
    d = tl.where(live, v - mean, 0.0)
    std = tl.where(S > 1, ieee_sqrt(ieee_div(tl.sum(d * d, axis=0), tl.cast(tl.maximum(S - 1, 1), dt))), 0.0)
    q25 = _sorted_quantile(vz, s, lo25, hi25, frac25)
    q75 = _sorted_quantile(vz, s, lo75, hi75, frac75)
    iqr = ieee_div(q75 - q25, constant(c_iqr, dt))
    a = tl.minimum(std, iqr)
    a = tl.where(a > 0, a, std)
    floor = constant(c_floor, dt) * tl.maximum(tl.max(tl.abs(vz), axis=0), 1.0)
    a = tl.where(a > 0, a, floor)
    return constant(c_scale, dt) * a * constant(c_pow, dt)


@triton.jit
def _draws_kernel(
    ctx_ptr,
    nneg_ptr,
    seed_ptr,
    u_ptr,
    out_ptr,
    bw_ptr,
    lo25,
    hi25,
    frac25,
    lo75,
    hi75,
    frac75,
    c_iqr,
    c_floor,
    c_scale,
    c_pow,
    K,
    S,
    STEPS,
    FROM_SEED: tl.constexpr,
    SILVERMAN: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    live = s < S
    if FROM_SEED:
        key = (tl.load(seed_ptr) + c).to(tl.uint64, bitcast=True)
        u = (_splitmix64(key) >> 32).to(tl.float64) * (1.0 / 4294967296.0)
    else:
        u = tl.load(u_ptr + c)
    nn = tl.load(nneg_ptr + c).to(tl.float64)
    kf_dim = tl.cast(K, tl.float64)  # (not K * 1.0: a float32 product, inexact from K = 2^24)
    s_f = tl.cast(S, tl.float64)
    sf = s.to(tl.float64)
    # the first k with c_k > s, in [0, K - 1] (c_{K-1} = S > s): lo <= answer <= hi throughout
    lo = tl.zeros([BLOCK_S], dtype=tl.int64)
    hi = tl.zeros([BLOCK_S], dtype=tl.int64) + (K - 1)
    for _ in range(STEPS):
        mid = (lo + hi) // 2
        above = _comb_count(mid, K - 1, kf_dim, nn, s_f, u) > sf
        hi = tl.where(above, mid, hi)
        lo = tl.where(above, lo, mid + 1)
    v = tl.load(ctx_ptr + c * K + lo, mask=live, other=0.0)
    tl.store(out_ptr + c * S + s, v, mask=live)
    if SILVERMAN:  # (one program holds the channel's whole sample, sorted by construction)
        h = _silverman(v, s, live, S, lo25, hi25, frac25, lo75, hi75, frac75, c_iqr, c_floor, c_scale, c_pow)
        tl.store(bw_ptr + c, h)


#: Samples per channel up to which one program draws them all and computes their bandwidth too.
SILVERMAN_MAX_SAMPLES = 4096


def _quartile_positions(n: int) -> list[int]:
    """``kde._sorted_quantile``'s bracket of the 0.25 and 0.75 quantiles of ``n`` sorted values: for
    each, the indices ``lo, hi`` and the bit pattern of the weight ``pos - lo``."""
    out = []
    for level in (0.25, 0.75):
        pos = level * (n - 1)
        lo = int(math.floor(pos))
        out += [lo, min(lo + 1, n - 1), f64_bits(pos - lo)]
    return out


def systematic_draws(
    ctx: torch.Tensor,
    n_neg: torch.Tensor,
    n_samples: int,
    seed: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
    silverman: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """``(samples, bandwidth)``: the ``(C, S)`` sorted samples of the sorted grounded context ``ctx``
    ``(C, K)`` with ``n_neg`` ``(C,)`` entries below 0 a row, ``S = n_samples >= 1`` -- the samples of
    ``quantile._draw_samples`` for the comb offsets ``offsets`` ``(C,)`` / ``(C, 1)`` float64, or for
    those of the one-element integer ``seed`` (exactly one of the two) -- and, where ``silverman``
    and ``S <= SILVERMAN_MAX_SAMPLES``, their ``(C,)`` Silverman bandwidths computed in the same
    program (``kde.silverman_bandwidth``'s formula; its sums in another order, so equal to rounding,
    not bit for bit); else None."""
    if (seed is None) == (offsets is None):
        raise ValueError("seed: expected either a seed or the offsets")
    ch, k_dim = ctx.shape
    out = torch.empty(ch, n_samples, dtype=ctx.dtype, device=ctx.device)
    fused = silverman and n_samples <= SILVERMAN_MAX_SAMPLES
    block = triton.next_power_of_2(n_samples) if fused else min(1024, triton.next_power_of_2(n_samples))
    bw = torch.empty(ch, dtype=ctx.dtype, device=ctx.device) if fused else None

    from_seed = seed is not None
    # (the pointer the kernel does not read is given any tensor of the device)
    seed_t = seed.reshape(1).to(device=ctx.device, dtype=torch.int64) if seed is not None else n_neg
    u = offsets.reshape(ch).to(device=ctx.device, dtype=torch.float64).contiguous() if offsets is not None else out
    _draws_kernel[(ch, triton.cdiv(n_samples, block))](
        ctx.contiguous(),
        n_neg.contiguous(),
        seed_t,
        u,
        out,
        out if bw is None else bw,
        *_quartile_positions(n_samples),
        f64_bits(1.34),
        f64_bits(1e-3),
        f64_bits(0.9),
        f64_bits(n_samples ** (-0.2)),
        k_dim,
        n_samples,
        max(1, (k_dim - 1).bit_length()),
        FROM_SEED=from_seed,
        SILVERMAN=fused,
        BLOCK_S=block,
        enable_fp_fusion=False,  # (no fused multiply-add: the eager code rounds each operation)
    )
    return out, bw
