"""Exact rescaling for scale-safe distance computations.

Multiplying by a power of two changes only exponents, so it commutes with rounding: dividing
embeddings by ``2**e`` before squaring differences keeps squared distances of huge or tiny (but
finite) inputs from overflowing or vanishing, while ordinary inputs (``e = 0``) are left bit for
bit as they are. Used by the distance-ratio losses and heads, NED and the probabilistic losses.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["ldexp", "distance_scale_exponent", "normalize_rows"]


def ldexp(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t * 2**n`` for any int ``n``, exact wherever the result is a normal number of ``t``'s dtype.

    Multiplying by a power of two only changes exponents, so it commutes with rounding; the factor
    is applied in steps of at most ``2**±64`` so that no factor itself overflows or underflows (a
    single ``2**n`` is not representable for ``|n|`` beyond the dtype's exponent range). Differentiable.
    """
    step = 64
    while n != 0:
        part = max(-step, min(step, n))
        t = t * (2.0**part)
        n -= part
    return t


def distance_scale_exponent(*tensors: torch.Tensor, dim: Optional[int] = None, lower: bool = True) -> int:
    """Exponent ``e`` for which squared distances of ``tensors / 2**e`` can neither overflow nor vanish.

    Returns 0 (no rescaling: ordinary inputs are left bit for bit as they are) when the largest
    magnitude ``m`` lies in ``[lo, hi]`` with ``hi = sqrt(max / (8 * dim))`` (a sum of ``dim``
    squared differences of size ``<= 2 m`` stays below half the dtype's maximum) and ``lo =
    sqrt(tiny) / eps`` (squares of differences of ``m``'s size stay normal numbers; ``lower=False``
    drops this bound). Otherwise ``e`` is the binary exponent of ``m`` (``m / 2**e`` in ``[0.5, 1)``).
    ``dim`` defaults to the last dimension of the first tensor. All-zero input gives 0.
    """
    ref = tensors[0]
    finfo = torch.finfo(ref.dtype)
    d = max(1, int(dim if dim is not None else ref.shape[-1]))
    m = max((float(t.detach().abs().max()) for t in tensors if t.numel()), default=0.0)
    hi = max(math.sqrt(finfo.max / (8.0 * d)), 2.0)
    lo = min(math.sqrt(finfo.tiny) / finfo.eps, 0.25) if lower else 0.0
    if m == 0.0 or lo <= m <= hi:
        return 0
    return math.frexp(m)[1]


def normalize_rows(x: torch.Tensor) -> torch.Tensor:
    """``F.normalize(x, dim=1)`` that is exact in scale: ``x / ||x||`` for every non-zero row, any magnitude.

    ``F.normalize`` squares the entries (overflow beyond ~1e19 in float32 gives a zero row) and divides
    by ``max(||x||, 1e-12)`` (tiny rows do not reach unit length). Rows whose largest magnitude lies
    outside ``[2**-30, distance_scale_exponent's hi]`` are first divided by a power of two (exact) that
    brings it to ``[0.5, 1)``; other rows, and all-ordinary input, go through ``F.normalize`` unchanged.
    Zero rows stay zero. ``x``: ``(N, D)`` floating; returns the same shape and dtype.
    """
    if x.numel() == 0:
        return F.normalize(x, dim=1)
    finfo = torch.finfo(x.dtype)
    hi = max(math.sqrt(finfo.max / (8.0 * max(1, x.shape[1]))), 2.0)
    amax = x.detach().abs().amax(dim=1, keepdim=True)
    off = (amax > 0) & ((amax < 2.0**-30) | (amax > hi))
    if not bool(off.any()):
        return F.normalize(x, dim=1)
    _, exponent = torch.frexp(torch.where(off, amax, torch.ones_like(amax)))
    exponent = torch.where(off, exponent, torch.zeros_like(exponent))
    # Two half-steps keep each factor 2**(-k/2) representable in the dtype.
    half = torch.div(exponent, 2, rounding_mode="floor")
    scaled = x * torch.pow(2.0, -half.to(x.dtype)) * torch.pow(2.0, -(exponent - half).to(x.dtype))
    return F.normalize(scaled, dim=1)
