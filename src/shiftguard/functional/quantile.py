"""Quantile activation (QACT) math: QACT, Sec. 2, Algorithms 1-2, eqs. (4)-(9).

For one neuron (channel) with context values ``z_1..z_M`` [QACT, Sec. 3 "Extending to standard
layers": every value of ``x[:, c, ...]``, i.e. all of the batch and all spatial positions]:

1. *Grounding* [QACT, eqs. (8)-(9) and Alg. 1]: append ``-c`` and ``+c`` (``c = 100``), then give the
   negative values total weight 1/2 (``w_- = 1/n_-`` each, normalised) and the non-negative values
   total weight 1/2 (``w_+ = 1/n_+``). Exact zeros count as non-negative, following eq. (8)
   (``z+ = z if z >= 0``). The appended ``+-c`` guarantee that both sides are non-empty.
2. *Quantiles* (Alg. 1): weighted quantiles ``q_i`` at levels ``tau_i = i / (n_tau + 1)``,
   ``i = 1..n_tau`` (evenly spaced in (0, 1)), by linear interpolation of the weighted empirical
   CDF with the *midpoint* convention: the ``k``-th smallest value ``v_(k)`` (weight ``w_k``, weights
   normalised to sum 1) sits at level ``p_k = sum_{j<=k} w_j - w_k / 2``; ``q(tau)`` interpolates
   linearly between consecutive ``(p_k, v_(k))`` and is clamped to ``v_(1)`` / ``v_(K)`` outside
   ``[p_1, p_K]``. With equal weights this is Hazen's rule (``numpy.quantile(method="hazen")``).
3. *Forward* (Alg. 1, eq. (6)): ``QACT(x) = (1/n_tau) * sum_i 1[x >= q_i]`` in ``[0, 1]``.
4. *Backward* (Alg. 2, eqs. (5), (7)): ``grad_input = grad_output * f_hat(x)`` with ``f_hat`` the
   Gaussian KDE of ``S`` points drawn from the grounded context with the grounding weights
   (:mod:`shiftguard.functional.kde`). As in Alg. 2, the quantiles and samples are treated as
   constants (no gradient flows through the context statistics). The KDE bandwidth is Silverman's
   rule per channel by default; ``bandwidth=h`` fixes it to ``h`` for every channel (the authors'
   public code uses 0.5 on the BatchNorm-normalised scale, ``docs/qact.md``). Only the backward
   depends on it.

*Sampling* (Alg. 2 "obtain a weighted sample ... S"): systematic sampling, one uniform offset
``U`` per channel. With ``P_k`` the cumulative grounding weight through the ``k``-th smallest
grounded value, draw ``s = 0..S-1`` takes the first entry with ``P_k > (s + U) / S``. Each draw on
its own follows the weighted law exactly (``(s + U) / S`` is uniform on its stratum, a random one of
the ``S`` strata is uniform on [0, 1)), so the KDE has the expectation it has with i.i.d. draws;
but the sample is stratified: entry ``k`` is drawn ``floor`` or ``ceil`` of ``S w_k`` times (an
i.i.d. sample's counts are binomial), so the density estimate carries less sampling noise, and
the draws come out sorted. Entry ``k`` is drawn ``c_k - c_{k-1}`` times with
``c_k = ceil(S P_k - U)`` (:func:`_comb_counts`).

The computation is split in two so that the context can come from anywhere (the current batch, a
frozen running estimate, a reference set, or values gathered from every DDP process):

- (a) :func:`qact_statistics` ``(C, M) context values -> QACTStatistics(quantiles (C, n_tau),
  samples (C, S), bandwidth (C,))``;
- (b) :func:`qact_apply` ``(x (N, C, *), stats) -> (N, C, *)``: forward = count of quantiles
  ``<= x`` / n_tau, backward = ``grad * KDE(x)``.

:func:`quantile_activation` is QACT with the contract of ``torch.nn.functional.batch_norm``: the
input and the running statistics in, the running statistics moved in place in training; in batch
context its output equals ``qact_apply(x, qact_statistics(channel_values(x)))``, computed in one
pass where it can. One private dispatch (:func:`_forward`) chooses between the compiled kernels
and the eager code below and returns a typed result (:class:`_Forward`); one autograd Function
(:class:`_QACTFunction`) carries the backward. Everything is vectorised over channels (one ``torch.sort`` of the
``(C, M + 2)`` context, ``searchsorted`` for the levels and for the forward count), works on any
device and floating dtype, and is deterministic given the ``generator`` (or seed tensor,
:func:`_draws_of_seed`) used for the KDE samples.

On CPU float32/float64 the same computation runs through compiled kernels
(:mod:`shiftguard.functional._qact_cpu`, numba): the values of the forward are identical (float64:
bit for bit; float32: the quantiles are rounded once from float64 instead of computed in float32),
the KDE samples are drawn by the same arithmetic with the offsets from a counter-based generator
seeded from ``generator``, and the backward uses the same grid KDE with the same error bound. The
eager code below is what runs elsewhere (CUDA, half precision) and is the reference the kernels are
tested against; ``USE_COMPILED = False`` forces it.
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from shiftguard import _rng
from shiftguard._validation import check_finite, check_positive, check_tensor
from shiftguard.functional import _qact_cpu, _qact_triton
from shiftguard.functional.kde import POINTS_PER_BANDWIDTH, TRUNCATE, gaussian_kde_grid, silverman_bandwidth

#: The grid nodes of a channel's KDE at most (``max_points`` of :func:`~shiftguard.functional.kde.grid_layout`).
_MAX_GRID_NODES = 4096

#: Where the KDE draws of one call come from: a ``torch.Generator`` (None: torch's default generator
#: of the values' device), or a one-element integer seed tensor (:func:`_comb_offsets`,
#: :func:`_draws_of_seed`).
Draws = Union[torch.Generator, torch.Tensor, None]

__all__ = [
    "QACTStatistics",
    "quantile_levels",
    "channel_values",
    "grounding_weights",
    "weighted_quantiles",
    "qact_statistics",
    "qact_apply",
    "quantile_activation",
    "default_statistics",
    "check_bandwidth",
]


class QACTStatistics(NamedTuple):
    """Per-channel context statistics of QACT (output of :func:`qact_statistics`).

    Attributes:
        quantiles: ``(C, n_tau)`` non-decreasing weighted quantiles ``q_1..q_{n_tau}`` (Alg. 1).
        samples: ``(C, S)`` sorted points drawn from the grounded context (Alg. 2).
        bandwidth: ``(C,)`` KDE bandwidth (Silverman's rule on ``samples``, or the fixed
            ``bandwidth`` the statistics were computed with).
    """

    quantiles: torch.Tensor
    samples: torch.Tensor
    bandwidth: torch.Tensor


def quantile_levels(n_tau: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """``tau_i = i / (n_tau + 1)`` for ``i = 1..n_tau``: evenly spaced in the open interval (0, 1)."""
    return torch.arange(1, n_tau + 1, dtype=torch.float64, device=device).div_(n_tau + 1).to(dtype)


def channel_values(x: torch.Tensor) -> torch.Tensor:
    """The context matrix ``(C, M)`` of ``x`` ``(N, C, *spatial)``: row ``c`` holds every value of
    ``x[:, c, ...]`` (``M = N * prod(spatial)``; QACT, Sec. 3 "Extending to standard layers")."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)


def _from_channel_values(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`channel_values` for a tensor shaped like ``like``."""
    n, c = like.shape[0], like.shape[1]
    return v.reshape(c, n, *like.shape[2:]).transpose(0, 1).contiguous()


def grounding_weights(values: torch.Tensor) -> torch.Tensor:
    """Grounding weights of QACT eq. (9) / Alg. 1 for each row of ``values`` ``(C, K)``.

    Negative values share weight 1/2 equally (``0.5 / n_-`` each), non-negative values (zeros
    included, eq. (8)) share the other 1/2 (``0.5 / n_+``). A side with no values gets no weight
    and the other side then carries all of it (cannot happen once ``+-c`` are appended).
    """
    neg = values < 0
    n_neg = neg.sum(dim=1, keepdim=True).to(values.dtype)
    n_pos = values.shape[1] - n_neg
    w_neg = torch.where(n_pos > 0, 0.5, 1.0) / n_neg.clamp_min(1)
    w_pos = torch.where(n_neg > 0, 0.5, 1.0) / n_pos.clamp_min(1)
    return torch.where(neg, w_neg, w_pos)


def _interpolate(sorted_values: torch.Tensor, positions: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear quantile function through ``(positions_k, sorted_values_k)`` at ``levels``.

    sorted_values, positions: ``(C, K)`` (positions strictly increasing); levels: ``(C, L)``.
    Clamped to the first/last value outside ``[positions_1, positions_K]``.
    """
    k_dim = sorted_values.shape[1]
    if k_dim == 1:
        return sorted_values.expand(-1, levels.shape[1]).clone()
    k = torch.searchsorted(positions, levels, right=True) - 1  # p_k <= tau < p_{k+1}
    below = k < 0
    above = k >= k_dim - 1
    k = k.clamp(0, k_dim - 2)
    p0 = torch.gather(positions, 1, k)
    p1 = torch.gather(positions, 1, k + 1)
    v0 = torch.gather(sorted_values, 1, k)
    v1 = torch.gather(sorted_values, 1, k + 1)
    gap = p1 - p0
    t = torch.where(gap > 0, (levels - p0) / torch.where(gap > 0, gap, torch.ones_like(gap)), torch.zeros_like(gap))
    q = v0 + t * (v1 - v0)
    q = torch.where(below, sorted_values[:, :1].expand_as(q), q)
    q = torch.where(above, sorted_values[:, -1:].expand_as(q), q)
    # Rounding in the interpolation must not break monotonicity (searchsorted needs sorted rows).
    return torch.cummax(q, dim=1).values


def weighted_quantiles(values: torch.Tensor, weights: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Weighted quantiles of each row with linear interpolation (midpoint convention, module doc).

    Args:
        values: ``(C, K)`` finite values, ``K >= 1``. weights: ``(C, K)`` strictly positive.
        levels: ``(L,)`` levels in [0, 1].

    Returns:
        ``(C, L)`` quantiles, non-decreasing along each row.
    """
    values = check_tensor(values, "values", ndim=2, floating=True, finite=True, nonempty=True)
    weights = check_tensor(weights, "weights", ndim=2, floating=True, finite=True)
    levels = check_tensor(levels, "levels", ndim=1, floating=True, finite=True)
    if weights.shape != values.shape:
        raise ValueError(f"weights: expected shape {tuple(values.shape)}, got {tuple(weights.shape)}")
    if levels.numel() and (float(levels.min()) < 0 or float(levels.max()) > 1):
        raise ValueError("levels: expected values in [0, 1]")
    v, order = torch.sort(values, dim=1)
    w = torch.gather(weights, 1, order)
    w = w / w.sum(dim=1, keepdim=True)
    if not bool((w > 0).all()):
        raise ValueError("weights: expected strictly positive weights (drop zero-weight values instead)")
    p = torch.cumsum(w, dim=1) - 0.5 * w
    lv = levels.to(v.dtype).expand(v.shape[0], -1).contiguous()
    return _interpolate(v, p, lv)


def _grounded_position(k: torch.Tensor, n_neg: torch.Tensor, k_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Midpoint CDF position ``p_k`` of sorted index ``k`` in the grounded context (closed form).

    ``k < n_-`` (negatives): ``p_k = (k + 1/2) / (2 n_-)``; otherwise ``p_k = 1/2 + (k - n_- + 1/2) /
    (2 n_+)`` -- the cumulative grounding weights minus half a weight.
    """
    kf = k.to(dtype)
    nn_ = n_neg.to(dtype)
    np_ = k_dim - nn_
    return torch.where(k < n_neg, (kf + 0.5) / (2 * nn_), 0.5 + (kf - nn_ + 0.5) / (2 * np_))


def _grounded_quantiles(ctx: torch.Tensor, n_neg: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Weighted quantiles of the sorted grounded context ``ctx`` ``(C, K)`` at ``levels`` ``(C, L)``.

    Same result as :func:`_interpolate` on the ``(C, K)`` array of positions, but the bracketing
    index ``k`` (largest with ``p_k <= tau``) is found in closed form on ``(C, L)`` only (then
    corrected by one step against the exact positions, so rounding in the inversion cannot matter).
    """
    k_dim = ctx.shape[1]
    dtype = ctx.dtype
    nn_ = n_neg[:, None]
    np_ = k_dim - nn_
    tau = levels
    k_neg = torch.floor(2.0 * tau * nn_.to(dtype) - 0.5)
    k_pos = nn_.to(dtype) + torch.floor((tau - 0.5) * 2.0 * np_.to(dtype) - 0.5)
    k = torch.where(tau < 0.5, k_neg, k_pos).long().clamp_(-1, k_dim - 1)
    for _ in range(2):  # fix off-by-one from rounding: enforce p_k <= tau < p_{k+1}
        up = (k + 1 <= k_dim - 1) & (_grounded_position((k + 1).clamp(max=k_dim - 1), nn_, k_dim, dtype) <= tau)
        down = (k >= 0) & (_grounded_position(k.clamp(min=0), nn_, k_dim, dtype) > tau)
        k = k + up.long() - down.long()
    below = k < 0
    above = k >= k_dim - 1
    k = k.clamp(0, k_dim - 2)
    p0 = _grounded_position(k, nn_, k_dim, dtype)
    p1 = _grounded_position(k + 1, nn_, k_dim, dtype)
    v0 = torch.gather(ctx, 1, k)
    v1 = torch.gather(ctx, 1, k + 1)
    t = (tau - p0) / (p1 - p0)
    q = v0 + t * (v1 - v0)
    q = torch.where(below, ctx[:, :1].expand_as(q), q)
    q = torch.where(above, ctx[:, -1:].expand_as(q), q)
    return torch.cummax(q, dim=1).values


def _comb_counts(n_neg: torch.Tensor, k_dim: int, n_samples: int, u: torch.Tensor) -> torch.Tensor:
    """``(C, K)`` int64 ``c_k``: the number of the ``S`` systematic draws (module doc, "Sampling") on
    sorted grounded entries ``0..k``, ``ceil(S P_k - U)`` with ``P_k`` the cumulative grounding
    weight through entry ``k``, in float64 in the order of the compiled kernels
    (``_qact_cpu._comb_count``) so that both give the same sample for the same offsets ``u``
    ``(C, 1)``; ``c_{K-1} = S``."""
    k = torch.arange(k_dim, device=n_neg.device, dtype=torch.float64)[None, :]
    nn_ = n_neg.to(torch.float64)[:, None]
    s_f = float(n_samples)
    neg = (s_f * (k + 1)) / (2.0 * nn_)
    pos = 0.5 * s_f + (s_f * (k + 1 - nn_)) / (2.0 * (k_dim - nn_))
    counts = torch.ceil(torch.where(k < nn_, neg, pos) - u).long()
    counts[:, -1] = n_samples
    return counts


def qact_statistics(
    values: torch.Tensor,
    n_tau: int = 100,
    c: float = 100.0,
    n_samples: int = 1000,
    generator: Optional[torch.Generator] = None,
    *,
    bandwidth: Optional[float] = None,
) -> QACTStatistics:
    """(a) Context statistics of QACT from a ``(C, M)`` matrix of context values [QACT, Alg. 1-2].

    Appends ``-c, +c`` to every row, grounds (eqs. (8)-(9)), returns the weighted quantiles at
    :func:`quantile_levels` ``(n_tau)``, ``n_samples`` points drawn with the grounding weights
    (sorted) and their Silverman bandwidth (or the fixed ``bandwidth``).

    Args:
        values: ``(C, M)`` finite context values, ``M >= 1`` (from :func:`channel_values`, or
            gathered from several processes).
        n_tau: number of quantile levels. c: grounding bound (> 0). n_samples: KDE sample size S
            (0 skips the sample: forward-only use, ``samples`` is then ``(C, 0)``).
        generator: ``torch.Generator`` on ``values.device`` for the KDE samples (global RNG if None).
        bandwidth: None (default) for Silverman's rule per channel on the samples, or a positive
            float, the bandwidth of every channel (:func:`quantile_activation`).

    Returns:
        :class:`QACTStatistics` with ``quantiles (C, n_tau)``, ``samples (C, S)``, ``bandwidth (C,)``.
    """
    values = check_tensor(values, "values", ndim=2, floating=True, finite=True, nonempty=True)
    if not c > 0:
        raise ValueError(f"c: expected a positive grounding bound, got {c}")
    return _qact_statistics(values, n_tau, c, n_samples, generator, bandwidth=check_bandwidth(bandwidth))


def check_bandwidth(bandwidth) -> Optional[float]:
    """``bandwidth`` as a float: None (Silverman's rule) or a positive finite number.

    Raises:
        ValueError: anything else (a bool, a non-number, zero, a negative or non-finite number).
    """
    if bandwidth is None:
        return None
    if (
        isinstance(bandwidth, bool)
        or not isinstance(bandwidth, numbers.Real)
        or not math.isfinite(bandwidth)
        or not float(bandwidth) > 0
    ):
        raise ValueError(f"bandwidth: expected a positive finite number or None (Silverman's rule), got {bandwidth!r}")
    return float(bandwidth)


def _fixed_bandwidth(bandwidth: float, channels: int, like: torch.Tensor) -> torch.Tensor:
    """``(C,)`` the fixed bandwidth of every channel, in ``like``'s dtype and on its device."""
    return torch.full((channels,), bandwidth, dtype=like.dtype, device=like.device)


def _grounded(values: torch.Tensor, c: float) -> torch.Tensor:
    """``(C, M + 2)``: each row of ``values`` followed by ``-c`` and ``+c`` (Alg. 1's grounding),
    made on the values' device (no host tensor to copy over)."""
    ch = values.shape[0]
    return torch.cat([values, values.new_full((ch, 1), -c), values.new_full((ch, 1), c)], dim=1)


def _sort_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.sort(t, dim=1)`` (values, indices). On CPU float32/float64 it goes through
    ``numpy.argsort``, whose vectorised (x86-simd-sort) kernels are faster than ``torch.sort`` on
    QACT contexts (``docs/performance.md``); the sorted values are the same either way (ties may be
    permuted, which no caller depends on)."""
    if t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64) and not t.requires_grad:
        order = torch.from_numpy(np.argsort(t.contiguous().numpy(), axis=1))
        return torch.gather(t, 1, order), order
    return torch.sort(t, dim=1)


def _qact_statistics(
    values, n_tau, c, n_samples, draws: Draws, with_counts: bool = False, bandwidth: Optional[float] = None
):
    """:func:`qact_statistics` without input validation (callers have validated ``x`` and ``bandwidth``).

    ``with_counts=True`` also returns the forward counts ``#{i : q_i <= v}`` of the context values
    themselves, ``(C, M)`` int64 -- the batch-context forward -- read off the sort that the
    quantiles need anyway: with ``pos_i = #{context < q_i}`` (``searchsorted`` of the ``n_tau``
    quantiles into the sorted context), ``q_i <= ctx_j`` exactly when ``pos_i <= j``, so the count of
    sorted entry ``j`` is the cumulative histogram of ``pos`` at ``j``; scattering it back through
    the sort permutation gives every value's count without a binary search per value (equal to
    ``searchsorted(quantiles, v, right=True)``, ties included). Returns ``(stats, counts)`` then.
    """
    if not with_counts and _compiled(values):
        sorted_ctx = _qact_cpu.sorted_grounded_context(values.detach().contiguous().numpy()[None], c)
        return _compiled_statistics(sorted_ctx, n_tau, n_samples, draws, values, bandwidth=bandwidth)
    ch, m = values.shape
    ctx, order = _sort_rows(_grounded(values, c))
    k_dim = ctx.shape[1]
    zero = torch.zeros(ch, 1, dtype=values.dtype, device=values.device)
    n_neg = torch.searchsorted(ctx, zero, right=False)[:, 0]  # number of values < 0
    levels = quantile_levels(n_tau, values.dtype, values.device).expand(ch, -1).contiguous()
    quantiles = _grounded_quantiles(ctx, n_neg, levels)
    counts = None
    if with_counts:
        pos = torch.searchsorted(ctx, quantiles, right=False)  # (C, n_tau): #{ctx < q_i}
        hist = torch.zeros(ch, k_dim + 1, dtype=torch.int64, device=values.device)
        hist.scatter_add_(1, pos, torch.ones_like(pos))
        cum = hist[:, :k_dim].cumsum_(1)  # count of sorted entry j: #{i : pos_i <= j}
        counts = torch.empty_like(cum).scatter_(1, order, cum)[:, :m]

    if n_samples == 0:
        empty = values.new_zeros(ch, 0)
        bw = values.new_zeros(ch) if bandwidth is None else _fixed_bandwidth(bandwidth, ch, values)
        stats = QACTStatistics(quantiles, empty, bw)
        return (stats, counts) if with_counts else stats
    samples, bw = _draw_samples(ctx, n_neg, n_samples, draws, bandwidth)
    stats = QACTStatistics(quantiles, samples, bw)
    return (stats, counts) if with_counts else stats


def _comb_offsets(draws: Draws, ch: int, device: torch.device) -> torch.Tensor:
    """``(C, 1)`` float64 offsets ``U`` in ``[0, 1)`` of the channels' combs (module doc, "Sampling"),
    multiples of ``2^-32``: from a seed tensor, 32 bits of ``SplitMix64(seed + c)`` for channel
    ``c`` computed on ``device`` (the compiled kernels' ``_comb_offset``: the same offsets for the
    same seed, and no generator, no read back to the host); from a generator (None: torch's default
    generator of ``device``), 32 random bits a channel."""
    if isinstance(draws, torch.Tensor):
        key = draws.reshape(1).to(device=device, dtype=torch.int64) + torch.arange(ch, device=device)
        bits = _rng.splitmix64(key) >> 32 & 0xFFFFFFFF
    else:
        bits = torch.randint(0, 2**32, (ch,), generator=draws, device=device)
    return bits.double().mul_(2.0**-32)[:, None]


def _draw_samples(
    ctx: torch.Tensor, n_neg: torch.Tensor, n_samples: int, draws: Draws, bandwidth: Optional[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(C, S)`` KDE samples and ``(C,)`` bandwidths from the sorted grounded context ``ctx``
    ``(C, K)`` with ``n_neg`` negative entries a row, ``S = n_samples >= 1`` (Alg. 2), the combs'
    offsets from ``draws`` (:func:`_comb_offsets`)."""
    ch, k_dim = ctx.shape
    # Alg. 2: S points drawn with the grounding weights by systematic sampling (module doc): entry k
    # of the sorted grounded context is drawn c_k - c_{k-1} times, so draw s is entry #{k : c_k <= s}
    u = _comb_offsets(draws, ch, ctx.device)
    counts_through = _comb_counts(n_neg, k_dim, n_samples, u)
    draw = torch.arange(n_samples, device=ctx.device).expand(ch, -1).contiguous()
    idx = torch.searchsorted(counts_through, draw, right=True)
    samples = torch.gather(ctx, 1, idx)  # sorted: ctx is, and idx is non-decreasing along each row
    return samples, _sample_bandwidth(samples, bandwidth)


def _sample_bandwidth(samples: torch.Tensor, bandwidth: Optional[float]) -> torch.Tensor:
    """``(C,)``: Silverman's rule on the drawn rows (sorted by construction, so not checked: a check
    would read a value back from a device), or the fixed ``bandwidth``."""
    if bandwidth is None:
        return silverman_bandwidth(samples, presorted=True)
    return _fixed_bandwidth(bandwidth, samples.shape[0], samples)


def default_statistics(
    num_channels: int,
    n_tau: int = 100,
    n_samples: int = 1000,
    dtype: torch.dtype = torch.float32,
    device=None,
    *,
    bandwidth: Optional[float] = None,
) -> QACTStatistics:
    """Statistics of a standard normal context (the initial frozen state, like BatchNorm's
    running mean 0 / var 1): quantiles ``Phi^-1(tau_i)``, samples ``Phi^-1((j + 1/2) / S)``, and
    their Silverman bandwidth or the fixed ``bandwidth``."""
    q = torch.special.ndtri(quantile_levels(n_tau, torch.float64, device))
    s = torch.special.ndtri((torch.arange(n_samples, dtype=torch.float64, device=device) + 0.5) / n_samples)
    q = q.to(dtype).expand(num_channels, -1).clone()
    s = s.to(dtype).expand(num_channels, -1).clone()
    bandwidth = check_bandwidth(bandwidth)
    return QACTStatistics(
        q,
        s,
        silverman_bandwidth(s, presorted=True) if bandwidth is None else _fixed_bandwidth(bandwidth, num_channels, s),
    )


# ----------------------------------------------------------------------------- dispatch
USE_COMPILED = True


def _compiled(x: torch.Tensor) -> bool:
    """Whether the compiled CPU kernels (:mod:`shiftguard.functional._qact_cpu`) handle ``x``:
    CPU float32/float64 with numba installed; the Triton kernels take CUDA inputs (:func:`_triton`),
    the eager torch code everything else. ``USE_COMPILED = False`` forces the eager code (the tests compare the two)."""
    return USE_COMPILED and _qact_cpu.AVAILABLE and x.is_cpu and x.dtype in (torch.float32, torch.float64)


#: Whether CUDA floating inputs (float32/float64; half precision in float32) take the Triton kernels
#: (:mod:`shiftguard.functional._qact_triton`) where triton is installed; False forces the eager torch
#: code there.
USE_TRITON = True


_TRITON_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _triton(x: torch.Tensor) -> bool:
    """Whether the Triton kernels handle ``x``: a CUDA floating tensor (half precision computed in
    float32, :func:`_triton_forward`), triton installed."""
    return USE_TRITON and x.is_cuda and x.dtype in _TRITON_DTYPES and _qact_triton.available()


def _checks_finite(x: torch.Tensor) -> bool:
    """Whether the forward that takes ``x`` refuses NaN/inf itself, in a pass it makes anyway (the
    compiled kernels' first, the Triton output pass's flags), before anything is stored."""
    return _compiled(x) or _triton(x)


class _Running(NamedTuple):
    """Running statistics moved in place towards the applied ones: ``buffer += momentum * (new -
    buffer)`` (``torch.lerp``), ``quantiles (C, n_tau)``, ``samples (C, S)``, ``bandwidth (C,)``;
    ``momentum`` a float, or a 0-dim tensor on the buffers' device (:func:`_cumulative`)."""

    quantiles: torch.Tensor
    samples: torch.Tensor
    bandwidth: torch.Tensor
    momentum: Union[float, torch.Tensor]


class _Forward(NamedTuple):
    """What the forward of either implementation returns (no gradient attached).

    Attributes:
        output: shaped like the input, values ``k / n_tau``.
        stats: the statistics applied: the batch's (``samples`` ``(C, 0)`` where they were drawn,
            binned and averaged into the running statistics without being kept), or those given.
        density: the KDE density at every value (Alg. 2, eq. (7)), contiguous and shaped like the
            input (float32 for a half-precision input), where the gradient will be needed and the
            applied statistics have samples; else None.
    """

    output: torch.Tensor
    stats: QACTStatistics
    density: Optional[torch.Tensor] = None


def _forward(
    x: torch.Tensor,
    stats: Optional[QACTStatistics],
    running: Optional[_Running],
    n_tau: int,
    c: float,
    n_samples: int,
    draws: Draws,
    need_density: bool,
    bandwidth: Optional[float] = None,
) -> _Forward:
    """The one dispatch of QACT's forward: the compiled CPU kernels where :func:`_compiled`, else the
    eager torch code; both compute the same values (module doc) behind this signature.

    ``stats``: the context's statistics, or None for the batch context (``x`` itself, with
    ``n_samples`` KDE draws from ``draws``, :data:`Draws`; 0 skips them). ``running``: moved towards the applied
    statistics here, in the same call (the compiled training pass does it inside its pass where the
    buffers allow, :func:`_running_arrays`; every other case through :func:`_running_lerp`, the same
    arithmetic). ``need_density``: the gradient will be needed. ``bandwidth``: a fixed KDE
    bandwidth (validated float) that the batch's statistics are computed with and that replaces
    the given statistics' own; None keeps Silverman's rule. ``x`` is validated except for
    NaN/inf, which both implementations refuse before anything is drawn or stored.

    Where ``need_density``, the density of the backward comes with the output (the compiled training
    pass computes both in one pass; every other path evaluates the grid KDE of the applied
    statistics' samples here, :func:`_density`), so that the backward is one multiplication and a
    traced forward hands its backward a tensor, nothing else."""
    with torch.no_grad():
        x = x.detach()
        if stats is not None and bandwidth is not None:
            stats = stats._replace(bandwidth=_fixed_bandwidth(bandwidth, stats.bandwidth.shape[0], stats.bandwidth))
        if _compiled(x):
            fwd, value_range = _compiled_forward(
                x, stats, running, n_tau, float(c), n_samples, draws, need_density, bandwidth
            )
        elif _triton(x):
            fwd, value_range = (
                _triton_forward(x, stats, running, n_tau, float(c), n_samples, draws, need_density, bandwidth),
                None,
            )
        else:
            fwd, value_range = _eager_forward(x, stats, running, n_tau, float(c), n_samples, draws, bandwidth), None
        if need_density and fwd.density is None and fwd.stats.samples.shape[1] > 0:
            fwd = fwd._replace(density=_density(x, fwd.stats, value_range))
        return fwd


def _density(x: torch.Tensor, stats: QACTStatistics, value_range: Optional[tuple]) -> torch.Tensor:
    """The grid KDE of ``stats``' samples at every value of ``x`` (Alg. 2, eq. (7)), contiguous and
    shaped like ``x``: by the compiled kernels over the value range their forward pass recorded
    (``value_range``; in float64, so that the backward rounds its product once,
    :func:`_density_dtype`), else by :func:`gaussian_kde_grid` (in float32 for a half-precision
    ``x``: the KDE's FFT has no half-precision kernel, and a density above 65504, a bandwidth below
    ~6e-6, overflows float16; the backward multiplies in float32 and rounds once)."""
    samples, bandwidth = stats.samples.to(x.dtype), stats.bandwidth.to(x.dtype)
    if value_range is not None:
        d3 = _qact_cpu.kde_density(
            _as3(x), samples.detach().contiguous().numpy(), bandwidth.detach().double().numpy(), *value_range
        )
        return torch.from_numpy(d3.reshape(x.shape))
    xs = channel_values(x).contiguous()
    if xs.dtype in (torch.float16, torch.bfloat16):
        dens = gaussian_kde_grid(xs.float(), samples.float(), bandwidth.float())
    else:
        dens = gaussian_kde_grid(xs, samples, bandwidth)
    return _from_channel_values(dens, x)


def _eager_forward(x, stats, running, n_tau, c, n_samples, draws, bandwidth=None) -> _Forward:
    """:func:`_forward` in torch: in batch context every value's count is read off the context sort
    (:func:`_qact_statistics`), with given statistics ``searchsorted`` into their quantiles."""
    if stats is None:
        stats, counts = _qact_statistics(
            channel_values(x), n_tau, c, n_samples, draws, with_counts=True, bandwidth=bandwidth
        )
        n_levels = n_tau
    else:
        q = stats.quantiles.to(x.dtype).contiguous()
        counts = torch.searchsorted(q, channel_values(x).contiguous(), right=True)  # #{i : q_i <= x}
        n_levels = q.shape[1]
    output = _from_channel_values(counts.to(x.dtype).div_(n_levels), x)
    if running is not None:
        _move_running(running, stats)
    return _Forward(output, stats)


def _triton_forward(x, stats, running, n_tau, c, n_samples, draws, need_density, bandwidth=None) -> _Forward:
    """:func:`_forward` by the Triton kernels (:mod:`shiftguard.functional._qact_triton`): the grounded
    context (kernel) sorted by ``torch.sort``, its quantiles (kernel), the draws and their Silverman bandwidth (kernel;
    the eager code beyond ``draws.SILVERMAN_MAX_SAMPLES`` samples), the KDE grid (kernel) and every
    value's output and density in one pass (kernel), which also checks the input for NaN/inf (read back
    outside a CUDA graph's capture, :func:`_refuse_non_finite`); nothing else is read back. The same
    output, quantiles and samples as :func:`_eager_forward`, the bandwidth to rounding (its sums are
    taken in another order); the density within the grid error bound of the exact KDE (the grid's
    nodes are exact sums, the eager grid bins).

    A half-precision ``x`` (float16, bfloat16) is computed in float32 on its values made float32
    (exactly): the float32 path's statistics and density, its output rounded to ``x``'s dtype (the
    eager code computes in the half dtype itself, so where a value lies within half-precision
    rounding of a quantile the two may count it differently)."""
    if x.dtype in (torch.float16, torch.bfloat16):
        fwd = _triton_forward(x.float(), stats, running, n_tau, c, n_samples, draws, need_density, bandwidth)
        return fwd._replace(output=fwd.output.to(x.dtype))
    kern = _qact_triton.kernels()
    ch = x.shape[1]
    # NaN/inf is refused by the output pass's flags, before the running update; a generator would
    # be drawn from before that, so with one the input is checked first
    checked = stats is None and bool(n_samples) and isinstance(draws, torch.Generator)
    if checked:
        _refuse_non_finite(x, "input")
    value_range: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    if stats is None:
        ctx = torch.sort(kern.grounded_context(x, c), dim=1).values
        q, n_neg, xmin, xmax = kern.grounded_quantiles(ctx, n_tau, c)
        value_range = (xmin, xmax)
        if n_samples:
            given = (
                {"seed": draws} if isinstance(draws, torch.Tensor) else {"offsets": _comb_offsets(draws, ch, x.device)}
            )
            samples, bw = kern.systematic_draws(ctx, n_neg, n_samples, silverman=bandwidth is None, **given)
            if bw is None:
                bw = _sample_bandwidth(samples, bandwidth)
        else:
            samples = x.new_zeros(ch, 0)
            bw = x.new_zeros(ch) if bandwidth is None else _fixed_bandwidth(bandwidth, ch, x)
        stats = QACTStatistics(q, samples, bw)
    q = stats.quantiles.to(x.dtype).contiguous()
    grid = lo = delta = n_nodes = None
    if need_density and stats.samples.shape[1] > 0:
        samples, h = stats.samples.to(x.dtype).contiguous(), stats.bandwidth.to(x.dtype).contiguous()
        # the values' range: read off the sorted context by the quantiles' kernel, else a reduction
        xmin, xmax = value_range if value_range is not None else torch.aminmax(channel_values(x), dim=1)
        grid, lo, delta, n_nodes = kern.kde_grid(
            samples, h, xmin, xmax, POINTS_PER_BANDWIDTH, TRUNCATE, _MAX_GRID_NODES
        )
    out, dens, finite = kern.levels_and_density(x, q, grid, lo, delta, n_nodes)
    if not checked:
        _refuse_non_finite(x, "input", flags=finite)
    if running is not None:
        _move_running(running, stats)
    return _Forward(out, stats, dens)


def _compiled_forward(
    x, stats, running, n_tau, c, n_samples, draws, need_density, bandwidth=None
) -> tuple[_Forward, Optional[tuple]]:
    """:func:`_forward` by the compiled CPU kernels, and the per-channel ``(min, max)`` float64
    arrays of ``x`` its output pass recorded (for :func:`_density`; None where the density came
    with the output).

    Given statistics: one pass gives every value's output, the NaN/inf check and the per-channel range
    (:func:`_qact_cpu.counts_output`). Batch context without a gradient: the context sort, the
    quantiles, the same output pass, then the draws. Batch context with a gradient: one pass per
    channel computes the statistics, the output and the density at every value
    (:func:`_qact_cpu.batch_channels`), after the context sort, whose ends reveal NaN/inf; for an
    ``(N, C)`` input (checked finite first) each thread sorts its own channels' rows inside it."""
    x3 = _as3(x)
    if stats is not None:
        q = stats.quantiles.to(x.dtype)
        out3, xmin, xmax = _qact_cpu.counts_output(
            x3, q.detach().contiguous().numpy(), _values_by_count(q.shape[1], x.dtype)
        )
        if running is not None:
            _move_running(running, stats)
        return _Forward(torch.from_numpy(out3.reshape(x.shape)), stats), (xmin, xmax)
    vbc = _values_by_count(n_tau, x.dtype)
    fused = bool(need_density and n_samples)
    # rows of an (N, C) input are short: sorted inside the fused pass, one parallel region; rows of
    # a conv input are long: sorted in a region of their own, which balances the threads better
    merged = fused and x3.shape[2] == 1 and _qact_cpu.all_finite(x3)
    ctx = None
    if not merged:
        ctx = _qact_cpu.sorted_grounded_context(x3, c)
        if not (fused and _qact_cpu.sorted_context_finite(ctx)):
            q = _qact_cpu.grounded_quantiles(ctx, n_tau)
            # the output pass also checks for NaN/inf, before any random draw or stored statistic
            out3, xmin, xmax = _qact_cpu.counts_output(x3, q, vbc)
            stats = _compiled_statistics(ctx, n_tau, n_samples, draws, x, q, bandwidth)
            if running is not None:
                _move_running(running, stats)
            return _Forward(torch.from_numpy(out3.reshape(x.shape)), stats), (xmin, xmax)
    arrays = _running_arrays(running, x, n_tau, n_samples)
    # where the pass moves the running statistics itself, it keeps no samples (stats has (C, 0)):
    # they are needed only for that update
    q, samples, bw, out3, dens3 = _qact_cpu.batch_channels(
        x3,
        ctx,
        c,
        n_tau,
        n_samples,
        _draw_seed(draws),
        vbc,
        running=arrays,
        keep_samples=arrays is None,
        bandwidth=bandwidth,
    )
    stats = QACTStatistics(
        torch.from_numpy(q),
        x.new_empty(x.shape[1], 0) if samples is None else torch.from_numpy(samples),
        torch.from_numpy(bw),
    )
    if running is not None and arrays is None:
        _move_running(running, stats)
    return _Forward(torch.from_numpy(out3.reshape(x.shape)), stats, torch.from_numpy(dens3.reshape(x.shape))), None


class _QACTFunction(torch.autograd.Function):
    """Autograd of QACT given its finished forward (:class:`_Forward`): the output is returned as
    computed; the backward is ``grad_output * f_hat(x)`` (Alg. 2, eq. (7)) with the density the
    forward computed (:func:`_backward`)."""

    @staticmethod
    def forward(ctx, x, fwd):
        ctx.save_for_backward(x.new_empty(0) if fwd.density is None else fwd.density)
        return fwd.output

    @staticmethod
    def backward(ctx, grad_output):
        (dens,) = ctx.saved_tensors
        return _backward(grad_output, dens), None


def _backward(grad_output: torch.Tensor, density: torch.Tensor) -> torch.Tensor:
    """``grad_output * density`` (Alg. 2, eq. (7)); a float32 density of a half-precision input
    multiplies in float32, the product rounded once to the gradient's dtype."""
    if density.numel() == 0:
        raise RuntimeError("QACT backward needs KDE samples: the statistics were computed with n_samples=0")
    if density.dtype != grad_output.dtype:
        return (grad_output.to(density.dtype) * density).to(grad_output.dtype)
    return grad_output * density


def _attach(x: torch.Tensor, fwd: _Forward) -> torch.Tensor:
    """The forward's output, with QACT's gradient where one will be needed."""
    if torch.is_grad_enabled() and x.requires_grad:
        return _QACTFunction.apply(x, fwd)
    return fwd.output


# ----------------------------------------------------------------------------- custom operators
# QACT as one torch.library operator, the form in which it enters a torch.compile graph: the forward
# (:func:`_forward` behind a fixed signature, with a fake implementation that gives the output
# shapes without running anything; its gradient attached by :class:`_TracedQACT`), which moves the
# running statistics in place as the eager forward does (the compiled CPU kernels inside their pass,
# without keeping the draws; every other path by the same lerp): one operator, so that a traced
# training step pays one dispatch and no batch statistics are handed from one operator to another.
# The randomness enters as a seed tensor, which the forward turns into its draws as the eager
# forward does (:func:`_draws_of_seed`), so compiled and eager give the same bits. Everything inside
# the operator runs eagerly (numba, Triton, torch); only the signature is traced.
@torch.library.custom_op(
    "shiftguard::qact_forward", mutates_args=("running_quantiles", "running_samples", "running_bandwidth")
)
def _qact_forward_op(
    x: torch.Tensor,
    quantiles: Optional[torch.Tensor],
    samples: Optional[torch.Tensor],
    bandwidth_t: Optional[torch.Tensor],
    seed: Optional[torch.Tensor],
    running_quantiles: Optional[torch.Tensor],
    running_samples: Optional[torch.Tensor],
    running_bandwidth: Optional[torch.Tensor],
    momentum: float,
    count: Optional[torch.Tensor],
    n_tau: int,
    c: float,
    n_samples: int,
    bandwidth: Optional[float],
    need_density: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, density)``: :func:`_forward` of ``x`` with the given statistics (``quantiles`` not
    None) or in batch context, with ``n_samples`` draws given by ``seed`` (:func:`_draws_of_seed`);
    the density where ``need_density`` (an empty tensor otherwise). Where the running statistics are
    given they move towards the applied statistics (with the fixed ``bandwidth`` in place of
    theirs) with weight ``momentum``, or ``1 / (count + 1)`` where ``count`` (the update count, a
    tensor) is given: the cumulative average."""
    if not _checks_finite(x):
        _refuse_non_finite(x, "input")
    stats = None
    if quantiles is not None and samples is not None and bandwidth_t is not None:
        stats = QACTStatistics(quantiles, samples, bandwidth_t)
    running = None
    if running_quantiles is not None and running_samples is not None and running_bandwidth is not None:
        m = momentum if count is None else _cumulative(count)
        running = _Running(running_quantiles, running_samples, running_bandwidth, m)
    draws = _draws_of_seed(seed, x.device) if stats is None and n_samples and seed is not None else None
    fwd = _forward(x, stats, running, n_tau, c, n_samples, draws, need_density, bandwidth)
    dtype = _density_dtype(x, stats is not None)
    density = fwd.density if need_density and fwd.density is not None else x.new_empty(0, dtype=dtype)
    return fwd.output, density


def _density_dtype(x: torch.Tensor, given: bool) -> torch.dtype:
    """The dtype of the density the forward hands the backward: float64 from the compiled CPU
    kernels with given statistics (:func:`_density`), float32 for a half-precision ``x``, else
    ``x``'s."""
    if given and _compiled(x):
        return torch.float64
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


@_qact_forward_op.register_fake
def _(x, quantiles, samples, bandwidth_t, seed, rq, rs, rb, momentum, count, n_tau, c, n_samples, bandwidth, need):
    has_samples = n_samples > 0 if samples is None else samples.shape[1] > 0
    dtype = _density_dtype(x, quantiles is not None)
    return x.new_empty(x.shape), x.new_empty(x.shape if need and has_samples else (0,), dtype=dtype)


class _TracedQACT(torch.autograd.Function):
    """The operator's output with QACT's gradient, ``grad_output * density`` (:func:`_backward`):
    the operator moves the running statistics in place, and torch.library registers autograd
    formulas for functional operators only, so the gradient is attached here (traced whole by
    ``torch.compile``: the operator inside, the product of the backward)."""

    @staticmethod
    def forward(ctx, x, *args):
        out, density = _qact_forward_op(x, *args)
        ctx.save_for_backward(density)
        ctx.n_args = len(args)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        (density,) = ctx.saved_tensors
        return (_backward(grad_output, density),) + (None,) * ctx.n_args


def _traced_apply(
    x: torch.Tensor,
    stats: Optional[QACTStatistics],
    running: Optional[_Running],
    n_tau: int,
    c: float,
    n_samples: int,
    seed: Optional[torch.Tensor],
    need_density: bool,
    bandwidth: Optional[float],
    count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """What :func:`_attach` of :func:`_forward` computes, through the operator (the same bits for the
    same seed): ``running`` moved towards the batch's statistics or the given ones (with the fixed
    ``bandwidth`` in place of theirs); ``count``: the momentum is the cumulative average
    ``1 / (count + 1)`` instead of ``running.momentum``."""
    given = (None, None, None) if stats is None else tuple(stats)
    moved = (None, None, None, 0.0) if running is None else (*running[:3], float(running.momentum))
    args = (*given, seed, *moved, count, n_tau, float(c), n_samples, bandwidth, need_density)
    if need_density:
        return _TracedQACT.apply(x, *args)
    return _qact_forward_op(x, *args)[0]


# ----------------------------------------------------------------------------- compiled-path helpers
def _as3(t: torch.Tensor) -> np.ndarray:
    """``(N, C, *spatial)`` tensor -> contiguous numpy ``(N, C, L)``, without a copy when contiguous
    (reshaped by numpy: no torch call)."""
    t = t.detach()
    if t.is_contiguous():
        a = t.numpy()
        return a.reshape(a.shape[0], a.shape[1], -1)
    return t.reshape(t.shape[0], t.shape[1], -1).contiguous().numpy()


@functools.lru_cache(maxsize=64)
def _values_by_count(n_tau: int, dtype: torch.dtype) -> np.ndarray:
    """``k / n_tau`` for ``k = 0..n_tau`` with torch's rounding in ``dtype`` (the eager forward's
    values); read-only and cached."""
    table = torch.arange(n_tau + 1, dtype=dtype).div_(n_tau).numpy()
    table.flags.writeable = False
    return table


def _draw_seed(draws: Draws) -> int:
    """The seed of the compiled kernels' KDE draws (CPU): a seed tensor's value, or one draw from the
    generator (torch's global one where None)."""
    if isinstance(draws, torch.Tensor):
        return int(draws.reshape(()).item())
    return int(torch.randint(0, 2**62, (1,), generator=draws).item())


def _compiled_statistics(
    ctx: np.ndarray,
    n_tau: int,
    n_samples: int,
    draws: Draws,
    like: torch.Tensor,
    quantiles: Optional[np.ndarray] = None,
    bandwidth: Optional[float] = None,
) -> QACTStatistics:
    """Statistics from the sorted grounded context ``ctx`` ``(C, M + 2)`` by the compiled kernels
    (``quantiles``: :func:`_qact_cpu.grounded_quantiles` of ``ctx`` where the caller has them;
    ``bandwidth``: the fixed bandwidth in place of Silverman's)."""
    if quantiles is None:
        quantiles = _qact_cpu.grounded_quantiles(ctx, n_tau)
    q = torch.from_numpy(quantiles)
    ch = ctx.shape[0]
    fixed = None if bandwidth is None else _fixed_bandwidth(bandwidth, ch, like)
    if not n_samples:
        return QACTStatistics(q, like.new_zeros(ch, 0), like.new_zeros(ch) if fixed is None else fixed)
    samples, bw = _qact_cpu.grounded_samples(ctx, n_samples, _draw_seed(draws))
    return QACTStatistics(q, torch.from_numpy(samples), torch.from_numpy(bw).to(like.dtype) if fixed is None else fixed)


def _running_lerp(buffer: torch.Tensor, new: torch.Tensor, momentum) -> None:
    """``buffer += momentum * (new - buffer)`` in place (``new`` converted to ``buffer``'s dtype
    first): a running statistic's update. On CPU through the compiled kernels
    (:func:`_qact_cpu.lerp_rows_`), the arithmetic the fused training pass uses for the same update,
    so a layer's buffers do not depend on which pass computed its statistics; else ``lerp_``."""
    new = new.detach().to(buffer.dtype)
    if (
        _compiled(buffer)
        and not isinstance(momentum, torch.Tensor)
        and buffer.is_contiguous()
        and buffer.shape == new.shape
        and buffer.dim() <= 2
    ):
        rows = buffer.shape[0] if buffer.dim() else 1
        _qact_cpu.lerp_rows_(
            buffer.detach().numpy().reshape(rows, -1), new.contiguous().numpy().reshape(rows, -1), momentum
        )
    else:  # (a tensor momentum: a weight on the device, _cumulative)
        buffer.lerp_(new, momentum.to(buffer.dtype) if isinstance(momentum, torch.Tensor) else momentum)


def _move_running(running: _Running, stats: QACTStatistics) -> None:
    """Move the running statistics towards ``stats`` (:func:`_running_lerp` each)."""
    _running_lerp(running.quantiles, stats.quantiles, running.momentum)
    _running_lerp(running.samples, stats.samples, running.momentum)
    _running_lerp(running.bandwidth, stats.bandwidth, running.momentum)


def _running_arrays(running: Optional[_Running], x: torch.Tensor, n_tau: int, n_samples: int) -> Optional[tuple]:
    """``running`` as the numpy arrays the fused kernel updates in place, or None where it cannot
    (another dtype or device, a non-contiguous buffer)."""
    if running is None:
        return None
    rq, rs, rb = running.quantiles, running.samples, running.bandwidth
    ch = x.shape[1]
    for b in (rq, rs, rb):
        if not b.is_cpu or b.dtype != x.dtype or not b.is_contiguous() or b.requires_grad:
            return None
    if rq.shape != (ch, n_tau) or rs.shape != (ch, n_samples) or rb.shape != (ch,):
        return None
    return float(running.momentum), rq.numpy(), rs.numpy(), rb.numpy()


# ----------------------------------------------------------------------------- public entry points
def _check_input(x: torch.Tensor, name: str = "input", finite: Optional[bool] = None) -> torch.Tensor:
    """Validate a QACT input. ``finite=None``: the NaN/inf check is left to the compiled CPU or the
    Triton forward where that runs (a pass over the values checks them before anything is stored:
    the compiled kernels' first, the Triton output pass); ``True``: check here; ``False``: not here
    (the operator checks it, :func:`_qact_forward_op`)."""
    x = check_tensor(x, name, min_ndim=2, floating=True, nonempty=True)
    if finite or (finite is None and not _checks_finite(x)):
        _refuse_non_finite(x, name)
    return x


def _check_statistic(t, name: str, shape: tuple) -> torch.Tensor:
    """A statistic's tensor of exactly ``shape`` (``-1``: any size there)."""
    t = check_tensor(t, name, ndim=len(shape), floating=True)
    if any(want not in (-1, got) for want, got in zip(shape, t.shape)):
        want = ", ".join("*" if s == -1 else str(s) for s in shape)
        raise ValueError(f"{name}: expected shape ({want}{',' if len(shape) == 1 else ''}), got {tuple(t.shape)}")
    return t


def qact_apply(x: torch.Tensor, stats: QACTStatistics) -> torch.Tensor:
    """(b) Apply given context statistics to ``x`` [QACT, Alg. 1 eq. (6) and Alg. 2 eq. (7)].

    Args:
        x: ``(N, C)`` or ``(N, C, *spatial)`` finite floating tensor.
        stats: :class:`QACTStatistics` with ``C`` rows on ``x``'s device (converted to ``x``'s dtype).

    Returns:
        Tensor shaped like ``x`` with values in ``{0, 1/n_tau, ..., 1}``. Its gradient is
        ``grad_output * f_hat(x)`` (fast grid KDE, :func:`shiftguard.functional.kde.gaussian_kde_grid`).

    Raises:
        ValueError: ``x`` is not a non-empty floating tensor of at least 2 dims, or (compiled CPU
            kernels, or the Triton kernels on CUDA) holds NaN/inf; ``stats`` has another number of
            channels.
    """
    x = check_tensor(x, "x", min_ndim=2, floating=True, nonempty=True)
    if x.shape[1] != stats.quantiles.shape[0]:
        raise ValueError(f"stats: expected statistics for {x.shape[1]} channels, got {stats.quantiles.shape[0]}")
    need_density = torch.is_grad_enabled() and x.requires_grad
    if torch.compiler.is_compiling():
        return _traced_apply(x, stats, None, stats.quantiles.shape[1], 0.0, 0, None, need_density, None)
    return _attach(x, _forward(x, stats, None, stats.quantiles.shape[1], 0.0, 0, None, need_density))


def quantile_activation(
    input: torch.Tensor,
    running_quantiles: Optional[torch.Tensor] = None,
    running_samples: Optional[torch.Tensor] = None,
    running_bandwidth: Optional[torch.Tensor] = None,
    training: bool = False,
    momentum: Optional[float] = 0.1,
    *,
    context: str = "batch",
    statistics: Optional[QACTStatistics] = None,
    n_tau: int = 100,
    c: float = 100.0,
    n_samples: int = 1000,
    generator: Optional[torch.Generator] = None,
    bandwidth: Optional[float] = None,
    seed: Optional[torch.Tensor] = None,
    num_batches_tracked: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """QACT [QACT, Alg. 1-2] with the contract of :func:`torch.nn.functional.batch_norm`.

    ``context="batch"``: ``input`` is its own context (its statistics are computed here); when
    ``training`` and running statistics are given, they move towards the batch's in place,
    ``running = (1 - momentum) * running + momentum * batch`` (as ``torch.lerp``), sorted samples
    staying sorted. ``statistics`` replaces the batch's own by statistics computed elsewhere (the
    context gathered over processes), applied and averaged in the same way. ``context="frozen"``:
    the running statistics are the context; nothing is updated (``training`` and ``momentum`` are
    not used). The update count (``num_batches_tracked``) is the caller's, as for BatchNorm.

    Args:
        input: ``(N, C)`` or ``(N, C, *spatial)`` finite floating tensor.
        running_quantiles: ``(C, n_tau)`` or None. running_samples: ``(C, S)`` or None.
            running_bandwidth: ``(C,)`` or None. All three or none; floating, on ``input``'s device
            (any floating dtype: converted for use, updated in their own). Required by ``"frozen"``;
            in batch context their shapes must match ``n_tau`` and ``n_samples``.
        training: move the running statistics (batch context only).
        momentum: weight of the batch in the update, in ``[0, 1]``; ``1 / (n + 1)`` after ``n``
            updates gives the cumulative average. None: the cumulative average, ``n`` read from
            ``num_batches_tracked`` (a tensor, so the weight is computed inside the update, also
            in a ``torch.compile`` graph, as ``nn.BatchNorm``'s ``momentum=None``).
        num_batches_tracked: the update count (an integer tensor, the caller's, not incremented
            here); used, and required, when ``momentum`` is None in a training update.
        context: ``"batch"`` or ``"frozen"``.
        statistics: :class:`QACTStatistics` with ``C`` rows to use instead of ``input``'s own (batch
            context only).
        n_tau, c, n_samples, generator: see :func:`qact_statistics` (batch context). The KDE sample
            is drawn only where it is used: for the gradient or the running update.
        bandwidth: the KDE bandwidth of the backward (Alg. 2, eq. (7)). None (default): Silverman's
            rule per channel on the KDE samples. A positive float: that bandwidth for every channel,
            in every context -- the batch's statistics are computed with it and it replaces the
            bandwidth of the statistics applied (``"frozen"``, ``statistics``), so the running
            bandwidth moves towards it. The forward does not depend on it.
        seed: in place of ``generator``, a one-element integer tensor (e.g. ``torch.randint(0,
            2**62, (1,), device=input.device)``). On the CPU the KDE draws then come from a fresh
            generator seeded with it, exactly as with ``generator=torch.Generator()
            .manual_seed(int(seed))``; on another device each channel ``c``'s comb offset is 32 bits
            of ``SplitMix64(seed + c)`` computed there (the compiled CPU kernels' stream), so no
            generator is made and nothing is read back (CUDA graphs, ``docs/qact.md``). Unlike a
            generator, a seed tensor can enter a ``torch.compile`` graph. Under ``torch.compile``
            without a seed, one is drawn with ``torch.randint`` from ``generator``'s stream (the
            global RNG when None), so there the samples differ from the eager call's.

    Under ``torch.compile`` the call is traced as the operator ``torch.ops.shiftguard.qact_forward``
    (the same computation, the running update and the NaN/inf check inside it).

    Returns:
        Tensor shaped like ``input``, values in ``{0, 1/n_tau, ..., 1}``; its gradient is
        ``grad_output * f_hat(input)`` (Alg. 2, eq. (7)).

    Raises:
        ValueError: an argument out of its domain, named: ``input`` not a non-empty floating tensor of
            at least 2 dims or holding NaN/inf, a running statistic of the wrong shape or missing,
            ``context`` unknown, ``momentum`` outside ``[0, 1]``, ``c`` not positive, ``bandwidth``
            neither None nor a positive finite number.
        TypeError: a tensor argument that is not a (floating) tensor.
    """
    cumulative = momentum is None and training and context == "batch"
    if cumulative and num_batches_tracked is None:
        raise ValueError("num_batches_tracked: momentum=None (the cumulative average) needs the update count")
    return _quantile_activation(
        input,
        running_quantiles,
        running_samples,
        running_bandwidth,
        training,
        1.0 if momentum is None else momentum,
        context=context,
        statistics=statistics,
        n_tau=n_tau,
        c=c,
        n_samples=n_samples,
        generator=generator,
        bandwidth=bandwidth,
        seed=seed,
        count=num_batches_tracked if cumulative else None,
    )


def _quantile_activation(
    input,
    running_quantiles,
    running_samples,
    running_bandwidth,
    training,
    momentum,
    *,
    context,
    statistics,
    n_tau,
    c,
    n_samples,
    generator,
    bandwidth,
    seed,
    count: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """:func:`quantile_activation`; ``count``: the update count (a tensor; the module's
    ``num_batches_tracked``) whose cumulative average ``1 / (count + 1)`` replaces ``momentum`` (read
    inside the operator when traced, so that no Python number in the graph depends on a
    tensor)."""
    traced = torch.compiler.is_compiling()
    if seed is not None and generator is not None:
        raise ValueError("seed: expected either a seed or a generator, got both")
    input = _check_input(input, finite=False if traced else None)
    bandwidth = check_bandwidth(bandwidth)
    if context not in ("batch", "frozen"):
        raise ValueError(f"context: expected one of batch, frozen, got {context!r}")
    given = [t is not None for t in (running_quantiles, running_samples, running_bandwidth)]
    if any(given) and not all(given):
        missing = [n for n, g in zip(("running_quantiles", "running_samples", "running_bandwidth"), given) if not g]
        raise ValueError(f"{missing[0]}: expected all three running statistics or none")
    ch = input.shape[1]
    if context == "frozen":
        if not all(given):
            raise ValueError("running_quantiles: the frozen context needs the running statistics")
        if statistics is not None:
            raise ValueError("statistics: only the batch context takes statistics computed elsewhere")
        stats = QACTStatistics(
            _check_statistic(running_quantiles, "running_quantiles", (ch, -1)),
            _check_statistic(running_samples, "running_samples", (ch, -1)),
            _check_statistic(running_bandwidth, "running_bandwidth", (ch,)),
        )
        need_density = torch.is_grad_enabled() and input.requires_grad
        if traced:
            return _traced_apply(input, stats, None, stats.quantiles.shape[1], 0.0, 0, None, need_density, bandwidth)
        return _attach(
            input, _forward(input, stats, None, stats.quantiles.shape[1], 0.0, 0, None, need_density, bandwidth)
        )
    if statistics is not None and statistics.quantiles.shape[0] != ch:
        raise ValueError(f"statistics: expected statistics for {ch} channels, got {statistics.quantiles.shape[0]}")
    n_tau = check_positive(n_tau, "n_tau", integer=True)
    n_samples = check_positive(n_samples, "n_samples", strict=False, integer=True)
    if not c > 0:
        raise ValueError(f"c: expected a positive grounding bound, got {c}")
    running = None
    if training and all(given):
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"momentum: expected a value in [0, 1], got {momentum}")
        n_s = n_samples if statistics is None else statistics.samples.shape[1]
        n_q = n_tau if statistics is None else statistics.quantiles.shape[1]
        running = _Running(
            _check_statistic(running_quantiles, "running_quantiles", (ch, n_q)),
            _check_statistic(running_samples, "running_samples", (ch, n_s)),
            _check_statistic(running_bandwidth, "running_bandwidth", (ch,)),
            float(momentum),
        )
    need_density = torch.is_grad_enabled() and input.requires_grad
    draws = n_samples if (need_density or running is not None) else 0
    if traced:
        if seed is None:
            on = generator.device if generator is not None else input.device
            seed = torch.randint(0, 2**62, (1,), generator=generator, device=on)
        return _traced_apply(input, statistics, running, n_tau, c, draws, seed, need_density, bandwidth, count)
    source: Draws = generator if seed is None else _draws_of_seed(seed, input.device)
    if running is not None and count is not None:
        running = running._replace(momentum=_cumulative(count))
    return _attach(input, _forward(input, statistics, running, n_tau, c, draws, source, need_density, bandwidth))


def _seeded(seed: torch.Tensor, device) -> torch.Generator:
    """A generator on ``device`` seeded with the one-element integer tensor ``seed``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(int(seed.reshape(()).item()))
    return generator


def _draws_of_seed(seed: torch.Tensor, device: torch.device) -> Draws:
    """The KDE draws a seed tensor stands for on ``device``. On the CPU: a generator seeded with it
    (what QACT has always drawn from there, so CPU results keep their bits). Elsewhere: the seed
    itself on ``device``, whose comb offsets are computed there (:func:`_comb_offsets`, the compiled
    CPU kernels' counter-based arithmetic): no generator is created and nothing is read back, so
    that the forward can be captured in a CUDA graph."""
    if torch.device(device).type == "cpu":
        return _seeded(seed, device)
    return seed.to(device)


def _capturing() -> bool:
    """Whether the current CUDA stream is being captured into a CUDA graph."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _refuse_non_finite(x: torch.Tensor, name: str, flags: Optional[torch.Tensor] = None) -> None:
    """``check_finite(x, name)``, which reads its verdict back to the host, except off the CPU while
    a CUDA graph is being captured, where no value may be read back: there a device-side assertion
    (``torch._assert_async``) is recorded instead, so a replay that meets NaN/inf stops with CUDA's
    "device-side assert triggered" (without the argument's name) instead of going on silently.
    ``flags``: the Triton output pass's (``flags.all()`` is whether ``x`` holds no NaN/inf), the
    verdict in one reduction instead of a pass of its own; the message, counting NaN and inf, is
    then made only for an input that fails."""
    verdict = torch.isfinite(x).all() if flags is None else flags.all()
    if x.device.type != "cpu" and _capturing():
        torch._assert_async(verdict)
    elif not bool(verdict):
        check_finite(x, name)


def _cumulative(count: torch.Tensor):
    """The weight of the next batch in a cumulative average after ``count`` (a tensor) updates: a
    float on the CPU, a float64 0-dim tensor computed on ``count``'s device elsewhere (read by
    :func:`_running_lerp` there, so a CUDA update reads nothing back)."""
    if count.device.type == "cpu":
        return 1.0 / float(count.reshape(()).item() + 1)
    return (count.reshape(()) + 1).double().reciprocal()
