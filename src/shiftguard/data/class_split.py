"""Class-split data of the transfer benchmark [Kirchhof, URL Sec. 3.2]: train on UPSTREAM classes,
evaluate on DOWNSTREAM classes never seen in training.

A class is a ``(dataset, label)`` pair: label 3 of MNIST and label 3 of Fashion-MNIST differ.
:func:`check_class_split` refuses a downstream class that is also upstream; :func:`make_transfer_data`
keeps each side's images, re-indexes the labels of each side from 0 and checks every kept image against
its side's class list (after sub-sampling); :func:`load_split` builds one of the presets :data:`SPLITS`
from ``shiftguard.data.load``. ``shiftguard transfer`` (``shiftguard.commands.transfer``) runs the
benchmark on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from shiftguard._validation import check_labels, check_positive, check_same_length, check_tensor
from shiftguard.data.registry import load

__all__ = ["SPLITS", "SplitSpec", "TransferData", "check_class_split", "make_transfer_data", "load_split"]


@dataclass(frozen=True)
class SplitSpec:
    """One upstream -> downstream pair: dataset names (``shiftguard.data.load``) and label lists."""

    upstream: str
    upstream_labels: tuple[int, ...]
    downstream: str
    downstream_labels: tuple[int, ...]
    description: str


#: The three presets of the benchmark.
SPLITS: dict[str, SplitSpec] = {
    "mnist-0to4-5to9": SplitSpec(
        "mnist", (0, 1, 2, 3, 4), "mnist", (5, 6, 7, 8, 9), "MNIST digits 0-4 -> digits 5-9 (new classes, same domain)"
    ),
    "mnist-to-fashion": SplitSpec(
        "mnist", tuple(range(10)), "fashion-mnist", tuple(range(10)), "MNIST -> Fashion-MNIST (new domain)"
    ),
    "fashion-5-5": SplitSpec(
        "fashion-mnist", (0, 1, 2, 3, 4), "fashion-mnist", (5, 6, 7, 8, 9), "Fashion-MNIST classes 0-4 -> classes 5-9"
    ),
}


def check_class_split(
    upstream_classes: Sequence[tuple[str, int]], downstream_classes: Sequence[tuple[str, int]]
) -> None:
    """Raise ``ValueError`` naming ``downstream_classes`` if a downstream class is also upstream.

    Classes are ``(dataset, label)`` pairs: label 3 of MNIST and label 3 of Fashion-MNIST differ.
    Also raises if either side is empty or lists a class twice.
    """
    up, down = list(upstream_classes), list(downstream_classes)
    for name, side in (("upstream_classes", up), ("downstream_classes", down)):
        if not side:
            raise ValueError(f"{name}: expected at least one class")
        if len(set(side)) != len(side):
            raise ValueError(f"{name}: lists a class twice: {side}")
    leaked = sorted(set(up) & set(down))
    if leaked:
        raise ValueError(
            f"downstream_classes: {leaked} are also upstream classes; the transfer protocol "
            f"evaluates on classes never seen in training [Kirchhof, URL Sec. 3.2]"
        )


@dataclass
class TransferData:
    """The tensors of one split. Images are float ``(N, C, H, W)`` in ``[0, 1]``; labels int64 ``(N,)``,
    re-indexed ``0..K-1`` per side (``upstream_classes[k]`` / ``downstream_classes[k]`` name label
    ``k``); ``source_labels_*`` keep the datasets' own labels, for the leak checks."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    up_test_x: torch.Tensor
    up_test_y: torch.Tensor
    down_x: torch.Tensor
    down_y: torch.Tensor
    upstream_classes: tuple[tuple[str, int], ...]
    downstream_classes: tuple[tuple[str, int], ...]
    source_labels_train: torch.Tensor
    source_labels_up_test: torch.Tensor
    source_labels_down: torch.Tensor

    @property
    def num_upstream_classes(self) -> int:
        return len(self.upstream_classes)


def _select(images: torch.Tensor, labels: torch.Tensor, keep: Sequence[int], name: str):
    keep_t = torch.tensor(list(keep), dtype=torch.int64)
    mask = torch.isin(labels, keep_t)
    if not bool(mask.any()):
        raise ValueError(f"{name}: no image has one of the labels {list(keep)}")
    remap = torch.full((int(max(int(labels.max()), max(keep))) + 1,), -1, dtype=torch.int64)
    remap[keep_t] = torch.arange(len(keep_t))
    src = labels[mask]
    return images[mask], remap[src], src


def _as_float_images(images, name: str) -> torch.Tensor:
    t = check_tensor(images, name, ndim=4, nonempty=True)
    if t.dtype == torch.uint8:
        return t.float() / 255.0
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected uint8 or float images (N, C, H, W), got {t.dtype}")
    return t.float()


def make_transfer_data(
    upstream_train,
    upstream_test,
    downstream_test,
    upstream_classes: Sequence[tuple[str, int]],
    downstream_classes: Sequence[tuple[str, int]],
    train_subset: Optional[int] = None,
    data_seed: int = 0,
) -> TransferData:
    """Build a split from ``(images, labels)`` pairs (or anything with ``.images`` / ``.labels``).

    Args:
        upstream_train, upstream_test, downstream_test: images ``(N, C, H, W)`` uint8 (divided by 255)
            or float, labels ``(N,)`` int: the datasets' own labels.
        upstream_classes, downstream_classes: ``(dataset, label)`` pairs; only images of these labels
            are kept on each side; the labels of the two sides must be disjoint classes
            (:func:`check_class_split`).
        train_subset: keep this many upstream training images (a uniformly random subset drawn with
            ``data_seed``); ``None`` keeps all.
        data_seed: seed of the subset; the same images for every method and run seed.

    Raises ``ValueError`` for a class leak, a side without images, a ``train_subset`` larger than the
    training images, or a kept image whose label is not a class of its side.
    """
    check_class_split(upstream_classes, downstream_classes)
    up_labels = [c[1] for c in upstream_classes]
    down_labels = [c[1] for c in downstream_classes]
    parts = []
    for name, pair in (
        ("upstream_train", upstream_train),
        ("upstream_test", upstream_test),
        ("downstream_test", downstream_test),
    ):
        images, labels = (pair.images, pair.labels) if hasattr(pair, "images") else pair
        x = _as_float_images(images, name)
        y = check_labels(labels, f"{name} labels")
        check_same_length([(f"{name} images", x), (f"{name} labels", y)])
        parts.append((x, y))
    tx, ty, tsrc = _select(*parts[0], up_labels, "upstream_train")
    ux, uy, usrc = _select(*parts[1], up_labels, "upstream_test")
    dx, dy, dsrc = _select(*parts[2], down_labels, "downstream_test")
    if train_subset is not None:
        check_positive(train_subset, "train_subset", integer=True)
        if train_subset > tx.shape[0]:
            raise ValueError(f"train_subset: {train_subset} exceeds the {tx.shape[0]} upstream training images")
        idx = torch.randperm(tx.shape[0], generator=torch.Generator().manual_seed(data_seed))[:train_subset]
        idx = idx.sort().values
        tx, ty, tsrc = tx[idx], ty[idx], tsrc[idx]
    data = TransferData(tx, ty, ux, uy, dx, dy, tuple(upstream_classes), tuple(downstream_classes), tsrc, usrc, dsrc)
    _check_no_leak(data)
    return data


def _check_no_leak(data: TransferData) -> None:
    up = {c[1] for c in data.upstream_classes}
    down = {c[1] for c in data.downstream_classes}
    for name, src, allowed in (
        ("upstream_train", data.source_labels_train, up),
        ("upstream_test", data.source_labels_up_test, up),
        ("downstream_test", data.source_labels_down, down),
    ):
        bad = set(src.unique().tolist()) - allowed
        if bad:
            raise ValueError(f"{name}: holds labels {sorted(bad)} outside its classes {sorted(allowed)}")


def load_split(
    name: str, root: Optional[str] = None, train_subset: Optional[int] = 6000, data_seed: int = 0
) -> TransferData:
    """Load one of :data:`SPLITS` with ``shiftguard.data.load`` (``root`` as there; e.g. the folder that
    holds ``mnist/`` and ``fashion-mnist/``). Raises ``ValueError`` for an unknown ``name`` and the
    loader's ``FileNotFoundError`` (it names the folders searched) for missing files."""
    if name not in SPLITS:
        raise ValueError(f"name: unknown split {name!r}; expected one of {', '.join(SPLITS)}")
    spec = SPLITS[name]
    up_train = load(spec.upstream, "train", root)
    up_test = load(spec.upstream, "test", root)
    down_test = load(spec.downstream, "test", root)
    return make_transfer_data(
        up_train,
        up_test,
        down_test,
        [(spec.upstream, k) for k in spec.upstream_labels],
        [(spec.downstream, k) for k in spec.downstream_labels],
        train_subset=train_subset,
        data_seed=data_seed,
    )
