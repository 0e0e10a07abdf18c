"""``load(name, ...)``: one entry point for every dataset, by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from shiftguard.data.base import ImageDataset
from shiftguard.registry import Registry

__all__ = ["load", "names", "describe", "DatasetInfo", "DATASET_REGISTRY"]


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    description: str
    splits: tuple[str, ...]
    corrupted: bool  # takes corruption= (and severity=)
    options: tuple[str, ...]  # extra keyword options the loader accepts
    loader: Callable[..., ImageDataset]


def _mnist(name):
    def f(split, root, download):
        from shiftguard.data.idx import load_mnist_like

        return load_mnist_like(name, split, root, download)

    return f


def _cifar(name):
    def f(split, root, download, label_mode="fine"):
        from shiftguard.data.cifar import load_cifar

        return load_cifar(name, split, root, download, label_mode=label_mode)

    return f


def _cifar_c(name):
    def f(split, root, download, corruption, severity):
        from shiftguard.data.corrupted_sets import load_cifar_c

        return load_cifar_c(name, split, root, download, corruption=corruption, severity=severity)

    return f


def _mnist_c(split, root, download, corruption, severity):
    from shiftguard.data.corrupted_sets import load_mnist_c

    return load_mnist_c("mnist-c", split, root, download, corruption=corruption, severity=severity)


def _tiny_c(split, root, download, corruption, severity):
    from shiftguard.data.corrupted_sets import load_tinyimagenet_c

    return load_tinyimagenet_c("tinyimagenet-c", split, root, download, corruption=corruption, severity=severity)


def _tiny(split, root, download):
    from shiftguard.data.imagefolder import load_tinyimagenet

    return load_tinyimagenet(split, root, download)


def _imagefolder(split, root, download, image_size=None, mode=None):
    from shiftguard.data.imagefolder import load_imagefolder

    return load_imagefolder(split, root, image_size=image_size, mode=mode)


def _digits(split, root, download):
    from shiftguard.data.digits import load_digits_dataset

    return load_digits_dataset(split)


def _embedded(split, root, download):
    from shiftguard.data.embedded import load_embedded

    return load_embedded(split)


#: Datasets by name: ``name -> DatasetInfo``. Names are matched ignoring case, ``-`` and ``_``;
#: ``fmnist`` is an alias of ``fashion-mnist`` and ``default`` of ``mnist-embedded``.
DATASET_REGISTRY: Registry[DatasetInfo] = Registry("dataset", argument="name")
# "mnistc", "tiny-imagenet" and "tiny-imagenet-c" need no alias: they normalise to a name
_ALIASES = {"fashion-mnist": ("fmnist",), "mnist-embedded": ("default",)}
for _info in (
    DatasetInfo(
        "mnist", "MNIST, official IDX gzip files (60k/10k, 1x28x28)", ("train", "test"), False, (), _mnist("mnist")
    ),
    DatasetInfo(
        "fashion-mnist",
        "Fashion-MNIST, IDX gzip files (60k/10k, 1x28x28)",
        ("train", "test"),
        False,
        (),
        _mnist("fashion-mnist"),
    ),
    DatasetInfo(
        "mnist-embedded",
        "class-balanced real MNIST subset shipped in the package (10k/2k)",
        ("train", "test"),
        False,
        (),
        _embedded,
    ),
    DatasetInfo(
        "cifar10", "CIFAR-10 python-version pickles (50k/10k, 3x32x32)", ("train", "test"), False, (), _cifar("cifar10")
    ),
    DatasetInfo(
        "cifar100",
        "CIFAR-100 python-version pickles (50k/10k, 3x32x32)",
        ("train", "test"),
        False,
        ("label_mode",),
        _cifar("cifar100"),
    ),
    DatasetInfo(
        "cifar10-c",
        "CIFAR-10-C .npy arrays (10k per corruption x severity)",
        ("test",),
        True,
        (),
        _cifar_c("cifar10-c"),
    ),
    DatasetInfo(
        "cifar100-c",
        "CIFAR-100-C .npy arrays (10k per corruption x severity)",
        ("test",),
        True,
        (),
        _cifar_c("cifar100-c"),
    ),
    DatasetInfo(
        "mnist-c", "MNIST-C .npy arrays per corruption (60k/10k, one severity)", ("train", "test"), True, (), _mnist_c
    ),
    DatasetInfo(
        "tinyimagenet",
        "Tiny-ImageNet-200 JPEG tree (100k train / 10k val as test, 3x64x64)",
        ("train", "test"),
        False,
        (),
        _tiny,
    ),
    DatasetInfo(
        "tinyimagenet-c", "Tiny-ImageNet-C JPEG tree (10k per corruption x severity)", ("test",), True, (), _tiny_c
    ),
    DatasetInfo(
        "imagefolder",
        "any <class>/<image> tree decoded with Pillow",
        ("train", "val", "test"),
        False,
        ("image_size", "mode"),
        _imagefolder,
    ),
    DatasetInfo(
        "digits",
        "scikit-learn's bundled 8x8 digits (1442/355, deterministic split)",
        ("train", "test"),
        False,
        (),
        _digits,
    ),
):
    DATASET_REGISTRY.register(_info.name, _info, aliases=_ALIASES.get(_info.name, ()))
del _info


def names() -> list[str]:
    """All dataset names ``load`` accepts, in the order of the table above (not sorted)."""
    return list(DATASET_REGISTRY)


def describe() -> dict[str, str]:
    """``name -> one-line description``."""
    return {k: v.description for k, v in DATASET_REGISTRY.items()}


def load(
    name: str,
    split: str = "train",
    root=None,
    download: bool = False,
    *,
    corruption: str | None = None,
    severity: int | None = None,
    **options,
) -> ImageDataset:
    """Load dataset ``name`` / ``split`` as an :class:`ImageDataset` (uint8 ``(N, C, H, W)``, int64 labels).

    Args:
        name: one of :func:`names` (``"mnist"``, ``"fashion-mnist"``, ``"cifar10"``, ``"cifar100"``,
            ``"cifar10-c"``, ``"cifar100-c"``, ``"mnist-c"``, ``"tinyimagenet"``, ``"tinyimagenet-c"``,
            ``"imagefolder"``, ``"digits"``, ``"mnist-embedded"``). Case and ``_``/``-`` are ignored.
        split: ``"train"`` or ``"test"`` (the corrupted CIFAR / Tiny-ImageNet sets have only ``"test"``).
        root: folder holding the files; default ``$SHIFTGUARD_DATA/<name>`` or
            ``~/.cache/shiftguard/<name>`` (see :mod:`shiftguard.data.download`).
        download: fetch the official files (checksum-verified) when they are not found.
        corruption, severity: for the corrupted sets only; severity in 1..5
            (``mnist-c``: ``None``, the official set has one severity).
        **options: format options: ``label_mode="fine"|"coarse"`` (cifar100),
            ``image_size=``, ``mode="L"|"RGB"`` (imagefolder).

    Raises ``ValueError`` (unknown name / split / corruption / severity, corrupt file: the message
    names the file) or ``FileNotFoundError`` (files absent: the message lists the files expected
    and every folder searched).
    """
    info = DATASET_REGISTRY.get(name)
    if not isinstance(split, str):
        raise TypeError(f"split: expected a str, got {type(split).__name__}")
    if not isinstance(download, bool):
        raise TypeError(f"download: expected a bool, got {type(download).__name__}")
    unknown = sorted(set(options) - set(info.options))
    if unknown:
        allowed = f"it accepts {list(info.options)}" if info.options else "it takes no extra options"
        raise TypeError(f"{info.name}: unexpected option(s) {unknown}; {allowed}")
    if info.corrupted:
        return info.loader(split, root, download, corruption=corruption, severity=severity, **options)
    if corruption is not None or severity is not None:
        corrupted = [n for n, i in DATASET_REGISTRY.items() if i.corrupted]
        raise ValueError(
            f"corruption/severity: {info.name} is a clean dataset; use one of {corrupted}, "
            "or shiftguard.corruptions.corrupt(images, name, severity) to corrupt it on the fly"
        )
    return info.loader(split, root, download, **options)
