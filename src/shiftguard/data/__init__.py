"""Datasets: loaders for the standard image sets in their official on-disk formats, and a default.

``load(name, split, root=None, download=False, *, corruption=None, severity=None)`` returns an
:class:`ImageDataset` (``.images`` uint8 ``(N, C, H, W)``, ``.labels`` int64 ``(N,)``,
``.classes``, ``.name``, ``.split``). ``load_default(split)`` is a real, class-balanced MNIST
subset shipped inside the package (offline, < 1 s). ``make_loader`` builds a DataLoader whose
shuffle depends only on its seed. ``as_tensors(data)`` turns a user's Dataset, DataLoader or
``(images, labels)`` arrays into checked pixel tensors. ``Augment`` and ``two_views`` are seeded,
batched torch-only augmentations (crops, flips, brightness/contrast) for contrastive training.
See ``docs/data.md`` for every name, format and error. ``ClassHierarchy`` and the shipped class
hierarchies: ``docs/hierarchy.md``.
"""

from shiftguard.data import toy  # two-Gaussians failure-mode toy [QACT, Fig. 1]
from shiftguard.data.augment import (
    Augment,
    brightness_contrast_jitter,
    random_horizontal_flip,
    random_resized_crop,
    two_views,
)
from shiftguard.data.base import ImageDataset, make_loader
from shiftguard.data.convert import as_tensors
from shiftguard.data.corrupted_sets import (
    CIFAR_C_CORRUPTIONS,
    MNIST_C_CORRUPTIONS,
    TINYIMAGENET_C_CORRUPTIONS,
    corruption_names,
)
from shiftguard.data.embedded import load_default
from shiftguard.data.hierarchy import (
    ClassHierarchy,
    cifar10_hierarchy,
    cifar100_hierarchy,
    fashion_mnist_hierarchy,
)
from shiftguard.data.registry import describe, load, names

__all__ = [
    "ImageDataset",
    "make_loader",
    "as_tensors",
    "load",
    "load_default",
    "names",
    "describe",
    "corruption_names",
    "CIFAR_C_CORRUPTIONS",
    "MNIST_C_CORRUPTIONS",
    "TINYIMAGENET_C_CORRUPTIONS",
    "toy",
    "ClassHierarchy",
    "fashion_mnist_hierarchy",
    "cifar10_hierarchy",
    "cifar100_hierarchy",
    "Augment",
    "random_resized_crop",
    "random_horizontal_flip",
    "brightness_contrast_jitter",
    "two_views",
]
