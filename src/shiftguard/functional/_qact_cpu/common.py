"""What every stage of the compiled QACT kernels shares: unsigned indices and the split of channels
over threads (:func:`_run`)."""

from __future__ import annotations

import numpy as np
import torch

from shiftguard._parallel import parallel_parts


_S32 = np.uint64(32)
# Indices unsigned (_U) wherever the index is known to be >= 0 but the compiler cannot prove it (one
# computed from data, or offset from a loop variable that does not start at 0: range(a, b), k0 + k,
# c0 + i): numba wraps a negative signed index around to the array's end, a check on every access
# that also keeps the loop from being vectorised.
_U = np.uint64
_U1 = np.uint64(1)

# Ranges per thread, handed out as threads free up: a thread slowed by the machine's other work takes
# fewer of them. More ranges balance better and cost more scheduling (docs/performance.md).
_PARTS_PER_THREAD = 4


def _threads() -> int:
    """torch's intra-op thread count: the kernels share torch's threads and follow its setting."""
    return max(1, torch.get_num_threads())


def _run(kernel, n_channels: int, work: int, *args, tiered: bool = False) -> None:
    """``kernel(c0, c1, *args)`` over channels ``[0, n_channels)``: inline when the work is small,
    else split into contiguous channel ranges over torch's thread count, run on torch's own OpenMP
    threads (:mod:`shiftguard._parallel`; the kernels release the GIL). Not numba's parallel
    runtime: that one starts an OpenMP team of its own, whose spinning workers then compete with
    torch's for the cores.

    ``tiered``: two ranges per thread, the first half of them 3/4 of the channels, the rest 1/4
    (for a pass whose ranges cost enough each that more of them cost more than the balance they
    buy, and that needs the small ones at the end to balance: the fused pass that sorts its own
    rows)."""
    threads = min(_threads(), n_channels)
    if threads < 2 or work < (1 << 16):
        kernel(0, n_channels, *args)
        return
    if tiered and n_channels >= 4 * threads:
        # the large ranges first, the small ones last to even out the threads' finishing times
        big = 3 * n_channels // 4
        bounds = [big * i // threads for i in range(threads)]
        bounds += [big + (n_channels - big) * i // threads for i in range(threads + 1)]
    else:
        # _PARTS_PER_THREAD contiguous channel ranges per thread, each thread taking the next range
        # left when done with its last
        parts = min(n_channels, _PARTS_PER_THREAD * threads)
        bounds = [n_channels * i // parts for i in range(parts + 1)]
    parallel_parts(lambda i: kernel(bounds[i], bounds[i + 1], *args), len(bounds) - 1, threads)
