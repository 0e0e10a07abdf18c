"""Compiled CPU kernels of QACT (numba): the same mathematics as :mod:`shiftguard.functional.quantile`
and :mod:`shiftguard.functional.kde`, fused into a few passes over the data.

Why: in eager PyTorch the batch-context QACT is ~40 small tensor operations, an argsort of the
``(C, M)`` context and a scatter through its permutation; here the context is sorted by numpy's
vectorised sort (values only, no permutation) and each value is then read once, for its output and
(when a gradient will be needed) its KDE density. Channels run in parallel as contiguous channel
ranges on torch's thread count, on torch's own OpenMP threads
(:func:`shiftguard._parallel.parallel_ranges`; the kernels release the GIL).

What is computed, per channel ``c`` [QACT, Alg. 1-2; module doc of ``quantile.py``]:

- :func:`sorted_grounded_context`: the channel's values and ``-c, +c``, sorted;
  :func:`sorted_context_finite` reads the values' finiteness off its ends (and the fused pass each
  channel's range, ``_row_range``).
- :func:`grounded_quantiles`: ``n_-`` (values < 0 in the sorted grounded context) and the weighted
  quantiles ``q_1..q_{n_tau}`` by the closed-form midpoint positions of the grounding weights
  (eqs. (8)-(9)) with linear interpolation, made non-decreasing (running max) -- the arithmetic of
  ``_grounded_quantiles`` done in float64 and rounded once to the tensor dtype. The bracket of each
  level (the two entries and the weight) depends only on the row length and ``n_-``: for rows of
  up to ``_BRACKETS_MAX_ROW`` entries it is looked up in a table built once (``_brackets``).
- :func:`counts_output`: every value's forward output ``#{i : q_i <= x} / n_tau`` (eq. (6)): a
  table over ``[q_1, q_n]`` holds, per cell, the number of quantiles in earlier cells; the cell
  index is monotone in ``x``, so only the quantiles in ``x``'s own cell are compared and the count
  equals ``torch.searchsorted(q, x, right=True)`` whatever the rounding. The same pass checks for
  NaN/inf and records the range.
- :func:`grounded_samples`: the ``S`` KDE points of Alg. 2, drawn with the grounding weights by
  systematic sampling (``quantile.py``, "Sampling"): draw ``s`` takes the sorted entry whose
  cumulative grounding weight first exceeds ``(s + U) / S``, one offset ``U`` per channel. Entry
  ``k`` is drawn ``c_k - c_{k-1}`` times, ``c_k = ceil(S P_k - U)`` in float64 (the eager code's
  arithmetic: the same sample for the same ``U``); short contexts tally every entry and read the
  tally out in order, long ones find each draw's entry from its CDF position. ``U`` is 32 bits of
  SplitMix64 of ``seed + channel``, so the result is deterministic given ``seed`` (drawn from the caller's
  ``torch.Generator``) and independent of the thread count. Silverman's bandwidth of the sorted
  sample (``kde.py``) is computed on the way.
- :func:`kde_grid`, :func:`kde_density_times`: the grid KDE of ``kde.py`` (linear binning, Gaussian
  kernel truncated at ``4 h``, 8 nodes per bandwidth: same nodes, weights and error bound; a
  direct convolution per channel instead of one FFT over all, in the samples' precision like the
  eager grid) and, for statistics that did not come
  with the density (frozen context, DDP), ``grad_output * f_grid(x)`` in one pass, or
  (:func:`kde_density`) the density alone, which the forward of a traced layer hands its backward.
- :func:`batch_channels`: all of the above for a batch context whose gradient will be needed, one
  channel at a time (quantiles, draws and bandwidth, grid, then every value's output and density,
  Alg. 2 eq. (7), for the backward), with the channel's scratch in cache and no Python between
  the steps; a fixed ``bandwidth`` replaces Silverman's (the separate passes leave the fixed
  bandwidth to ``quantile.py``, which applies it to the statistics they return). The drawn entries
  are binned once each with their number of draws as weight; the count table covers the quantiles
  inside the channel's value range only. For an ``(N, C)`` input (checked finite first,
  :func:`all_finite`) each thread sorts its channels' context rows right before their pass
  (``ctx=None``: one parallel region).

Stages, one module each: ``sort`` (the sorted grounded context), ``quantiles``, ``output`` (the
forward's counts and the grid's interpolation), ``kde`` (draws, bandwidth, grid), ``fused`` (the
training pass over all of them), and ``common`` (the unsigned index constants). Without numba the
modules still import (the kernels stay plain Python functions) and ``AVAILABLE`` is False.

The tests check each kernel against the eager implementation it replaces and against the slow
references (``tests/test_qact_cpu.py``).
"""

from __future__ import annotations

from shiftguard._numba import AVAILABLE
from shiftguard.functional._qact_cpu.fused import batch_channels, lerp_rows_
from shiftguard.functional._qact_cpu.kde import grounded_samples, kde_density, kde_density_times, kde_grid
from shiftguard.functional._qact_cpu.output import counts_output
from shiftguard.functional._qact_cpu.quantiles import grounded_quantiles
from shiftguard.functional._qact_cpu.sort import all_finite, sorted_context_finite, sorted_grounded_context

# The stages' entry points (the callers in ``quantile.py``). The compiled kernels behind them stay in
# their stage modules (``from shiftguard.functional._qact_cpu import sort``; ``sort._row_range``).
__all__ = [
    "AVAILABLE",
    "lerp_rows_",
    "sorted_grounded_context",
    "all_finite",
    "sorted_context_finite",
    "grounded_quantiles",
    "counts_output",
    "grounded_samples",
    "kde_grid",
    "kde_density",
    "kde_density_times",
    "batch_channels",
]
