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

from typing import Optional

import torch
import triton
import triton.language as tl


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
def _draws_kernel(
    ctx_ptr, nneg_ptr, seed_ptr, u_ptr, out_ptr, K, S, STEPS, FROM_SEED: tl.constexpr, BLOCK_S: tl.constexpr
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
    kf_dim = K * 1.0
    s_f = S * 1.0
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


def systematic_draws(
    ctx: torch.Tensor,
    n_neg: torch.Tensor,
    n_samples: int,
    seed: Optional[torch.Tensor] = None,
    offsets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(C, S)`` sorted samples of the sorted grounded context ``ctx`` ``(C, K)`` with ``n_neg``
    ``(C,)`` entries below 0 a row, ``S = n_samples >= 1``: the samples of ``quantile._draw_samples``
    for the comb offsets ``offsets`` ``(C,)`` / ``(C, 1)`` float64, or for those of the one-element
    integer ``seed`` (exactly one of the two)."""
    if (seed is None) == (offsets is None):
        raise ValueError("seed: expected either a seed or the offsets")
    ch, k_dim = ctx.shape
    out = torch.empty(ch, n_samples, dtype=ctx.dtype, device=ctx.device)
    block = min(1024, triton.next_power_of_2(n_samples))
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
        k_dim,
        n_samples,
        max(1, (k_dim - 1).bit_length()),
        FROM_SEED=from_seed,
        BLOCK_S=block,
        enable_fp_fusion=False,  # (no fused multiply-add: the eager code rounds each operation)
    )
    return out
