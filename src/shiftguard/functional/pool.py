"""2x2 max pooling with stride 2 on the CPU, as elementwise maxima of strided views.

``torch.nn.functional.max_pool2d`` runs a generic window kernel on the CPU that also records every
window's argmax: about 14 ms for 1,000 inputs of 6 x 28 x 28 (LeNet's first pool) on two cores,
more than the convolution before it. For a 2 x 2 window with stride 2 the pooling is two
elementwise maxima: rows ``2i`` and ``2i + 1``, then columns ``2j`` and ``2j + 1`` of the result,
about 12x faster at that shape (``docs/performance.md``). This module is that pooling, with
torch's results:

- forward: the same values bit for bit (a maximum does not depend on the order it is taken in;
  a window holding a NaN gives NaN, as in ``max_pool2d``);
- backward: when a gradient is needed, the forward is instead a compiled pass (numba) that also
  records each window's argmax exactly as ``max_pool2d``'s CPU kernel does -- it scans a window
  row by row and takes an element when ``value > max or isnan(value)``: the first maximum in
  row-major order, the last NaN of a window that has one, the first element of a window of -inf
  -- and the backward is torch's own ``max_pool2d_with_indices_backward`` with those indices, so
  the gradients are torch's. Recovering the argmax with tensor operations after the fact costs
  more than ``max_pool2d`` itself (3 ms against 1.2 ms for its backward at 256 x 6 x 28 x 28).

Odd heights or widths drop the last row or column, as ``max_pool2d`` without ``ceil_mode`` does.
Written here (no library has it); checked against ``max_pool2d`` in ``tests/test_pool.py``.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shiftguard import _numba
from shiftguard._numba import njit
from shiftguard._parallel import parallel_ranges

__all__ = ["max_pool2x2", "max_pool2x2_applies", "warm_up"]

_DTYPES = (torch.float32, torch.float64)


def max_pool2x2_applies(x: torch.Tensor) -> bool:
    """Whether :func:`max_pool2x2` takes its own path for ``x``: a 4-D float32/float64 CPU tensor
    with at least 2 x 2 pixels (anything else goes to ``max_pool2d``)."""
    return x.device.type == "cpu" and x.dim() == 4 and x.dtype in _DTYPES and x.shape[2] >= 2 and x.shape[3] >= 2


def _pool(x: torch.Tensor) -> torch.Tensor:
    h, w = x.shape[2] // 2, x.shape[3] // 2
    rows = torch.maximum(x[:, :, 0 : 2 * h : 2, : 2 * w], x[:, :, 1 : 2 * h : 2, : 2 * w])  # (N, C, h, 2w)
    return torch.maximum(rows[..., 0::2], rows[..., 1::2])


@njit(inline="always")
def _takes(v, m):  # pragma: no cover - compiled
    """``max_pool2d``'s CPU rule: a later window element replaces the running maximum ``m``."""
    return v > m or v != v


@njit(nogil=True, cache=True)
def _pool_with_indices(lo, hi, x, out, idx):  # pragma: no cover - compiled
    """Planes ``lo:hi`` of ``x`` ``(P, H, W)``: each 2 x 2 window's maximum into ``out`` ``(P, h, w)``
    and its flat ``H * W`` index into ``idx``, the element ``max_pool2d`` records (:func:`_takes`
    over the window in row-major order)."""
    width = x.shape[2]
    for p in range(lo, hi):
        for i in range(out.shape[1]):
            r = 2 * i
            for j in range(out.shape[2]):
                c = 2 * j
                m = x[p, r, c]
                k = r * width + c
                v = x[p, r, c + 1]
                if _takes(v, m):
                    m = v
                    k = r * width + c + 1
                v = x[p, r + 1, c]
                if _takes(v, m):
                    m = v
                    k = (r + 1) * width + c
                v = x[p, r + 1, c + 1]
                if _takes(v, m):
                    m = v
                    k = (r + 1) * width + c + 1
                out[p, i, j] = m
                idx[p, i, j] = k


def _with_indices(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, ch, height, width = x.shape
    planes = n * ch
    arr = x.detach().contiguous().numpy().reshape(planes, height, width)
    out = np.empty((planes, height // 2, width // 2), dtype=arr.dtype)
    idx = np.empty(out.shape, dtype=np.int64)
    parallel_ranges(_pool_with_indices, planes, arr.size, arr, out, idx)  # plane ranges over torch's threads
    shape = (n, ch, height // 2, width // 2)
    return torch.from_numpy(out).view(shape), torch.from_numpy(idx).view(shape)


class _MaxPool2x2(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out, idx = _with_indices(x)
        ctx.save_for_backward(x, idx)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # torch's own backward op, which autograd differentiates again (a second derivative, as
        # max_pool2d has: the indices are constants)
        x, idx = ctx.saved_tensors
        return torch.ops.aten.max_pool2d_with_indices_backward(grad_out, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)


def max_pool2x2(x: torch.Tensor) -> torch.Tensor:
    """``F.max_pool2d(x, 2)``: the same values and gradients (module docstring), faster on the CPU.

    Args:
        x: ``(N, C, H, W)`` tensor. float32/float64 CPU tensors of at least 2 x 2 pixels take the
            elementwise path; any other tensor, and any tensor under ``torch.compile``, is passed to
            ``torch.nn.functional.max_pool2d``.

    Returns:
        ``(N, C, H // 2, W // 2)``, differentiable twice as ``max_pool2d`` is.

    Examples:
        >>> x = torch.arange(16.0).reshape(1, 1, 4, 4)
        >>> max_pool2x2(x)[0, 0].tolist()
        [[5.0, 7.0], [13.0, 15.0]]
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a tensor, got {type(x).__name__}")
    if not max_pool2x2_applies(x) or torch.compiler.is_compiling():
        # (traced by torch.compile: max_pool2d, which the compiler compiles itself; the same results)
        return torch.nn.functional.max_pool2d(x, 2)
    if torch.is_grad_enabled() and x.requires_grad:
        if not _numba.AVAILABLE:
            return torch.nn.functional.max_pool2d(x, 2)
        return _MaxPool2x2.apply(x)
    return _pool(x)


def warm_up(dtypes=(torch.float32,)) -> float:
    """Compile (or load from numba's cache) the pass that records the argmax, for each of
    ``dtypes`` (float32, float64); return the seconds taken (0.0 without numba)."""
    for dtype in dtypes:
        if dtype not in _DTYPES:
            raise ValueError(f"dtypes: expected torch.float32 or torch.float64, got {dtype}")
    if not _numba.AVAILABLE:
        return 0.0
    t0 = time.perf_counter()
    for dtype in dtypes:
        _with_indices(torch.zeros((1, 1, 2, 2), dtype=dtype))
    return time.perf_counter() - t0
