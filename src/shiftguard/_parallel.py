"""Run GIL-releasing work in parallel on torch's own OpenMP threads (Python threads as fallback).

Why (the constraint): torch's CPU operators run on an OpenMP team, and after each parallel region
the team's worker threads keep spinning for a while (GNU libgomp: ``GOMP_SPINCOUNT`` pause
instructions, a few ms) waiting for the next one. Work handed to *other* threads in that window --
a Python thread pool running compiled kernels that release the GIL -- competes with the spinning
workers for the cores, and on a machine with as many cores as torch threads it runs no faster than
on one thread. Started on torch's team instead (the runtime's ``GOMP_parallel``, called through
ctypes), the work lands on the very threads that were spinning, and no extra threads exist. torch
offers no public API that runs a Python callable on its intra-op team (``torch.set_num_threads``
sizes it, ``at::parallel_for`` is C++ only), hence the runtime's own entry point; the figures are
in ``docs/performance.md``.

:func:`parallel_parts` calls ``fn(i)`` for ``i in range(n_parts)``, in parallel when ``fn`` releases
the GIL (numba ``nogil`` kernels, numpy's sort), and re-raises the first exception any part raised.
With fewer threads than parts, each thread takes the next part not yet taken when it is done with
its last, so a thread that runs slower (the machine's other work, a cache it shares) takes fewer
parts. :func:`parallel_ranges` is the compiled kernels' form of it (QACT's stages, the 2x2 max
pool): ``kernel(lo, hi, *args)`` over contiguous index ranges, inline when the work is small.

The OpenMP route is taken when torch's ATen parallel backend is OpenMP and the GNU-ABI runtime it
loaded (``libgomp``, or LLVM/Intel's ``libomp``/``libiomp5``, which export the same entry points)
is found mapped in this process (Linux ``/proc/self/maps``: the runtime torch loaded, not another
copy a ``dlopen`` by name could find). Fallback, with the same results: a ``concurrent.futures``
thread pool runs the parts where that runtime cannot be told apart, off Linux, in a process forked
from this one (GNU OpenMP does not survive a fork: torch's own operators hang in such a child unless
it sets one thread), or with the environment variable ``SHIFTGUARD_THREADS=pool``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from typing import Callable, Optional

import torch

__all__ = ["parallel_parts", "parallel_ranges", "torch_threads", "backend"]

_OMP_NAMES = ("libgomp", "libiomp5", "libomp")

# Ranges per thread in parallel_ranges, handed out as threads free up: a thread slowed by the
# machine's other work takes fewer of them. More ranges balance better and cost more scheduling
# (docs/performance.md).
_PARTS_PER_THREAD = 4


def _mapped_openmp_runtime() -> Optional[str]:
    """Path of the OpenMP runtime torch loaded, if it can be told apart: one under torch's package
    directory, else the only one mapped. ``None`` off Linux or when ambiguous."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if line.count(" ") >= 5 and "/" in line}
    except OSError:
        return None
    omp = sorted(p for p in paths if os.path.basename(p).startswith(_OMP_NAMES) and ".so" in os.path.basename(p))
    torch_dir = os.path.dirname(os.path.realpath(torch.__file__)) + os.sep
    own = [p for p in omp if os.path.realpath(p).startswith(torch_dir)]
    if len(own) == 1:
        return own[0]
    return omp[0] if len(omp) == 1 else None


class _OpenMP:
    """``GOMP_parallel`` of torch's runtime with a Python trampoline (one per process)."""

    _CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        lib.GOMP_parallel.argtypes = [self._CALLBACK, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
        lib.omp_get_thread_num.restype = ctypes.c_int
        lib.omp_get_num_threads.restype = ctypes.c_int
        self._jobs: dict = {}
        self._keys = itertools.count(1)
        self._trampoline = self._CALLBACK(self._run_part)  # kept alive with the object

    def _run_part(self, key) -> None:
        fn, n_parts, errors, next_part = self._jobs[key]
        # every team thread takes the next part not yet taken until none is left (also right when
        # the team has fewer threads than asked for: nested region, thread limit); next() on an
        # itertools.count is atomic under the GIL
        while True:
            i = next(next_part)
            if i >= n_parts:
                return
            try:
                fn(i)
            except BaseException as e:
                errors.append((i, e))

    def run(self, fn: Callable[[int], None], n_parts: int, threads: int) -> None:
        key = next(self._keys)  # jobs are per call: several Python threads may run parts at once
        errors: list = []
        self._jobs[key] = (fn, n_parts, errors, itertools.count())
        try:
            self._lib.GOMP_parallel(self._trampoline, key, threads, 0)
        finally:
            del self._jobs[key]
        if errors:
            raise min(errors, key=lambda ie: ie[0])[1]


_LOCK = threading.Lock()
_STATE: dict = {}


def _openmp() -> Optional[_OpenMP]:
    pid = os.getpid()
    if _STATE.get("pid") == pid:
        return _STATE["omp"]
    with _LOCK:
        if _STATE.get("pid") != pid:
            omp = None
            if (
                os.environ.get("SHIFTGUARD_THREADS", "").strip().lower() != "pool"
                and "parallel backend: OpenMP" in torch.__config__.parallel_info()
            ):
                path = _mapped_openmp_runtime()
                if path is not None:
                    try:
                        lib = ctypes.CDLL(path)  # the mapped copy (dlopen matches the loaded file)
                        omp = _OpenMP(lib) if hasattr(lib, "GOMP_parallel") else None
                    except (OSError, AttributeError):
                        omp = None
            _STATE.update(pid=pid, omp=omp, pool=None)
    return _STATE["omp"]


def _after_fork_in_child() -> None:
    # the child has the parent's OpenMP state but not its threads: never start a team here
    global _LOCK
    _LOCK = threading.Lock()
    _STATE.clear()
    _STATE.update(pid=os.getpid(), omp=None, pool=None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _pool(threads: int):
    pool = _STATE.get("pool")  # (none after a fork: the parent's worker threads do not exist in the child)
    if pool is None or pool._max_workers < threads:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(threads, thread_name_prefix="shiftguard")
        _STATE["pool"] = pool
    return pool


def backend() -> str:
    """``"openmp"`` when parts run on torch's OpenMP team, ``"pool"`` for the thread-pool fallback."""
    return "openmp" if _openmp() is not None else "pool"


def parallel_parts(fn: Callable[[int], None], n_parts: int, threads: Optional[int] = None) -> None:
    """Call ``fn(i)`` for every ``i`` in ``range(n_parts)``, in parallel on ``threads`` threads
    (default: one per part; on torch's OpenMP team the caller's thread is one of them), each thread
    taking the next part not yet taken (``fn`` must release the GIL to gain from it); returns when
    all parts are done, also when one failed, and then re-raises the exception of the first part
    (in part order) that raised."""
    threads = n_parts if threads is None else min(threads, n_parts)
    if threads <= 1:
        errors = []
        for i in range(n_parts):
            try:
                fn(i)
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
        return
    omp = _openmp()
    if omp is not None:
        omp.run(fn, n_parts, threads)
        return
    pool = _pool(threads)
    futures = [pool.submit(fn, i) for i in range(n_parts)]
    errors = [f.exception() for f in futures]  # waits for every part, also after one failed
    for err in errors:
        if err is not None:
            raise err


def torch_threads() -> int:
    """torch's intra-op thread count: the compiled kernels share torch's threads and follow its setting."""
    return max(1, torch.get_num_threads())


def parallel_ranges(kernel: Callable[..., None], n_items: int, work: int, *args, tiered: bool = False) -> None:
    """``kernel(i0, i1, *args)`` over items ``[0, n_items)`` (channels, planes, rows): inline when the
    work is small (``work`` below 2**16, or fewer than two threads), else split into contiguous
    ranges over torch's thread count, run by :func:`parallel_parts` (the kernels release the GIL).
    Not numba's parallel runtime: that one starts an OpenMP team of its own, whose spinning workers
    then compete with torch's for the cores.

    ``tiered``: two ranges per thread, the first half of them 3/4 of the items, the rest 1/4 (for a
    pass whose ranges cost enough each that more of them cost more than the balance they buy, and
    that needs the small ones at the end to balance: QACT's fused pass that sorts its own rows)."""
    threads = min(torch_threads(), n_items)
    if threads < 2 or work < (1 << 16):
        kernel(0, n_items, *args)
        return
    if tiered and n_items >= 4 * threads:
        # the large ranges first, the small ones last to even out the threads' finishing times
        big = 3 * n_items // 4
        bounds = [big * i // threads for i in range(threads)]
        bounds += [big + (n_items - big) * i // threads for i in range(threads + 1)]
    else:
        # _PARTS_PER_THREAD contiguous ranges per thread, each thread taking the next range left
        # when done with its last
        parts = min(n_items, _PARTS_PER_THREAD * threads)
        bounds = [n_items * i // parts for i in range(parts + 1)]
    parallel_parts(lambda i: kernel(bounds[i], bounds[i + 1], *args), len(bounds) - 1, threads)
