"""The in-memory image dataset every loader returns, and a deterministic DataLoader factory.

Images are ``uint8`` tensors ``(N, C, H, W)`` (0 = black, 255 = white), labels ``int64 (N,)``:
the convention of ``docs/architecture.md``. Conversion to float happens at the edge of the model
(``to_float`` or a ``transform``), never inside a loader, so a corruption applied afterwards sees
the same pixels the official corrupted datasets were built from.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["ImageDataset", "make_loader"]


class ImageDataset(Dataset):
    """A labelled image set held in memory.

    Attributes:
        images: ``uint8`` tensor ``(N, C, H, W)``.
        labels: ``int64`` tensor ``(N,)`` with values in ``[0, len(classes))``.
        classes: class names; ``classes[k]`` names label ``k``.
        name: dataset name as passed to :func:`shiftguard.data.load` (e.g. ``"mnist"``).
        split: ``"train"`` or ``"test"`` (or ``"val"`` where the format has one).
        transform: optional callable applied to the ``(C, H, W)`` uint8 image in ``__getitem__``.
        meta: free-form provenance (root folder, corruption, severity, ...).

    ``dataset[i]`` returns ``(image, label)``: the image is ``images[i]`` (a ``(C, H, W)``
    uint8 tensor, or whatever ``transform`` makes of it) and the label a Python ``int``.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        classes: Sequence[str],
        name: str,
        split: str,
        transform: Optional[Callable[[torch.Tensor], object]] = None,
        meta: Optional[dict] = None,
    ) -> None:
        if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4:
            got = f"{type(images).__name__} {getattr(images, 'dtype', '')} {tuple(getattr(images, 'shape', ()))}"
            raise ValueError(f"images: expected a uint8 tensor (N, C, H, W), got {got}")
        if not isinstance(labels, torch.Tensor) or labels.dtype != torch.int64 or labels.dim() != 1:
            got = f"{type(labels).__name__} {getattr(labels, 'dtype', '')} {tuple(getattr(labels, 'shape', ()))}"
            raise ValueError(f"labels: expected an int64 tensor (N,), got {got}")
        if labels.shape[0] != images.shape[0]:
            raise ValueError(f"mismatched lengths: images={images.shape[0]}, labels={labels.shape[0]}")
        classes = [str(c) for c in classes]
        if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= len(classes)):
            raise ValueError(
                f"labels: values must lie in [0, {len(classes)}), got [{int(labels.min())}, {int(labels.max())}]"
            )
        if transform is not None and not callable(transform):
            raise TypeError(f"transform: expected a callable, got {type(transform).__name__}")
        self.images = images
        self.labels = labels
        self.classes = classes
        self.name = str(name)
        self.split = str(split)
        self.transform = transform
        self.meta = dict(meta or {})

    # -- torch Dataset protocol ---------------------------------------------------------------
    def __len__(self) -> int:
        return int(self.labels.shape[0])

    def __getitem__(self, index: int):
        image = self.images[index]
        if self.transform is not None:
            return self.transform(image), int(self.labels[index])
        return image, int(self.labels[index])

    # -- conveniences --------------------------------------------------------------------------
    @property
    def num_classes(self) -> int:
        return len(self.classes)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)``."""
        return tuple(int(s) for s in self.images.shape[1:])  # type: ignore[return-value]

    def class_counts(self) -> torch.Tensor:
        """``int64 (num_classes,)``: how many samples carry each label."""
        return torch.bincount(self.labels, minlength=self.num_classes)

    def subset(self, indices) -> "ImageDataset":
        """A new dataset with the rows ``indices`` (a sequence, tensor or boolean mask)."""
        idx = torch.as_tensor(np.asarray(indices) if not isinstance(indices, torch.Tensor) else indices)
        if idx.numel() == 0 and idx.dim() == 1:
            idx = idx.long()  # np.asarray([]) is float64
        if idx.dtype == torch.bool:
            if idx.shape != (len(self),):
                raise ValueError(f"indices: boolean mask must have shape ({len(self)},), got {tuple(idx.shape)}")
            idx = idx.nonzero().flatten()
        elif idx.is_floating_point() or idx.dim() != 1:
            raise ValueError(
                f"indices: expected a 1-D integer index or boolean mask, got {idx.dtype} {tuple(idx.shape)}"
            )
        idx = idx.long()
        if idx.numel() and (int(idx.min()) < -len(self) or int(idx.max()) >= len(self)):
            raise ValueError(f"indices: out of range for a dataset of {len(self)} samples")
        return ImageDataset(
            self.images[idx], self.labels[idx], self.classes, self.name, self.split, self.transform, self.meta
        )

    def to_float(self) -> torch.Tensor:
        """All images as ``float32 (N, C, H, W)`` in ``[0, 1]`` (pixel / 255)."""
        return self.images.to(torch.float32).div_(255.0)

    def with_transform(self, transform: Optional[Callable[[torch.Tensor], object]]) -> "ImageDataset":
        """The same data (shared, not copied) with another per-item ``transform``."""
        return ImageDataset(self.images, self.labels, self.classes, self.name, self.split, transform, self.meta)

    def __repr__(self) -> str:
        c, h, w = self.image_shape
        extra = "".join(f", {k}={self.meta[k]!r}" for k in ("corruption", "severity") if self.meta.get(k) is not None)
        return (
            f"ImageDataset(name={self.name!r}, split={self.split!r}, n={len(self)}, "
            f"shape=({c}, {h}, {w}), classes={self.num_classes}{extra})"
        )


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = False,
    seed: int = 0,
    num_workers: int = 0,
    drop_last: bool = False,
    **kwargs,
) -> DataLoader:
    """A ``DataLoader`` whose shuffling order depends only on ``seed``.

    The shuffle uses its own ``torch.Generator`` seeded with ``seed`` (not the global RNG), so two
    loaders built with the same seed yield the same batches in the same order, whatever else the
    program draws from torch's global generator. Each pass over the loader (epoch) draws a new
    permutation from that generator, so epoch ``e`` is reproducible too. Extra ``kwargs`` go to
    ``DataLoader`` (e.g. ``pin_memory``, ``collate_fn``).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise ValueError(f"batch_size: expected a positive int, got {batch_size!r}")
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
        raise ValueError(f"num_workers: expected a non-negative int, got {num_workers!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")
    generator = torch.Generator()
    generator.manual_seed(seed)
    worker_init = kwargs.pop("worker_init_fn", None)
    if num_workers > 0 and worker_init is None:
        worker_init = _seed_worker
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=bool(shuffle),
        num_workers=num_workers,
        drop_last=bool(drop_last),
        generator=generator,
        worker_init_fn=worker_init,
        **kwargs,
    )


def _seed_worker(worker_id: int) -> None:
    # DataLoader seeds torch in each worker from its generator; numpy/random must follow it so a
    # random transform written with numpy is reproducible too.
    import random

    s = torch.initial_seed() % 2**32
    np.random.seed(s)
    random.seed(s)
