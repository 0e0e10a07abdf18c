"""Stage 3: every value's forward output [QACT, eq. (6)] and, for the backward, its KDE density
(Alg. 2, eq. (7)), in one pass over the input in its ``(N, C, *)`` layout, which also tells whether the
input holds NaN or inf."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from shiftguard.functional._qact_triton.common import ieee_div


@triton.jit
def _levels_kernel(
    x_ptr,
    q_ptr,
    out_ptr,
    grid_ptr,
    lo_ptr,
    delta_ptr,
    n_ptr,
    dens_ptr,
    finite_ptr,
    total,
    C,
    L,
    n_tau,
    G,
    LOG_T: tl.constexpr,
    DENSITY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = i < total
    c = (i // L) % C
    v = tl.load(x_ptr + i, mask=live, other=0.0)
    # the input's NaN/inf check, one flag a program (every flag written: no zeroed buffer needed)
    tl.store(finite_ptr + tl.program_id(0), tl.min((tl.abs(v) < float("inf")).to(tl.int8), axis=0))
    # #{k : q_k <= v}: the quantiles are non-decreasing, so a binary search over the count
    cnt = tl.zeros([BLOCK], dtype=tl.int64)
    for b in tl.static_range(LOG_T):
        cand = cnt + (1 << (LOG_T - 1 - b))
        ok = live & (cand <= n_tau)
        qv = tl.load(q_ptr + c * n_tau + cand - 1, mask=ok, other=0.0)
        cnt = tl.where(ok & (qv <= v), cand, cnt)
    # the value k / n_tau as the eager code rounds it (torch.arange(n_tau + 1, dtype).div_(n_tau))
    tl.store(out_ptr + i, ieee_div(cnt.to(v.dtype), tl.cast(n_tau, v.dtype)), mask=live)
    if DENSITY:
        # gaussian_kde_grid's interpolation: position on the grid, 0 off it, torch.lerp, clamp at 0
        lo = tl.load(lo_ptr + c, mask=live, other=0.0)
        delta = tl.load(delta_ptr + c, mask=live, other=1.0)
        n = tl.load(n_ptr + c, mask=live, other=2)
        pos = (v - lo) / delta
        inside = (pos >= 0) & (pos <= (n - 1).to(pos.dtype))
        j0 = tl.minimum(tl.maximum(tl.floor(pos), 0.0), (n - 2).to(pos.dtype))
        t = pos - j0
        # (clamped as an integer too: a NaN value, refused after this pass, must not index off the grid)
        j = tl.minimum(tl.maximum(j0.to(tl.int64), 0), G - 2)
        d0 = tl.load(grid_ptr + c * G + j, mask=live, other=0.0)
        d1 = tl.load(grid_ptr + c * G + j + 1, mask=live, other=0.0)
        d = tl.where(t < 0.5, d0 + t * (d1 - d0), d1 - (d1 - d0) * (1 - t))
        d = tl.maximum(tl.where(inside, d, 0.0), 0.0)
        tl.store(dens_ptr + i, d, mask=live)


def levels_and_density(
    x: torch.Tensor,
    quantiles: torch.Tensor,
    grid: Optional[torch.Tensor] = None,
    lo: Optional[torch.Tensor] = None,
    delta: Optional[torch.Tensor] = None,
    n_nodes: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """``(output, density, finite)``: the forward output of every value of ``x`` ``(N, C, *)`` against
    the channels' non-decreasing ``quantiles`` ``(C, n_tau)`` (``k / n_tau`` in x's dtype for ``k``
    quantiles ``<= x``), and, with a grid (:func:`kde_grid`'s ``(C, G)`` on nodes ``lo + j * delta``,
    ``j < n_nodes``), the density at every value (else None), both shaped like ``x``; and int8 flags,
    all 1 exactly when ``x`` holds no NaN or inf (one a program: ``finite.all()`` is the verdict)."""
    x = x.contiguous()
    ch, n_tau = quantiles.shape
    total = x.numel()
    length = total // (x.shape[0] * ch)
    out = torch.empty_like(x)
    block = 256
    launch = (triton.cdiv(total, block),)
    finite = torch.empty(launch[0], dtype=torch.int8, device=x.device)
    common = dict(LOG_T=max(1, int(n_tau).bit_length()), BLOCK=block)
    q = quantiles.contiguous()
    if grid is None or lo is None or delta is None or n_nodes is None:
        # (the density's pointers are not read: the values' own stand in for them)
        _levels_kernel[launch](x, q, out, q, q, q, q, out, finite, total, ch, length, n_tau, 0, DENSITY=False, **common)
        return out, None, finite
    dens = torch.empty_like(x)
    _levels_kernel[launch](
        x,
        q,
        out,
        grid,
        lo,
        delta,
        n_nodes,
        dens,
        finite,
        total,
        ch,
        length,
        n_tau,
        grid.shape[1],
        DENSITY=True,
        **common,
    )
    return out, dens, finite
