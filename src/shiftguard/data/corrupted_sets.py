"""The published corrupted test sets: CIFAR-10-C, CIFAR-100-C, MNIST-C, Tiny-ImageNet-C.

Layouts (as distributed):

- ``cifar10-c`` / ``cifar100-c`` (Hendrycks & Dietterich 2019, Zenodo 2535967 / 3555552):
  ``<root>/<corruption>.npy`` = ``uint8 (50000, 32, 32, 3)``, the 10,000 test images at severity
  1, then severity 2, ..., then 5; ``<root>/labels.npy`` = the matching 50,000 labels. Severity
  ``s`` selects rows ``[(s-1)*n, s*n)`` with ``n = len / 5``.
- ``mnist-c`` (Mu & Gilmer 2019, Zenodo 3239543): ``<root>/<corruption>/{train,test}_images.npy``
  (``uint8 (N, 28, 28, 1)``) and ``{train,test}_labels.npy``. The official set has ONE severity per
  corruption, so ``severity`` must be ``None`` for it. Extensions, for corrupted copies written at
  several severities (``shiftguard corrupt``): ``severity=s`` reads
  ``<root>/severity-<s>/<corruption>/{split}_*.npy`` (what ``shiftguard corrupt`` writes) or
  ``<root>/<corruption>/<s>/{split}_*.npy``, or, where neither exists, the CIFAR-10-C-style stack
  ``<root>/<corruption>.npy`` + ``labels.npy`` (test split only).

A stacked ``<corruption>.npy`` holds severities 1..5 in order unless the folder's ``manifest.json``
(written by ``shiftguard corrupt --severities ...``) lists the severities it holds, in block order.
- ``tinyimagenet-c`` (Zenodo 2536630/8206060): ``<root>/<corruption>/<severity>/<wnid>/*.JPEG``
  (64x64 RGB, 50 validation images per class); labels are indices into the sorted wnid list
  (``<root>/wnids.txt`` if present, else the sorted class folders), as for ``tinyimagenet``.

Corruption names must be one of the official names of the set or a folder/file found on disk
(for corrupted copies with extra corruptions); anything else raises ``ValueError`` listing both.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from shiftguard.data._files import check_split, file_error, load_npy
from shiftguard.data.base import ImageDataset
from shiftguard.data.cifar import CIFAR10_CLASSES, CIFAR100_CLASSES
from shiftguard.data.download import candidate_dirs, locate
from shiftguard.data.idx import MNIST_CLASSES

__all__ = [
    "CIFAR_C_CORRUPTIONS",
    "MNIST_C_CORRUPTIONS",
    "TINYIMAGENET_C_CORRUPTIONS",
    "corruption_names",
    "load_cifar_c",
    "load_mnist_c",
    "load_tinyimagenet_c",
]

#: The 15 benchmark corruptions of Hendrycks & Dietterich (2019), then the 4 "extra" ones.
CIFAR_C_CORRUPTIONS = (
    "gaussian_noise",
    "shot_noise",
    "impulse_noise",
    "defocus_blur",
    "glass_blur",
    "motion_blur",
    "zoom_blur",
    "snow",
    "frost",
    "fog",
    "brightness",
    "contrast",
    "elastic_transform",
    "pixelate",
    "jpeg_compression",
    "speckle_noise",
    "gaussian_blur",
    "spatter",
    "saturate",
)
TINYIMAGENET_C_CORRUPTIONS = CIFAR_C_CORRUPTIONS  # the last 4 ship in Tiny-ImageNet-C-extra.tar
#: MNIST-C's 15 corruptions (Mu & Gilmer 2019, Table 1) plus the uncorrupted ``identity`` copy.
MNIST_C_CORRUPTIONS = (
    "shot_noise",
    "impulse_noise",
    "glass_blur",
    "motion_blur",
    "shear",
    "scale",
    "rotate",
    "brightness",
    "translate",
    "stripe",
    "fog",
    "spatter",
    "dotted_line",
    "zigzag",
    "canny_edges",
    "identity",
)

_OFFICIAL = {
    "cifar10-c": CIFAR_C_CORRUPTIONS,
    "cifar100-c": CIFAR_C_CORRUPTIONS,
    "mnist-c": MNIST_C_CORRUPTIONS,
    "tinyimagenet-c": TINYIMAGENET_C_CORRUPTIONS,
}


def corruption_names(name: str) -> tuple[str, ...]:
    """The official corruption names of a corrupted set (``"cifar10-c"``, ``"mnist-c"``, ...)."""
    if name not in _OFFICIAL:
        raise ValueError(f"name: expected one of {sorted(_OFFICIAL)}, got {name!r}")
    return _OFFICIAL[name]


def _on_disk(name: str, root) -> list[str]:
    found: set[str] = set()
    for d in candidate_dirs(name, root):
        if not d.is_dir():
            continue
        for p in d.iterdir():
            if p.name.startswith("."):
                continue
            if name in ("cifar10-c", "cifar100-c") or (name == "mnist-c" and p.suffix == ".npy"):
                if p.suffix == ".npy" and p.stem != "labels":
                    found.add(p.stem)
            if p.is_dir() and name in ("mnist-c", "tinyimagenet-c"):
                found.add(p.name)
    return sorted(found)


def _check_corruption(name: str, corruption, root) -> str:
    official = _OFFICIAL[name]
    if corruption is None:
        raise ValueError(f"corruption: {name} needs corruption=, one of {list(official)}")
    if not isinstance(corruption, str):
        raise TypeError(f"corruption: expected a str, got {type(corruption).__name__}")
    if corruption in official:
        return corruption
    extra = [c for c in _on_disk(name, root) if c not in official]
    if corruption in extra:
        return corruption
    msg = f"corruption: unknown {name} corruption {corruption!r}; official names: {list(official)}"
    if extra:
        msg += f"; also found on disk: {extra}"
    raise ValueError(msg)


def _check_severity(name: str, severity) -> int:
    if severity is None:
        raise ValueError(f"severity: {name} needs severity= in 1..5")
    if isinstance(severity, bool) or not isinstance(severity, (int, np.integer)):
        raise TypeError(f"severity: expected an int in 1..5, got {type(severity).__name__}")
    if not 1 <= int(severity) <= 5:
        raise ValueError(
            f"severity: expected 1..5, got {severity} (severity 0, the clean set, is load(<clean name>, 'test'))"
        )
    return int(severity)


def _labels_checked(labels: np.ndarray, path: Path, n: int, num_classes: int) -> np.ndarray:
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        if labels.ndim == 1 and np.issubdtype(labels.dtype, np.floating) and np.all(labels == np.round(labels)):
            labels = labels.astype(np.int64)
        else:
            raise file_error(path, f"expected integer labels (N,), got {labels.dtype} {labels.shape}")
    if labels.shape[0] != n:
        raise file_error(path, f"holds {labels.shape[0]} labels, expected {n} (one per image)")
    labels = np.asarray(labels, dtype=np.int64)
    if labels.size and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        bad = int(np.argmax((labels < 0) | (labels >= num_classes)))
        raise file_error(path, f"label {int(labels[bad])} at index {bad} is out of range 0..{num_classes - 1}")
    return labels


def _images_nhwc_checked(arr: np.ndarray, path: Path) -> np.ndarray:
    """``uint8 (N, H, W, C)`` (C in 1, 3) or ``(N, H, W)``; float arrays holding whole 0..255 accepted."""
    if arr.ndim == 3:
        arr = arr[..., None]
    if arr.ndim != 4 or arr.shape[-1] not in (1, 3):
        raise file_error(path, f"expected images (N, H, W, C) with C in (1, 3), got shape {arr.shape}")
    if arr.dtype != np.uint8:
        if not np.issubdtype(arr.dtype, np.floating) and not np.issubdtype(arr.dtype, np.integer):
            raise file_error(path, f"expected uint8 images, got dtype {arr.dtype}")
        a = np.asarray(arr)
        if a.size and (a.min() < 0 or a.max() > 255 or not np.all(a == np.round(a))):
            raise file_error(path, f"expected uint8 pixel values 0..255, got dtype {arr.dtype} outside that")
        arr = a.astype(np.uint8)
    return arr


def _to_dataset(images_nhwc: np.ndarray, labels: np.ndarray, classes, name, split, meta) -> ImageDataset:
    images = torch.from_numpy(np.ascontiguousarray(images_nhwc.transpose(0, 3, 1, 2)))
    return ImageDataset(images, torch.from_numpy(labels), classes, name, split, meta=meta)


def _stacked_severities(folder: Path) -> list[int]:
    """Severities stored, in block order: 1..5 (the release format), unless the folder's
    ``manifest.json`` (written by ``shiftguard corrupt``) lists a subset under ``"severities"``."""
    import json

    path = folder / "manifest.json"
    if not path.is_file():
        return [1, 2, 3, 4, 5]
    try:
        sev = json.loads(path.read_text(encoding="utf-8")).get("severities")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as exc:
        raise file_error(path, f"corrupt manifest ({exc})") from None
    if sev is None:
        return [1, 2, 3, 4, 5]
    if (
        not isinstance(sev, list)
        or not sev
        or not all(isinstance(v, int) and 1 <= v <= 5 for v in sev)
        or len(set(sev)) != len(sev)
    ):
        raise file_error(path, f"'severities' must be a list of distinct ints in 1..5, got {sev!r}")
    return sev


def _load_stacked(name: str, folder: Path, corruption: str, severity: int, classes, split: str) -> ImageDataset:
    """The CIFAR-10-C layout: ``<corruption>.npy`` with 5 severity blocks, ``labels.npy``."""
    img_path, lab_path = folder / f"{corruption}.npy", folder / "labels.npy"
    if not img_path.is_file():
        raise FileNotFoundError(f"{img_path}: file not found (corruption {corruption!r} of {name})")
    arr = load_npy(img_path, mmap=True)
    severities = _stacked_severities(folder)
    n_blocks = len(severities)
    if arr.ndim not in (3, 4) or arr.shape[0] % n_blocks:
        raise file_error(
            img_path, f"expected {n_blocks} severity blocks of images ({n_blocks}n, H, W, C), got shape {arr.shape}"
        )
    if severity not in severities:
        raise ValueError(
            f"severity: {folder} holds severities {severities} only (see its manifest.json), got {severity}"
        )
    n = arr.shape[0] // n_blocks
    block = severities.index(severity)
    rows = slice(block * n, (block + 1) * n)
    try:
        chunk = np.array(arr[rows])  # reads just this severity from the memory map
    except (OSError, ValueError) as exc:
        raise file_error(img_path, f"unreadable data ({exc})") from None
    images = _images_nhwc_checked(chunk, img_path)
    labels_all = load_npy(lab_path, mmap=False)
    if labels_all.ndim == 1 and labels_all.shape[0] == arr.shape[0]:
        labels_all = labels_all[rows]
    labels = _labels_checked(labels_all, lab_path, n, len(classes))
    meta = {"root": str(folder), "corruption": corruption, "severity": severity, "file": str(img_path)}
    return _to_dataset(images, labels, classes, name, split, meta)


def load_cifar_c(
    name: str, split: str = "test", root=None, download: bool = False, *, corruption=None, severity=None
) -> ImageDataset:
    """``cifar10-c`` / ``cifar100-c``: one corruption at one severity (10,000 test images)."""
    check_split(name, split, ("test",))
    corruption = _check_corruption(name, corruption, root)
    severity = _check_severity(name, severity)
    classes = CIFAR10_CLASSES if name == "cifar10-c" else CIFAR100_CLASSES
    folder = locate(
        name,
        root,
        lambda d: (d / "labels.npy").is_file() and (d / f"{corruption}.npy").is_file(),
        [f"{corruption}.npy", "labels.npy"],
        download,
    )
    return _load_stacked(name, folder, corruption, severity, classes, split)


def load_mnist_c(
    name: str = "mnist-c", split: str = "test", root=None, download: bool = False, *, corruption=None, severity=None
) -> ImageDataset:
    """``mnist-c``: one corruption (official: no severity; see the module docstring for extensions)."""
    check_split(name, split, ("train", "test"))
    corruption = _check_corruption(name, corruption, root)
    if severity is not None:
        severity = _check_severity(name, severity)
    files = [f"{split}_images.npy", f"{split}_labels.npy"]

    def official(d: Path) -> bool:
        return all((d / corruption / f).is_file() for f in files)

    def severity_dir(d: Path) -> Path | None:
        # ``shiftguard corrupt`` writes <root>/severity-<s>/<corruption>/; also accept <root>/<corruption>/<s>/.
        for sub in (d / f"severity-{severity}" / corruption, d / corruption / str(severity)):
            if all((sub / f).is_file() for f in files):
                return sub
        return None

    def stacked(d: Path) -> bool:
        return (d / f"{corruption}.npy").is_file() and (d / "labels.npy").is_file()

    if severity is None:
        folder = locate(name, root, official, [f"{corruption}/{f}" for f in files], download)
        sub = folder / corruption
    else:
        dirs = [d for d in candidate_dirs(name, root) if d.is_dir()]
        hit = next((d for d in dirs if severity_dir(d) is not None), None)
        if hit is None and split == "test":
            hit_stacked = next((d for d in dirs if stacked(d)), None)
            if hit_stacked is not None:
                return _load_stacked(name, hit_stacked, corruption, severity, MNIST_CLASSES, split)
        if hit is None:
            if any(official(d) for d in dirs):
                raise ValueError(
                    f"severity: the official MNIST-C has one severity per corruption; pass severity=None "
                    f"(found {corruption}/ without per-severity sub-folders)"
                )
            expected = [f"severity-{severity}/{corruption}/{f}" for f in files] + [
                f"or {corruption}/{severity}/{{{','.join(files)}}}",
                f"or {corruption}.npy + labels.npy",
            ]
            from shiftguard.data._files import missing_files_error

            raise missing_files_error(name, expected, candidate_dirs(name, root))
        folder, sub = hit, severity_dir(hit)
    img_path, lab_path = sub / files[0], sub / files[1]
    images = _images_nhwc_checked(load_npy(img_path), img_path)
    labels = _labels_checked(load_npy(lab_path), lab_path, images.shape[0], 10)
    meta = {"root": str(folder), "corruption": corruption, "severity": severity, "file": str(img_path)}
    return _to_dataset(images, labels, MNIST_CLASSES, name, split, meta)


def load_tinyimagenet_c(
    name: str = "tinyimagenet-c",
    split: str = "test",
    root=None,
    download: bool = False,
    *,
    corruption=None,
    severity=None,
) -> ImageDataset:
    """``tinyimagenet-c``: one corruption at one severity (10,000 JPEGs, 64x64 RGB)."""
    from shiftguard.data.imagefolder import decode_images, read_wnids, read_words

    check_split(name, split, ("test",))
    corruption = _check_corruption(name, corruption, root)
    severity = _check_severity(name, severity)
    folder = locate(
        name,
        root,
        lambda d: (d / corruption / str(severity)).is_dir(),
        [f"{corruption}/{severity}/<wnid>/*.JPEG"],
        download,
    )
    tree = folder / corruption / str(severity)
    present = sorted(p.name for p in tree.iterdir() if p.is_dir() and not p.name.startswith("."))
    wnids_file = next((d / "wnids.txt" for d in (folder, folder.parent) if (d / "wnids.txt").is_file()), None)
    wnids = read_wnids(wnids_file) if wnids_file is not None else present
    unknown = sorted(set(present) - set(wnids))
    if unknown:
        assert wnids_file is not None  # without a wnids.txt the classes are the folders present
        raise file_error(wnids_file, f"class folders {unknown[:5]} of {tree} are not listed")
    index = {w: k for k, w in enumerate(wnids)}
    files, labels = [], []
    for w in present:
        found = sorted(p for p in (tree / w).iterdir() if not p.name.startswith("."))
        if not found:
            raise FileNotFoundError(f"{tree / w}: class folder holds no images")
        files += found
        labels += [index[w]] * len(found)
    if not files:
        raise FileNotFoundError(f"{tree}: no class folders with images")
    images = decode_images(files, "RGB")
    words = read_words(wnids_file.parent / "words.txt") if wnids_file is not None else {}
    meta = {"root": str(folder), "corruption": corruption, "severity": severity, "wnids": wnids}
    return ImageDataset(
        images, torch.tensor(labels, dtype=torch.int64), [words.get(w, w) for w in wnids], name, split, meta=meta
    )
