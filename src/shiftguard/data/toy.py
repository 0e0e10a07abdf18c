"""The two-Gaussians failure-mode toy of [QACT, Sec. 1, eq. (1), Fig. 1].

For each *context*: ``mu_1`` uniform on the circle of radius ``radius`` ([QACT]: "the centres themselves
can lie anywhere on the unit circle", so radius 1), ``mu_2 = R(30 deg) mu_1`` (counter-clockwise
rotation), class 0 ~ N(mu_1, 0.1^2 I) and class 1 ~ N(mu_2, 0.1^2 I) -- [QACT] writes ``N(mu, 0.1 I)``
but states "stdev 0.1", which is followed here (``std=0.1``). Every point is equally likely to be
class 0 or class 1 over contexts, so no fixed function of a single point beats chance; inferring
``mu_1, mu_2`` from the batch (the context) solves it. Each batch holds ``B/2`` points per class
from one context ([QACT]: "sample B/2 points each").
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from shiftguard._validation import check_positive

__all__ = ["ToyContexts", "two_gaussians"]


class ToyContexts(NamedTuple):
    """A stack of contexts: ``x (n_contexts, B, 2)``, ``y (n_contexts, B)`` int64,
    ``mu1``, ``mu2`` ``(n_contexts, 2)``."""

    x: torch.Tensor
    y: torch.Tensor
    mu1: torch.Tensor
    mu2: torch.Tensor


def two_gaussians(
    n_contexts: int,
    batch_size: int,
    *,
    angle_deg: float = 30.0,
    std: float = 0.1,
    radius: float = 1.0,
    generator: Optional[torch.Generator] = None,
    dtype: torch.dtype = torch.float32,
) -> ToyContexts:
    """Draw ``n_contexts`` independent contexts of ``batch_size`` points [QACT, eq. (1)].

    Args:
        n_contexts: number of contexts. batch_size: points per context (even, >= 2), half per class.
        angle_deg: rotation from ``mu_1`` to ``mu_2`` ([QACT]: 30). std: per-coordinate standard
            deviation ([QACT]: 0.1). radius: circle radius ([QACT]: unit circle).
        generator: torch.Generator for reproducibility.

    Returns:
        :class:`ToyContexts`; points within a context are shuffled (classes interleaved).
    """
    check_positive(n_contexts, "n_contexts", integer=True)
    check_positive(batch_size, "batch_size", integer=True)
    if batch_size < 2 or batch_size % 2:
        raise ValueError(f"batch_size: expected an even number >= 2, got {batch_size}")
    check_positive(std, "std")
    check_positive(radius, "radius")
    theta = torch.rand(n_contexts, generator=generator, dtype=torch.float64) * (2 * math.pi)
    rot = math.radians(angle_deg)
    mu1 = radius * torch.stack([theta.cos(), theta.sin()], dim=1)
    mu2 = radius * torch.stack([(theta + rot).cos(), (theta + rot).sin()], dim=1)
    half = batch_size // 2
    y = torch.cat([torch.zeros(half, dtype=torch.long), torch.ones(half, dtype=torch.long)]).repeat(n_contexts, 1)
    perm = torch.argsort(torch.rand(n_contexts, batch_size, generator=generator), dim=1)
    y = torch.gather(y, 1, perm)
    centres = torch.where(y[..., None] == 0, mu1[:, None, :], mu2[:, None, :])
    noise = torch.randn(n_contexts, batch_size, 2, generator=generator, dtype=torch.float64) * std
    return ToyContexts((centres + noise).to(dtype), y, mu1.to(dtype), mu2.to(dtype))
