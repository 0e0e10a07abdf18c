"""Model outputs on disk, so an interrupted evaluation of a large grid resumes where it stopped."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from shiftguard.io import atomic_write

__all__ = ["OutputCache"]


class OutputCache:
    """Outputs of one (model, context) on disk: ``<root>/<key>.pt``, written atomically.

    A file that cannot be read (e.g. left by a killed process on a filesystem without atomic
    rename) is recomputed. ``enabled=False`` computes every time and writes nothing.
    """

    def __init__(self, root: str | Path, enabled: bool = True):
        self.root = Path(root)
        self.enabled = enabled
        self.hits = 0
        self.misses = 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def get_or_compute(self, key: str, fn: Callable[[], dict]) -> dict:
        p = self.path(key)
        if self.enabled and p.is_file():
            try:
                out = torch.load(p, map_location="cpu", weights_only=True)
                self.hits += 1
                return out
            except Exception:  # damaged cache file: recompute it
                pass
        out = fn()
        self.misses += 1
        if self.enabled:
            atomic_write(p, lambda fh: torch.save(out, fh))
        return out
