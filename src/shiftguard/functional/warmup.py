"""Compile QACT's CPU kernels ahead of use.

The compiled kernels (:mod:`shiftguard.functional._qact_cpu`) are numba functions compiled on their
first call in a process, per argument types, and cached on disk (``cache=True``; in which folder, and
what happens where none is writable: :mod:`shiftguard._numba`): the first use on a machine compiles
(about 8 s for the first training step of a layer, 14 s for every path below, on 2 cores:
``benchmarks/bench_coldstart.py``), later processes load the cache (a fraction of a second). Without
a warm-up that cost lands inside whatever runs QACT first, e.g. the first training epoch, and makes
its timing meaningless. :func:`warm_up` runs each path a QACT layer takes once on a
tiny input, so callers can time and announce it as a step of its own.
"""

from __future__ import annotations

import time

import torch

from . import quantile as Q
from ._qact_cpu.quantiles import _BRACKETS_MAX_ROW

__all__ = ["warm_up"]


def warm_up(dtype: torch.dtype = torch.float32, evaluation_only: bool = False) -> float:
    """Compile (or load from numba's cache) every QACT CPU kernel for ``dtype``; return the seconds taken.

    Runs, on inputs ``(N, C)`` and ``(N, C, H, W)`` with short and with long context rows (the
    kernels take precomputed bracket tables for rows of up to ``_qact_cpu.quantiles._BRACKETS_MAX_ROW`` values
    and compute them otherwise: two compiled variants), what :class:`shiftguard.nn.QuantileActivation`
    runs: the batch context in training (forward with running-statistics update, backward), the
    batch context without a gradient (evaluation), the frozen context with and without a gradient,
    and the running-statistics update of the unfused path; with ``evaluation_only``, only what an
    evaluation runs (the batch and the frozen context without a gradient). Results are discarded;
    the global RNG is not used (the draws come from a local generator). Returns 0.0 at once where
    the compiled path is off (numba missing, or ``shiftguard.functional.quantile.USE_COMPILED =
    False``): there is nothing to compile.

    Raises:
        ValueError: ``dtype`` is not ``torch.float32`` or ``torch.float64`` (the kernels' dtypes).
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype: expected torch.float32 or torch.float64, got {dtype}")
    probe = torch.zeros(1, dtype=dtype)
    if not Q._compiled(probe):
        return 0.0
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    n_tau, n_samples, c = 100, 1000, 100.0
    long_row = _BRACKETS_MAX_ROW + 1
    for shape in ((4, 3), (4, 3, 2, 2), (long_row, 2), (1, 2, 1, long_row)):
        x = torch.linspace(-2.0, 2.0, int(torch.Size(shape).numel()), dtype=dtype).reshape(shape)
        ch = shape[1]
        if evaluation_only:
            with torch.no_grad():
                Q.quantile_activation(x, n_tau=n_tau, c=c, n_samples=n_samples, generator=gen)
                Q.quantile_activation(x, *Q.default_statistics(ch, n_tau, n_samples, dtype), context="frozen")
            continue
        x = x.requires_grad_(True)
        # a layer's training step (the pass that moves the running statistics), then its backward
        rs = Q.default_statistics(ch, n_tau, n_samples, dtype)
        Q.quantile_activation(
            x, *rs, training=True, n_tau=n_tau, c=c, n_samples=n_samples, generator=gen
        ).sum().backward()
        with torch.no_grad():  # a training step without a gradient: the separate running update
            Q.quantile_activation(x, *rs, training=True, n_tau=n_tau, c=c, n_samples=n_samples, generator=gen)
        # no running statistics
        Q.quantile_activation(x, n_tau=n_tau, c=c, n_samples=n_samples, generator=gen).sum().backward()
        with torch.no_grad():  # evaluation in batch context: statistics without samples
            Q.quantile_activation(x, n_tau=n_tau, c=c, n_samples=n_samples, generator=gen)
        frozen = Q.default_statistics(ch, n_tau, n_samples, dtype)
        Q.quantile_activation(x, *frozen, context="frozen").sum().backward()  # frozen context, training through it
        with torch.no_grad():
            Q.quantile_activation(x, *frozen, context="frozen")
    return time.perf_counter() - t0
