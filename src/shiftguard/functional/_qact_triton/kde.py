"""Stage 2: the KDE grid of the backward [QACT, Alg. 2, eq. (7)]: each node the Gaussian kernel sum over
the channel's samples, truncated at ``truncate * h``."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@triton.jit
def _kde_grid_kernel(
    s_ptr,
    h_ptr,
    lo_ptr,
    delta_ptr,
    n_ptr,
    grid_ptr,
    S,
    G,
    truncate,
    scale,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # grid[c, j] = scale / h * sum_s phi((lo + j delta - s) / h) over |.| <= truncate, for j < n[c]
    c = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + c)
    if tl.program_id(1) * BLOCK_G >= n:  # (the grid is allocated for the widest channel possible)
        return
    j = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    live = j < n
    h = tl.load(h_ptr + c)
    lo = tl.load(lo_ptr + c)
    delta = tl.load(delta_ptr + c)
    node = lo + j.to(h.dtype) * delta
    acc = tl.zeros([BLOCK_G], dtype=h.dtype)
    for s0 in range(0, S, BLOCK_S):
        k = s0 + tl.arange(0, BLOCK_S)
        s = tl.load(s_ptr + c * S + k, mask=k < S, other=0.0)
        z = (node[:, None] - s[None, :]) / h
        w = tl.exp(-0.5 * z * z)
        w = tl.where((tl.abs(z) <= truncate) & (k < S)[None, :], w, 0.0)
        acc += tl.sum(w, axis=1)
    tl.store(grid_ptr + c * G + j, acc * (scale / h), mask=live & (j < G))


def kde_grid(
    samples: torch.Tensor,
    bandwidth: torch.Tensor,
    lo: torch.Tensor,
    delta: torch.Tensor,
    n_nodes: torch.Tensor,
    max_nodes: int,
    truncate: float,
) -> torch.Tensor:
    """``(C, max_nodes)`` KDE values on the nodes ``lo + j * delta``, ``j < n_nodes[c]`` (the rest
    unset), of the samples ``(C, S)`` with bandwidths ``(C,)`` (all in one dtype; ``n_nodes`` int64,
    at most ``max_nodes``: the allocation needs no value read back)."""
    ch, s_dim = samples.shape
    grid = torch.empty(ch, max_nodes, dtype=samples.dtype, device=samples.device)
    block_g = 64
    _kde_grid_kernel[(ch, triton.cdiv(max_nodes, block_g))](
        samples.contiguous(),
        bandwidth.contiguous(),
        lo.contiguous(),
        delta.contiguous(),
        n_nodes.contiguous(),
        grid,
        s_dim,
        max_nodes,
        float(truncate),
        _INV_SQRT_2PI / s_dim,
        BLOCK_G=block_g,
        BLOCK_S=64,
    )
    return grid
