"""What a corruption is, for the registries of the suites.

A corruption is a function ``fn(x, params, generator, scale) -> tensor`` on a float batch
``(N, C, H, W)`` in [0, 1] (the output may leave [0, 1]; :func:`shiftguard.corruptions.corrupt`
clips it; the function may overwrite ``x``, which is always a private working copy there),
plus the parameters of its five severities, the image size they were published
for, and where they come from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

CorruptionFn = Callable[[torch.Tensor, Any, torch.Generator, float], torch.Tensor]


@dataclass(frozen=True)
class CorruptionSpec:
    """One corruption of one suite.

    name: registry name (CIFAR-10-C file name / MNIST-C folder name).
    suite: ``"mnist-c"``, ``"cifar-c"`` or ``"cifar-c-extra"``.
    fn: the batched implementation.
    params: five parameter settings, severity 1..5.
    ref_size: the image side the constants were published for (28 or 32); spatial constants
        are scaled by ``min(H, W) / ref_size``.
    source: where the constants come from.
    u8: optional fast path for ``uint8`` images: ``u8(images, params, generator, scale)`` takes
        the (unmodified) uint8 batch and returns the uint8 result directly, with the same law as
        ``fn`` followed by clipping and rounding to 8 bit (see :mod:`._levels`).
    """

    name: str
    suite: str
    fn: CorruptionFn
    params: tuple
    ref_size: int
    source: str
    u8: Optional[CorruptionFn] = None

    def __call__(self, x: torch.Tensor, severity: int, generator: torch.Generator) -> torch.Tensor:
        scale = min(x.shape[-2:]) / self.ref_size
        return self.fn(x, self.params[severity - 1], generator, scale)
