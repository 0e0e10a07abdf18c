"""The k smallest entries of every row of a ranking block: the selection step of the exact kNN back ends.

``torch.topk(largest=False)`` on the CPU copies each row into (value, index) pairs and partially
sorts them; on the ``(rows, Ns)`` key blocks of a kNN search with small ``k`` that costs about as
much as the ``addmm`` that produced the block (a 10,000 x 48,000 search with ``k = 10``:
``docs/performance.md``). :func:`smallest_k` instead scans each row once, keeping the ``k``
smallest entries seen so far in a sorted buffer: an entry is compared with the buffer's largest
and enters only when it is smaller, which on rows in no particular order happens
``O(k log(Ns / k))`` times per row. The scan is a compiled kernel (numba, ``nogil``) run over
row ranges on torch's own threads (:func:`shiftguard._parallel.parallel_parts`).

Order and ties: each row's result is sorted by value, equal values by column (the lower column
first), and NaN ranks above every number, ``+inf`` included. The result is therefore one
well-defined set and order, whatever the block's rows are chunked into; ``torch.topk`` leaves the
choice among equal values to its implementation. Where the kernel does not apply (``k`` above
:data:`SCAN_MAX_K`, where the buffer's insertions would dominate; a non-CPU tensor; a dtype other
than float32 / float64; numba missing) :func:`smallest_k` is ``torch.topk`` followed by a stable
re-sort by value, the same set except among entries equal to the k-th.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from shiftguard import _numba
from shiftguard._numba import njit
from shiftguard._parallel import parallel_parts

__all__ = ["SCAN_MAX_K", "scan_applies", "smallest_k", "warm_up"]

#: Largest ``k`` the scan serves; above it ``torch.topk`` is used (the buffer's insertions cost
#: ``O(k)`` each, about ``k^2 log(Ns / k)`` per row).
SCAN_MAX_K = 64

#: Entries of a row tested together before any is looked at alone (one vector compare each).
_GROUP = 16

#: Rows per parallel part: parts are handed to the threads as they become free.
_ROWS_PER_PART = 16


@njit(inline="always")
def _after(a, b):  # pragma: no cover - compiled
    """Whether a value ``a`` of an earlier column ranks after a value ``b`` of a later column:
    ``a > b``, or ``a`` NaN and ``b`` not (NaN ranks last; equal values keep column order)."""
    return a > b or (a != a and b == b)


@njit(inline="always")
def _insert(vals, cols, v, j, last):  # pragma: no cover - compiled
    """Put ``v`` (column ``j``, later than every buffered column) into the sorted buffer
    ``vals[:last + 1]``, dropping what was at ``last``."""
    p = last
    while p > 0 and _after(vals[p - 1], v):
        vals[p] = vals[p - 1]
        cols[p] = cols[p - 1]
        p -= 1
    vals[p] = v
    cols[p] = j


@njit(nogil=True, cache=True)
def _select_rows(block, k, lo, hi, out_v, out_i):  # pragma: no cover - compiled
    """Rows ``lo:hi`` of ``block`` (2-D, C-contiguous): their ``k`` smallest entries, sorted, into
    ``out_v[r]`` and their columns into ``out_i[r]``. Columns enter in increasing order, so an entry
    displaces a buffered one only when it ranks strictly before it (:func:`_after`).

    The scan tests :data:`_GROUP` entries at a time with one comparison each against the buffer's
    largest, OR-ed together (a loop the compiler turns into vector compares), and looks at a group
    entry by entry only when one of them is smaller (or while the buffer holds a NaN, which every
    number displaces)."""
    n = block.shape[1]
    for r in range(lo, hi):
        row = block[r]
        vals = out_v[r]
        cols = out_i[r]
        for j in range(k):  # the first k columns, insertion-sorted
            _insert(vals, cols, row[j], j, j)
        worst = vals[k - 1]
        j = k
        while j < n:
            end = min(j + _GROUP, n)
            hit = worst != worst
            if not hit:
                for t in range(j, end):
                    hit |= row[t] < worst
            if hit:
                for t in range(j, end):
                    v = row[t]
                    if v < worst or (worst != worst and v == v):
                        _insert(vals, cols, v, t, k - 1)
                        worst = vals[k - 1]
            j = end


def scan_applies(block: torch.Tensor, k: int) -> bool:
    """Whether :func:`smallest_k` runs the compiled scan on ``block`` (else ``torch.topk``)."""
    return (
        _numba.AVAILABLE
        and block.device.type == "cpu"
        and block.dtype in (torch.float32, torch.float64)
        and k <= SCAN_MAX_K
        and not block.requires_grad
    )


def smallest_k(block: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` smallest entries of every row of ``block`` and their columns, each row sorted by
    value (equal values: lower column first; NaN last).

    Args:
        block: ``(R, N)`` floating tensor (a kNN search's key block). Trusted input: the callers
            validate their own arguments.
        k: ``1 <= k <= N`` (else ``ValueError``).

    Returns:
        ``(values (R, k) of block's dtype, columns (R, k) int64)`` on ``block``'s device.
        ``torch.topk(block, k, largest=False, sorted=True)`` returns the same values; the columns
        differ only among equal values, which are in column order here.
    """
    if block.ndim != 2 or not 1 <= k <= block.shape[1]:
        raise ValueError(
            f"k: expected 1 <= k <= {block.shape[-1]} columns of a 2-D block, got k={k} for shape {tuple(block.shape)}"
        )
    if not scan_applies(block, k):
        val, col = torch.topk(block, k, dim=1, largest=False, sorted=True)
        # topk's order among equal values is its implementation's; make it column order
        order = torch.argsort(col, dim=1)
        val, col = val.gather(1, order), col.gather(1, order)
        val, order = val.sort(dim=1, stable=True)
        return val, col.gather(1, order)
    rows = block.shape[0]
    arr = block.detach().contiguous().numpy()
    out_v = np.empty((rows, k), dtype=arr.dtype)
    out_i = np.empty((rows, k), dtype=np.int64)
    n_parts = max(1, -(-rows // _ROWS_PER_PART))

    def part(i: int) -> None:
        lo = i * _ROWS_PER_PART
        _select_rows(arr, k, lo, min(rows, lo + _ROWS_PER_PART), out_v, out_i)

    if n_parts == 1:
        part(0)
    else:
        parallel_parts(part, n_parts, torch.get_num_threads())
    return torch.from_numpy(out_v), torch.from_numpy(out_i)


def warm_up(dtypes=(torch.float32,)) -> float:
    """Compile (or load from numba's cache) the selection kernel for each of ``dtypes`` (float32,
    float64); return the seconds taken (0.0 without numba)."""
    for dtype in dtypes:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtypes: expected torch.float32 or torch.float64, got {dtype}")
    if not _numba.AVAILABLE:
        return 0.0
    t0 = time.perf_counter()
    for dtype in dtypes:
        smallest_k(torch.zeros((1, 2), dtype=dtype), 1)
    return time.perf_counter() - t0
