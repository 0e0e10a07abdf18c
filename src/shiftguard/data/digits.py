"""scikit-learn's bundled 8x8 handwritten digits (UCI "optdigits" test part, 1,797 images).

Pixels are counts 0..16 (number of "on" pixels in a 4x4 block of the original 32x32 bitmap);
they are scaled to ``uint8`` by ``round(v * 255 / 16)``, so 0 -> 0 and 16 -> 255.

Split (deterministic, independent of any RNG or library version): within each class, in the
order of ``load_digits()``, every fifth image (positions 4, 9, 14, ... of that class) is test,
the rest train. That gives 1,442 train / 355 test images (each class in both).
"""

from __future__ import annotations

import numpy as np
import torch

from shiftguard.data._files import check_split
from shiftguard.data.base import ImageDataset

__all__ = ["load_digits_dataset", "digits_split_mask"]


def digits_split_mask(target: np.ndarray) -> np.ndarray:
    """Boolean mask, True for test rows: the 5th, 10th, ... occurrence of each class."""
    target = np.asarray(target)
    rank = np.empty(len(target), dtype=np.int64)
    for c in np.unique(target):
        idx = np.flatnonzero(target == c)
        rank[idx] = np.arange(len(idx))
    return rank % 5 == 4


def load_digits_dataset(split: str = "train") -> ImageDataset:
    from sklearn.datasets import load_digits

    check_split("digits", split, ("train", "test"))
    bunch = load_digits()
    pixels = np.asarray(bunch.images, dtype=np.float64)  # (1797, 8, 8) in 0..16
    target = np.asarray(bunch.target, dtype=np.int64)
    test = digits_split_mask(target)
    keep = test if split == "test" else ~test
    images = np.rint(pixels[keep] * (255.0 / 16.0)).astype(np.uint8)[:, None]
    return ImageDataset(
        torch.from_numpy(np.ascontiguousarray(images)),
        torch.from_numpy(target[keep].copy()),
        [str(d) for d in range(10)],
        "digits",
        split,
        meta={"source": "sklearn.datasets.load_digits"},
    )
