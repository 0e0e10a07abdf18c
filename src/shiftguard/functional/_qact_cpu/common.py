"""What every stage of the compiled QACT kernels shares: unsigned indices. (The split of channels
over threads is :func:`shiftguard._parallel.parallel_ranges`.)"""

from __future__ import annotations

import numpy as np

_S32 = np.uint64(32)
# Indices unsigned (_U) wherever the index is known to be >= 0 but the compiler cannot prove it (one
# computed from data, or offset from a loop variable that does not start at 0: range(a, b), k0 + k,
# c0 + i): numba wraps a negative signed index around to the array's end, a check on every access
# that also keeps the loop from being vectorised.
_U = np.uint64
_U1 = np.uint64(1)
