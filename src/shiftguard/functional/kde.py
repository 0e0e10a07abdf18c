"""Weighted Gaussian kernel density estimates used by the QACT backward pass [QACT, Alg. 2, eq. (7)].

[QACT, Sec. 2] "Estimating the Density for Back-Propagation": the gradient of QACT is the density of
the grounded context distribution z‡ (eq. (5)); it is estimated by (i) drawing ``S`` points from the
context with the grounding weights and (ii) a Gaussian KDE of those points evaluated at every input.
Here the ``S`` points already carry the weights (they were drawn with them), so the KDE gives each
the same weight ``1/S``::

    f_hat(x) = 1 / (S h) * sum_s phi((x - s) / h),      phi = standard normal density.

All functions work per channel: ``samples`` is ``(C, S)``, ``bandwidth`` ``(C,)``, query points
``(C, M)``. Three pieces:

- :func:`silverman_bandwidth` -- the bandwidth rule (Silverman 1986, eq. (3.31)):
  ``h = 0.9 * min(std, IQR / 1.34) * S^(-1/5)``.
- :func:`gaussian_kde` -- exact evaluation, ``O(M S)`` per channel (chunked; a reference).
- :func:`gaussian_kde_grid` -- the fast evaluation used in training: samples are linearly binned
  on a per-channel grid of spacing ``delta <= h / points_per_bandwidth``, convolved with the
  Gaussian kernel truncated at ``truncate * h`` (by FFT), and the grid values are
  linearly interpolated at the query points. :func:`kde_grid_error_bound` gives its worst-case
  absolute error (see ``docs/qact.md``)::

      |f_grid(x) - f_hat(x)| <= phi(0) * delta^2 / (4 h^3) + 2 phi(truncate) / h

  (linear binning and linear interpolation each err by at most ``delta^2/8 * max|f''|`` and
  ``max|d^2/du^2 phi(u/h)/h| = phi(0)/h^3``; each truncation drops at most ``phi(truncate)/h``).
  With the defaults (:data:`POINTS_PER_BANDWIDTH` = 8, :data:`TRUNCATE` = 4) that is
  ``(1/256 + 2 e^-8) phi(0)/h``, ``<= 0.46%`` of the kernel peak ``phi(0)/h``, a worst case (all
  mass on one point; measured on the benchmark's contexts: 0.005-0.023%). Both are below the
  smoothing bias of the estimate itself: with Silverman's ``h`` for ``S = 1000``, ``E f_hat`` at
  the mode of a normal context is the density of ``N(0, 1 + h^2)``, 0.56% of the kernel peak
  below the true one (``docs/qact.md``).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "POINTS_PER_BANDWIDTH",
    "TRUNCATE",
    "silverman_bandwidth",
    "gaussian_kde",
    "gaussian_kde_grid",
    "kde_grid",
    "kde_grid_error_bound",
]

_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)

#: Default grid nodes per bandwidth (``delta = h / POINTS_PER_BANDWIDTH``) and kernel support in
#: bandwidths of the grid KDE; error bound in the module docstring. A finer grid or a wider support
#: tightens the bound but makes the convolution, which dominates the dense-layer backward, costlier.
POINTS_PER_BANDWIDTH = 8
TRUNCATE = 4.0

_HALF = (torch.float16, torch.bfloat16)


def _widen(t: torch.Tensor) -> torch.Tensor:
    """Half-precision tensors as float32 (exact: every float16/bfloat16 value is a float32 value)."""
    return t.float() if t.dtype in _HALF else t


def _is_sorted(v: torch.Tensor) -> bool:
    return v.shape[1] < 2 or bool((v[:, 1:] >= v[:, :-1]).all())


def _sorted_quantile(srt: torch.Tensor, level: float) -> torch.Tensor:
    """Linear-interpolation quantile of sorted rows (``torch.quantile``'s default "linear")."""
    pos = level * (srt.shape[1] - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, srt.shape[1] - 1)
    return srt[:, lo] + (pos - lo) * (srt[:, hi] - srt[:, lo])


def silverman_bandwidth(samples: torch.Tensor, *, presorted: bool = False) -> torch.Tensor:
    """Silverman's rule of thumb per row: ``0.9 * A * S^(-1/5)``, ``A = min(std, IQR/1.34)``.

    Args:
        samples: ``(C, S)`` sample points (any order), ``S >= 1``.
        presorted: the caller knows every row is sorted ascending: the check that would find it
            out, which reads a value back from a GPU (a synchronisation, refused inside CUDA-graph
            capture), is skipped. Rows that are not sorted then give a wrong IQR.

    Returns:
        ``(C,)`` strictly positive bandwidths. Where the IQR is 0 (more than half the sample on one
        value) ``A`` falls back to the standard deviation; where that is 0 too (all samples equal)
        to ``1e-3 * max(1, |value|)`` so that the density stays finite.
    """
    s = samples.shape[1]
    srt = samples if presorted or _is_sorted(samples) else torch.sort(samples, dim=1).values
    std = samples.std(dim=1, unbiased=s > 1) if s > 1 else torch.zeros_like(samples[:, 0])
    iqr = (_sorted_quantile(srt, 0.75) - _sorted_quantile(srt, 0.25)) / 1.34
    a = torch.minimum(std, iqr)
    a = torch.where(a > 0, a, std)
    floor = 1e-3 * samples.abs().amax(dim=1).clamp_min(1.0)
    a = torch.where(a > 0, a, floor)
    return 0.9 * a * s ** (-0.2)


def gaussian_kde(x: torch.Tensor, samples: torch.Tensor, bandwidth: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Exact Gaussian KDE ``f_hat`` of each row of ``samples`` at each row of ``x``.

    Args:
        x: ``(C, M)`` query points. samples: ``(C, S)``. bandwidth: ``(C,)`` positive.
        chunk: query points evaluated at once (memory ``C * chunk * S``).

    Returns:
        ``(C, M)`` densities.
    """
    h = bandwidth[:, None, None]
    out = torch.empty_like(x)
    s = samples[:, None, :]
    for start in range(0, x.shape[1], chunk):
        u = (x[:, start : start + chunk, None] - s) / h
        dens = torch.exp(-0.5 * u * u).sum(dim=2) * (_INV_SQRT_2PI / samples.shape[1])
        out[:, start : start + chunk] = dens / h[:, :, 0]
    return out


def kde_grid_error_bound(bandwidth: torch.Tensor, spacing: torch.Tensor, truncate: float = TRUNCATE) -> torch.Tensor:
    """Worst-case ``|gaussian_kde_grid - gaussian_kde|`` per channel for grid ``spacing``."""
    h = bandwidth
    phi_t = _INV_SQRT_2PI * math.exp(-0.5 * truncate * truncate)
    return _INV_SQRT_2PI * spacing**2 / (4.0 * h**3) + 2.0 * phi_t / h


def _grid_spacing(
    bandwidth: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, points_per_bandwidth: int, max_points: int
) -> torch.Tensor:
    # Fine enough for the error bound, but never more than max_points grid points per channel
    # (only reached when the query range spans > max_points / points_per_bandwidth bandwidths).
    return torch.maximum(bandwidth / points_per_bandwidth, (hi - lo) / (max_points - 1))


def grid_layout(
    smin: torch.Tensor,
    smax: torch.Tensor,
    bandwidth: torch.Tensor,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    points_per_bandwidth: int = POINTS_PER_BANDWIDTH,
    truncate: float = TRUNCATE,
    max_points: int = 4096,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each channel's grid lies: nodes ``lo + j * delta``, ``j < n_nodes``, covering the query
    range ``[xmin, xmax]`` where it is within reach (``truncate * h``) of a sample in
    ``[smin, smax]``; ``delta = h / points_per_bandwidth`` unless that needs more than
    ``max_points`` nodes. All ``(C,)``; ``n_nodes`` int64. Shared by :func:`kde_grid` and the
    compiled backward (:mod:`shiftguard.functional._qact_cpu`)."""
    h = bandwidth
    lo = torch.maximum(xmin, smin - truncate * h)
    hi = torch.maximum(torch.minimum(xmax, smax + truncate * h), lo)
    delta = _grid_spacing(h, lo, hi, points_per_bandwidth, max_points)
    return lo, delta, torch.ceil((hi - lo) / delta).long() + 2


def kde_grid(
    samples: torch.Tensor,
    bandwidth: torch.Tensor,
    xmin: torch.Tensor,
    xmax: torch.Tensor,
    points_per_bandwidth: int = POINTS_PER_BANDWIDTH,
    truncate: float = TRUNCATE,
    max_points: int = 4096,
):
    """The grid of :func:`gaussian_kde_grid`: KDE values on nodes ``lo + j * delta`` per channel.

    Args:
        samples: ``(C, S)``. bandwidth: ``(C,)``. xmin, xmax: ``(C,)`` range of the query points
            (the grid covers the part of it within reach of a sample).

    Returns:
        ``grid (C, G)``, ``lo (C,)``, ``delta (C,)`` (dtype of ``samples``).
    """
    c_dim, s_dim = samples.shape
    h = bandwidth
    smin, smax = torch.aminmax(samples, dim=1)
    lo, delta, n_nodes = grid_layout(
        smin, smax, h, xmin.to(samples.dtype), xmax.to(samples.dtype), points_per_bandwidth, truncate, max_points
    )
    n_grid = int(n_nodes.max().item())
    half = int(math.ceil(truncate * float((h / delta).max())))
    length = n_grid + 2 * half

    # Linear binning of the samples onto the extended grid (index e <-> lo + (e - half) * delta).
    u = (samples - lo[:, None]) / delta[:, None] + half
    i0 = torch.floor(u)
    frac = u - i0
    i0 = i0.long()
    w = 1.0 / s_dim
    keep0 = (i0 >= 0) & (i0 < length)
    keep1 = (i0 + 1 >= 0) & (i0 + 1 < length)
    binned = torch.zeros(c_dim, length, dtype=samples.dtype, device=samples.device)
    binned.scatter_add_(1, i0.clamp(0, length - 1), torch.where(keep0, (1.0 - frac) * w, torch.zeros_like(frac)))
    binned.scatter_add_(1, (i0 + 1).clamp(0, length - 1), torch.where(keep1, frac * w, torch.zeros_like(frac)))

    # Per-channel kernel phi(t * delta / h) / h on taps t = -half..half, truncated at truncate * h.
    taps = torch.arange(-half, half + 1, dtype=samples.dtype, device=samples.device)
    z = taps[None, :] * (delta / h)[:, None]
    kernel = torch.where(z.abs() <= truncate, torch.exp(-0.5 * z * z) * _INV_SQRT_2PI / h[:, None], torch.zeros_like(z))
    # grid[j] = sum_t binned[j + half + t] K(t): a linear convolution, done by FFT (no wrap-around
    # since n_fft >= length + 2 * half); O(G log G) per channel whatever the kernel width.
    n_fft = 1 << int(math.ceil(math.log2(length + 2 * half)))
    full = torch.fft.irfft(torch.fft.rfft(binned, n=n_fft) * torch.fft.rfft(kernel, n=n_fft), n=n_fft)
    grid = full[:, 2 * half : 2 * half + n_grid]  # (C, n_grid)

    return grid, lo, delta


def gaussian_kde_grid(
    x: torch.Tensor,
    samples: torch.Tensor,
    bandwidth: torch.Tensor,
    points_per_bandwidth: int = POINTS_PER_BANDWIDTH,
    truncate: float = TRUNCATE,
    max_points: int = 4096,
    return_spacing: bool = False,
):
    """Fast Gaussian KDE: linear binning + truncated-kernel convolution + linear interpolation.

    Same estimate as :func:`gaussian_kde` up to :func:`kde_grid_error_bound` (module docstring).
    Cost: ``O(C (M + S + G * K))`` with ``G <= max_points`` grid points and ``K = 2 * truncate *
    points_per_bandwidth + 1`` kernel taps, instead of ``O(C M S)``.

    Args:
        x: ``(C, M)`` query points. samples: ``(C, S)``. bandwidth: ``(C,)`` positive.
        points_per_bandwidth: grid points per bandwidth (``delta = h / points_per_bandwidth``).
        truncate: kernel support in bandwidths.
        max_points: cap on grid points per channel (the spacing grows beyond it; the error bound
            is computed from the spacing actually used).
        return_spacing: also return the ``(C,)`` spacing used (for the error bound).

    Returns:
        ``(C, M)`` densities in ``x``'s dtype (and the spacing when ``return_spacing``). Half-precision
        input (float16, bfloat16) is evaluated in float32 and the result cast back: the FFT has no
        half-precision CPU kernel, and float16's 11-bit significand would spoil the grid itself.
    """
    if x.dtype in _HALF or samples.dtype in _HALF or bandwidth.dtype in _HALF:
        out = gaussian_kde_grid(
            _widen(x), _widen(samples), _widen(bandwidth), points_per_bandwidth, truncate, max_points, return_spacing
        )
        if return_spacing:
            return out[0].to(x.dtype), out[1].to(x.dtype)
        return out.to(x.dtype)
    xmin, xmax = torch.aminmax(x, dim=1)
    grid, lo, delta = kde_grid(samples, bandwidth, xmin, xmax, points_per_bandwidth, truncate, max_points)
    n_grid = grid.shape[1]
    pos = (x - lo[:, None]) / delta[:, None]
    inside = (pos >= 0) & (pos <= n_grid - 1)
    j0 = torch.floor(pos).clamp_(0, n_grid - 2)
    t = pos - j0
    j0 = j0.long()
    d0 = torch.gather(grid, 1, j0)
    d1 = torch.gather(grid, 1, j0 + 1)
    dens = torch.where(inside, torch.lerp(d0, d1, t), torch.zeros_like(d0)).clamp_min_(0.0)
    if return_spacing:
        return dens, delta
    return dens
