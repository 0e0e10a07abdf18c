"""Shared pieces of the compiled (numba) CPU kernels: whether numba is importable, and the
counter-based random generator both kernel modules draw from
(:mod:`shiftguard.functional._qact_cpu`, :mod:`shiftguard.corruptions._kernels`).

SplitMix64 (Steele, Lea & Flood 2014): the finaliser of a 64-bit counter is a well-mixed 64-bit
random word, so draw ``i`` of a stream seeded with ``s`` is ``splitmix64(s + i)``: any draw can be
computed independently of the others, and results do not depend on how the work is split.

Where the compiled kernels are cached (``cache=True``): numba (read in its 0.68 source,
``numba.core.caching``) tries, per function, the first location it can write to: ``NUMBA_CACHE_DIR``
when the user sets it, then ``__pycache__`` next to the source, then a per-user directory
(``$XDG_CACHE_HOME/numba``, else ``~/.cache/numba``; the source folder's path is hashed into the
name). An installed package whose folder is read-only (site-packages owned by root, a read-only
container image) is therefore cached per user without any setting here
(``tests/test_kernel_cache.py`` checks that the second process loads the kernels instead of
compiling them). Where no location is writable, numba refuses to define a cached function at all
(``RuntimeError`` at import); :func:`njit` then defines the kernel without a disk cache and warns
once: every process compiles again, which ``NUMBA_CACHE_DIR`` set to a writable folder avoids.

Inlining: ``inline="always"`` inlines in numba's IR, copying the callee's IR at each call site (and
again at each level of nesting), which dominated the compile time of the first QACT pass. It is
kept for the small functions called per value inside the hot loops; the functions called once per
channel or row are plain ``@njit`` functions, compiled once per signature (LLVM still inlines them
where it pays). The arithmetic is the same either way (no fast-math flags cross the call).
"""

from __future__ import annotations

import warnings

import numpy as np

try:  # numba is a dependency, but every kernel has a torch equivalent that runs without it
    from numba import njit as _numba_njit

    AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where numba is missing
    AVAILABLE = False
    _numba_njit = None  # type: ignore[assignment]

# set once the warning that kernels compile without a disk cache has been given in this process
_UNCACHED_WARNED: list[bool] = []


def _cached_or_not(fn, options):
    """``numba.njit(**options)(fn)``; where ``cache=True`` finds no writable cache location (numba
    raises ``RuntimeError("cannot cache function ...")``), the same without the disk cache, with a
    ``RuntimeWarning`` the first time."""
    try:
        return _numba_njit(**options)(fn)
    except RuntimeError as exc:
        if not options.get("cache") or "cannot cache function" not in str(exc):
            raise
        if not _UNCACHED_WARNED:
            _UNCACHED_WARNED.append(True)
            warnings.warn(
                "shiftguard: no writable folder for numba's kernel cache (the package folder, "
                "NUMBA_CACHE_DIR and the user cache directory all refuse writes); the compiled "
                "kernels are not cached and every process compiles them again. Set NUMBA_CACHE_DIR "
                f"to a writable folder to cache them. ({exc})",
                RuntimeWarning,
                stacklevel=3,
            )
        return _numba_njit(**{**options, "cache": False})(fn)


def njit(*args, **options):
    """``numba.njit`` (bare, ``@njit``, or with keyword options, ``@njit(cache=True, ...)``) that still
    defines a ``cache=True`` kernel where no cache location is writable (see the module docstring).

    Without numba the kernels stay plain Python functions: defined, never called (callers check
    :data:`AVAILABLE` and take the torch code).

    Raises:
        TypeError: positional arguments other than the one function (explicit signatures are not
            used by the kernels).
    """
    if args and not (len(args) == 1 and callable(args[0]) and not options):
        raise TypeError("njit: expected @njit or @njit(**options), got positional arguments")
    if not AVAILABLE:  # pragma: no cover - exercised only where numba is missing
        return args[0] if args else (lambda fn: fn)
    if args:
        return _numba_njit(args[0])
    return lambda fn: _cached_or_not(fn, options)


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
