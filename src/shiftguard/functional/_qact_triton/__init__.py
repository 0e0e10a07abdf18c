"""Triton kernels of QACT for CUDA tensors: the same mathematics as :mod:`shiftguard.functional.quantile`
and :mod:`shiftguard.functional.kde`, the GPU counterpart of the numba kernels in
:mod:`shiftguard.functional._qact_cpu`.

Nothing here imports triton at ``import shiftguard``: :func:`available` only asks whether the
package is installed (the optional extra ``shiftguard[gpu]``), and :func:`kernels` imports the stage
modules, and with them triton, on the first CUDA input that takes this path
(``quantile._triton``). Stages, one module each:

- ``context``: the grounded context rows (each channel's values, then ``-c`` and ``+c``) made from
  the input in its ``(N, C, *)`` layout in one launch, bit for bit ``quantile._grounded``'s.
- ``quantiles``: the weighted quantiles of each sorted grounded context row [QACT, Alg. 1, eqs.
  (8)-(9)] -- the closed-form bracket of ``quantile._grounded_quantiles`` with the same operations
  in the same order, one program per channel, then the running maximum; the levels, the row's
  count of entries below 0 (for the draws) and its values' range (for the KDE grid) are computed
  there too.
- ``draws``: the KDE samples of each row by systematic sampling [QACT, Alg. 2] -- for each draw a
  binary search for its entry with the comb counts of ``quantile._comb_counts`` computed on the fly
  (same operations), the comb offsets given or computed from a seed (SplitMix64, as
  ``quantile._comb_offsets``): the eager code's samples bit for bit, in one launch; and, where one
  program holds a channel's whole sample (up to 4096), their Silverman bandwidth (equal to the eager
  code's to rounding: its sums in another order).
- ``kde``: the KDE grid of the backward [QACT, Alg. 2, eq. (7)] on the nodes of
  :func:`shiftguard.functional.kde.grid_layout` (computed in the kernel, bit for bit): each node's
  value is the Gaussian kernel sum over the channel's samples, truncated at ``TRUNCATE * h``,
  evaluated directly (no binning, no FFT, no atomics: deterministic). At the nodes this is the exact
  truncated KDE, so the density interpolated from it is within ``phi(0) delta^2 / (8 h^3) +
  phi(truncate) / h`` of the exact KDE, inside :func:`shiftguard.functional.kde.kde_grid_error_bound`
  (the eager grid also bins).
- ``output``: one pass over the input in its own ``(N, C, *)`` layout: each value's forward output
  ``#{i : q_i <= x} / n_tau`` (eq. (6); a branchless binary search in the channel's quantiles, the
  count of ``torch.searchsorted(q, x, right=True)``, and ``k / n_tau`` rounded as the eager code's table)
  and, where the gradient will be needed, its density linearly interpolated from the grid as
  :func:`~shiftguard.functional.kde.gaussian_kde_grid` does; each program also flags whether its
  values are finite, the input's NaN/inf check.

The sort of the context stays a torch operation on the device; no step reads a value back to the
host but the NaN/inf verdict (``quantile._refuse_non_finite``; a device-side assertion while a CUDA graph
is captured). ``common`` holds the division and square root rounded to nearest that the stages use where
they match the eager code's bits (Triton's float32 ``/`` is approximate on NVIDIA GPUs). The tests
run every kernel in Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors against the eager
code (``tests/test_qact_triton.py``).
"""

from __future__ import annotations

import functools
import importlib.util
from types import SimpleNamespace

__all__ = ["available", "kernels"]


@functools.lru_cache(maxsize=1)
def available() -> bool:
    """Whether triton is installed (without importing it)."""
    return importlib.util.find_spec("triton") is not None


@functools.lru_cache(maxsize=1)
def kernels() -> SimpleNamespace:
    """The stages' entry points (imports triton)."""
    from shiftguard.functional._qact_triton.context import grounded_context
    from shiftguard.functional._qact_triton.draws import systematic_draws
    from shiftguard.functional._qact_triton.kde import kde_grid
    from shiftguard.functional._qact_triton.output import levels_and_density
    from shiftguard.functional._qact_triton.quantiles import grounded_quantiles

    return SimpleNamespace(
        grounded_context=grounded_context,
        grounded_quantiles=grounded_quantiles,
        systematic_draws=systematic_draws,
        kde_grid=kde_grid,
        levels_and_density=levels_and_density,
    )
