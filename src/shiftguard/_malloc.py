"""Keep large freed blocks of memory for reuse instead of returning them to the kernel (glibc).

Why (the constraint): glibc's ``malloc`` serves a block above its mmap threshold with fresh pages
from the kernel and gives them back when the block is freed; the threshold rises by itself as such
blocks are freed (to at most 32 MiB), but free heap memory above the trim threshold (twice the
mmap threshold) is handed back on every ``free``. An evaluation batch of 1,000 MNIST images makes
an 18.8 MB output in LeNet's first convolution; when such blocks go back to the kernel, the next
batch faults in (zero-fills) every 4 KiB page again, which can cost more than the convolution
itself (the measurements: ``docs/performance.md``, "Memory allocator").

:func:`reuse_large_blocks` sets both thresholds once for the process (``mallopt``): blocks up to
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free heap stays
mapped. The price is resident memory that can stay up to that much above what is in use. The
command line calls it at start-up; the library never changes the allocator of a process it is
imported into. It does nothing where the C library is not glibc (``mallopt`` missing) and where the
user tuned glibc's allocator through the environment (``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``glibc.malloc`` tunables in
``GLIBC_TUNABLES``): their choice stands.
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "reuse_large_blocks"]

#: Blocks up to this size come from the heap (glibc ``M_MMAP_THRESHOLD``).
MMAP_THRESHOLD = 64 * 2**20
#: Free heap memory up to this size stays mapped for reuse (glibc ``M_TRIM_THRESHOLD``).
TRIM_THRESHOLD = 256 * 2**20

# glibc's <malloc.h> parameter numbers
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def _user_tuned(environ) -> bool:
    return any(k in environ for k in _USER_SETTINGS) or "glibc.malloc" in environ.get("GLIBC_TUNABLES", "")


def _libc():
    """The C library this process runs with (its symbols are the process's own)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def reuse_large_blocks(environ=None) -> bool:
    """Set glibc's mmap and trim thresholds for this process (module docstring); returns whether
    they were set. ``environ`` (default ``os.environ``) is where the user's own settings are looked
    for."""
    environ = os.environ if environ is None else environ
    if _user_tuned(environ):
        return False
    libc = _libc()
    mallopt = getattr(libc, "mallopt", None) if libc is not None else None
    if mallopt is None:
        return False
    # int mallopt(int param, int value) returns 1 on success; the trim threshold is set only if the
    # mmap one was accepted
    return bool(mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(MMAP_THRESHOLD))) and bool(
        mallopt(ctypes.c_int(_M_TRIM_THRESHOLD), ctypes.c_int(TRIM_THRESHOLD))
    )
