"""Data shared by the tests of ``shiftguard.evaluate`` and of comparing its results."""

from __future__ import annotations

import torch


def quadrant_data(n=90, seed=0, size=16):
    """``n`` uint8 ``size x size`` images of 3 classes: class 1 brightens the top half, class 2 the
    left half, over seeded noise, so a tiny CNN learns them in a few steps. Returns
    ``(images (n, 1, size, size), labels (n,))``."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % 3
    base = torch.rand(n, 1, size, size, generator=g) * 90
    base[:, :, : size // 2] += (y == 1).view(-1, 1, 1, 1) * 120.0
    base[:, :, :, : size // 2] += (y == 2).view(-1, 1, 1, 1) * 120.0
    return base.clamp(0, 255).to(torch.uint8), y
