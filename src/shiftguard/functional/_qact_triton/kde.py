"""Stage 2: the KDE grid of the backward [QACT, Alg. 2, eq. (7)]: its layout (``kde.grid_layout``, computed
in the kernel) and each node the Gaussian kernel sum over the channel's samples, truncated at
``truncate * h``."""

from __future__ import annotations

import math

import numpy as np
import torch
import triton
import triton.language as tl

from shiftguard.functional._qact_triton.common import constant, f64_bits, ieee_div

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _kde_grid_kernel(
    s_ptr,
    h_ptr,
    xmin_ptr,
    xmax_ptr,
    lo_ptr,
    delta_ptr,
    n_ptr,
    grid_ptr,
    S,
    G,
    truncate,
    per_h,
    max_points,
    scale,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    h = tl.load(h_ptr + c)
    # kde.grid_layout (same operations): the sample range by a pass over the row (samples given
    # from elsewhere need not be sorted), the nodes' start, spacing and count; stored once
    offs = tl.arange(0, BLOCK_S)
    smin = tl.full([BLOCK_S], float("inf"), h.dtype)
    smax = tl.full([BLOCK_S], float("-inf"), h.dtype)
    for s0 in range(0, S, BLOCK_S):
        k = s0 + offs
        v = tl.load(s_ptr + c * S + k, mask=k < S, other=0.0)
        smin = tl.where(k < S, tl.minimum(smin, v), smin)
        smax = tl.where(k < S, tl.maximum(smax, v), smax)
    lo = tl.maximum(tl.load(xmin_ptr + c), tl.min(smin, axis=0) - truncate * h)
    hi = tl.maximum(tl.minimum(tl.load(xmax_ptr + c), tl.max(smax, axis=0) + truncate * h), lo)
    delta = tl.maximum(ieee_div(h, tl.cast(per_h, h.dtype)), ieee_div(hi - lo, tl.cast(max_points - 1, h.dtype)))
    n = tl.ceil(ieee_div(hi - lo, delta)).to(tl.int64) + 2
    if tl.program_id(1) == 0:
        tl.store(lo_ptr + c, lo)
        tl.store(delta_ptr + c, delta)
        tl.store(n_ptr + c, n)
    # grid[c, j] = scale / h * sum_s phi((lo + j delta - s) / h) over |.| <= truncate, for j < n
    if tl.program_id(1) * BLOCK_G >= n:  # (the grid is allocated for the widest channel possible)
        return
    j = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    live = j < n
    node = lo + j.to(h.dtype) * delta
    acc = tl.zeros([BLOCK_G], dtype=h.dtype)
    for s0 in range(0, S, BLOCK_S):
        k = s0 + offs
        s = tl.load(s_ptr + c * S + k, mask=k < S, other=0.0)
        z = (node[:, None] - s[None, :]) / h
        w = tl.exp(-0.5 * z * z)
        w = tl.where((tl.abs(z) <= truncate) & (k < S)[None, :], w, 0.0)
        acc += tl.sum(w, axis=1)
    tl.store(grid_ptr + c * G + j, acc * (constant(scale, h.dtype) / h), mask=live & (j < G))


def kde_grid(
    samples: torch.Tensor,
    bandwidth: torch.Tensor,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    points_per_bandwidth: int,
    truncate: float,
    max_points: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grid, lo, delta, n_nodes)``: the nodes of :func:`shiftguard.functional.kde.grid_layout` for
    the samples ``(C, S)`` (any order), bandwidths ``(C,)`` and query range ``[xmin, xmax]``
    ``(C,)`` with ``points_per_bandwidth`` and ``max_points`` (the same values: the same operations),
    and the KDE values on them, ``(C, max_points + 2)`` (``n_nodes[c] <= max_points + 2``; the rest
    unset: the allocation needs no value read back). All in one dtype but ``n_nodes`` (int64)."""
    if float(np.float32(truncate)) != float(truncate):  # (a float kernel argument is float32)
        raise ValueError(f"truncate: expected a value exact in float32, got {truncate!r}")
    ch, s_dim = samples.shape
    capacity = max_points + 2
    grid = torch.empty(ch, capacity, dtype=samples.dtype, device=samples.device)
    lo = torch.empty(ch, dtype=samples.dtype, device=samples.device)
    delta = torch.empty_like(lo)
    n_nodes = torch.empty(ch, dtype=torch.int64, device=samples.device)
    block_g = 64
    _kde_grid_kernel[(ch, triton.cdiv(capacity, block_g))](
        samples.contiguous(),
        bandwidth.contiguous(),
        xmin.contiguous(),
        xmax.contiguous(),
        lo,
        delta,
        n_nodes,
        grid,
        s_dim,
        capacity,
        float(truncate),
        int(points_per_bandwidth),
        int(max_points),
        f64_bits(_INV_SQRT_2PI / s_dim),
        BLOCK_G=block_g,
        BLOCK_S=64,
        enable_fp_fusion=False,  # (the layout rounds each operation as grid_layout does)
    )
    return grid, lo, delta, n_nodes
