"""Shared pieces of the compiled (numba) CPU kernels: whether numba is importable, and the
counter-based random generator both kernel modules draw from
(:mod:`shiftguard.functional._qact_cpu`, :mod:`shiftguard.corruptions._kernels`).

SplitMix64 (Steele, Lea & Flood 2014): the finaliser of a 64-bit counter is a well-mixed 64-bit
random word, so draw ``i`` of a stream seeded with ``s`` is ``splitmix64(s + i)``: any draw can be
computed independently of the others, and results do not depend on how the work is split.
"""

from __future__ import annotations

import numpy as np

try:  # numba is a dependency, but every kernel has a torch equivalent that runs without it
    from numba import njit

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    AVAILABLE = False

    def njit(*args, **kwargs):
        """Without numba the kernels stay plain Python functions: defined, never called (callers check
        :data:`AVAILABLE` and take the torch code)."""
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return lambda fn: fn


__all__ = ["AVAILABLE", "njit", "splitmix64"]

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_S27 = np.uint64(27)
_S30 = np.uint64(30)
_S31 = np.uint64(31)


@njit(inline="always")
def splitmix64(key):
    """SplitMix64 finaliser: 64 well-mixed random bits from the counter ``key`` (uint64)."""
    z = key * _M1
    z = (z ^ (z >> _S30)) * _M2
    z = (z ^ (z >> _S27)) * _M3
    return z ^ (z >> _S31)
