"""Stage 0: the grounded context rows [QACT, Alg. 1]: every value of the input's channel ``c`` in the order
of :func:`~shiftguard.functional.quantile.channel_values`, then ``-c`` and ``+c`` -- what
``quantile._grounded(channel_values(x), c)`` makes with a transposed copy, two fills and a
concatenation, in one launch, ready for the sort."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shiftguard.functional._qact_triton.common import constant, f64_bits


@triton.jit
def _grounded_context_kernel(x_ptr, out_ptr, total, C, L, M, c_bits, BLOCK: tl.constexpr):
    # lanes [0, total): x[n, c, l] (contiguous (N, C, L)) to out[c, n * L + l]; lanes
    # [total, total + 2 C): the grounding values, out[c, M] = -c and out[c, M + 1] = +c
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    value = i < total
    n = i // (C * L)
    ch = (i // L) % C
    v = tl.load(x_ptr + i, mask=value, other=0.0)
    tl.store(out_ptr + ch * (M + 2) + n * L + i % L, v, mask=value)
    j = i - total
    ground = (j >= 0) & (j < 2 * C)
    bound = constant(c_bits, v.dtype)  # (the Python float rounded to the dtype, as torch's fill)
    side = j % 2
    g = tl.where(side == 0, -bound, bound)
    tl.store(out_ptr + (j // 2) * (M + 2) + M + side, g, mask=ground)


def grounded_context(x: torch.Tensor, c: float) -> torch.Tensor:
    """``(C, M + 2)``: row ``c`` holds every value of ``x[:, c, ...]`` (``x`` ``(N, C, *)``, ``M = N *
    prod(*)``) in :func:`~shiftguard.functional.quantile.channel_values`'s order, then ``-c`` and
    ``+c`` in ``x``'s dtype: ``quantile._grounded(channel_values(x), c)``, bit for bit."""
    x = x.contiguous()
    ch = x.shape[1]
    total = x.numel()
    m = total // ch
    out = torch.empty(ch, m + 2, dtype=x.dtype, device=x.device)
    block = 1024
    _grounded_context_kernel[(triton.cdiv(total + 2 * ch, block),)](
        x, out, total, ch, m // x.shape[0], m, f64_bits(float(c)), BLOCK=block
    )
    return out
