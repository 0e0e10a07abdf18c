"""Picture grids of a suite (rows = corruptions, columns = severities) and a synthetic RGB scene.

matplotlib is imported only inside :func:`gallery`, so importing the corruption engine stays
light.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from . import _ops


def synthetic_scene(n: int = 1, size: int = 32, seed: int = 0) -> torch.Tensor:
    """``n`` natural-looking RGB test images ``(n, 3, size, size)`` uint8, made procedurally.

    A sky gradient, a sun disk, rolling hills with fractal texture and a red-blue object: smooth
    regions, sharp edges, texture and saturated colour, so that every corruption has something
    to act on. Deterministic for a given ``seed``.
    """
    g = torch.Generator().manual_seed(seed)
    like = torch.empty(0)
    H = W = size
    xx, yy = _ops.pixel_grid(H, W, like)
    u, v = xx / (W - 1), yy / (H - 1)
    out = torch.empty(n, 3, H, W)
    p = _ops.next_power_of_two(size)
    texture = _ops.plasma_fractal(n, p, 2.0, g, like)[:, :H, :W]
    for i in range(n):  # test-image factory, not a hot path
        r = torch.rand(8, generator=g)
        sky = torch.stack([0.35 + 0.2 * v, 0.55 + 0.2 * v, 0.95 - 0.1 * v])
        horizon = 0.55 + 0.12 * torch.sin(2 * math.pi * (u * (1 + r[0]) + r[1])) * (0.5 + r[2])
        ground = (v > horizon).float()
        tex = texture[i]
        grass = torch.stack([0.2 + 0.3 * tex, 0.45 + 0.35 * tex, 0.15 + 0.1 * tex])
        img = sky * (1 - ground) + grass * ground
        cx, cy, rad = 0.2 + 0.6 * r[3], 0.1 + 0.25 * r[4], 0.08 + 0.06 * r[5]
        sun = (((u - cx) ** 2 + (v - cy) ** 2) < rad**2).float() * (1 - ground)
        img = img * (1 - sun) + torch.tensor([1.0, 0.9, 0.4]).view(3, 1, 1) * sun
        ox, oy = 0.3 + 0.4 * r[6], 0.6 + 0.2 * r[7]
        box = ((u - ox).abs() < 0.12) & ((v - oy).abs() < 0.1)
        stripe = (xx.long() // max(1, size // 16)) % 2 == 0
        col = torch.where(
            stripe, torch.tensor([0.85, 0.1, 0.1]).view(3, 1, 1), torch.tensor([0.1, 0.2, 0.8]).view(3, 1, 1)
        )
        img = torch.where(box, col, img)
        out[i] = img
    return (out.clamp(0, 1) * 255).round().to(torch.uint8)


def gallery(
    images: torch.Tensor,
    suite: Optional[str] = None,
    *,
    names: Optional[Sequence[str]] = None,
    index: int = 0,
    severities: Sequence[int] = (0, 1, 2, 3, 4, 5),
    seed: int = 0,
    cell: float = 1.0,
):
    """A matplotlib ``Figure``: one row per corruption of ``suite`` (or ``names``), one column per
    severity, every row showing ``images[index]`` (``(N, C, H, W)`` uint8 or float in [0, 1]).

    Without ``suite``, the rows are ``names`` resolved as :func:`shiftguard.corruptions.get` does
    (MNIST-C for one-channel images, CIFAR-10-C otherwise), or, without ``names`` either, the
    whole suite of that default."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    from .engine import corrupt
    from .engine import names as suite_names

    if not isinstance(images, torch.Tensor) or images.dim() != 4:
        raise ValueError("images: expected a tensor (N, C, H, W)")
    if not 0 <= index < images.shape[0]:
        raise ValueError(f"index: expected 0..{images.shape[0] - 1}, got {index}")
    if names is None:
        default = "mnist-c" if images.shape[1] == 1 else "cifar-c"
        rows = suite_names(suite or default)
    else:
        rows = list(names)
    one = images[index : index + 1]
    # One image of all the cells with white gaps, drawn on one axes: the same picture as a grid of
    # len(rows) x len(severities) axes at a tenth of the drawing time.
    cells = []
    for name in rows:
        for sev in severities:
            y = corrupt(one, name, sev, seed=seed, suite=suite)[0]
            cells.append((y.float() / 255 if y.dtype == torch.uint8 else y.float()).clamp(0, 1).cpu())
    c, h, w = cells[0].shape
    # RGB, white gaps, each image in a grey frame (a white image border must not merge with the gap)
    gap = max(3, h // 8)
    mosaic = torch.ones(3, len(rows) * (h + gap) + gap, len(severities) * (w + gap) + gap)
    for k, y in enumerate(cells):
        i, j = divmod(k, len(severities))
        top, left = gap + i * (h + gap), gap + j * (w + gap)
        mosaic[:, top - 1 : top + h + 1, left - 1 : left + w + 1] = 0.6
        mosaic[:, top : top + h, left : left + w] = y.expand(3, h, w) if c == 1 else y[:3]
    fig, ax = plt.subplots(figsize=(cell * len(severities) + 1.2, cell * len(rows) + 0.4))
    ax.imshow(mosaic.permute(1, 2, 0).numpy(), interpolation="nearest")
    ax.set_xticks(
        [gap + j * (w + gap) + (w - 1) / 2 for j in range(len(severities))],
        ["clean" if sev == 0 else f"severity {sev}" for sev in severities],
        fontsize=8,
    )
    ax.xaxis.tick_top()
    ax.set_yticks([gap + i * (h + gap) + (h - 1) / 2 for i in range(len(rows))], list(rows), fontsize=7)
    ax.tick_params(length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)
    title = suite or ("mnist-c" if images.shape[1] == 1 and names is None else "")
    fig.suptitle(f"{title + ': ' if title else ''}corruptions x severities (seed {seed})", fontsize=9)
    fig.tight_layout()
    return fig
