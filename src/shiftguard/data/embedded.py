"""The default dataset: a class-balanced subset of real MNIST shipped inside the package.

``load("mnist-embedded", split)`` / ``load_default(split)`` work offline on a fresh machine in well
under a second: 10,000 training images (1,000 per digit) and 2,000 test images (200 per digit),
stored as gzip IDX files (the official MNIST format) in ``shiftguard/data/embedded/``.

Selection rule (``select_balanced``): for each digit, the first ``per_class`` images of that digit
in the official file order; the kept images stay in their official order. Train rows come from
the official training set, test rows from the official test set, so the two never overlap.
``embedded/manifest.json`` records the source files' sha256, the rule, the sha256 of the chosen
indices and of every shipped file; each file's sha256 is checked on every load.
``scripts/make_embedded_mnist.py`` regenerates the files from the official ones, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from shiftguard.data._files import check_split, file_error
from shiftguard.data.base import ImageDataset
from shiftguard.data.idx import MNIST_CLASSES, load_idx_pair

__all__ = ["EMBEDDED_DIR", "load_embedded", "load_default", "select_balanced", "EMBEDDED_FILES"]

EMBEDDED_DIR = Path(__file__).resolve().parent / "embedded"
MANIFEST = "manifest.json"
EMBEDDED_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
PER_CLASS = {"train": 1000, "test": 200}


def select_balanced(labels: np.ndarray, per_class: int, num_classes: int = 10) -> np.ndarray:
    """Indices of the first ``per_class`` samples of every class, in ascending (file) order."""
    labels = np.asarray(labels)
    picks = []
    for c in range(num_classes):
        idx = np.flatnonzero(labels == c)
        if len(idx) < per_class:
            raise ValueError(f"labels: class {c} has {len(idx)} samples, fewer than per_class={per_class}")
        picks.append(idx[:per_class])
    return np.sort(np.concatenate(picks))


def _read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path}: the embedded MNIST subset is missing from this installation "
            "(regenerate it with scripts/make_embedded_mnist.py)"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise file_error(path, f"corrupt manifest ({exc})") from None


def _verify(path: Path, expected_sha256: str) -> None:
    import hashlib

    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: embedded data file missing from this installation") from None
    if digest != expected_sha256:
        raise file_error(path, f"sha256 {digest} does not match the manifest's {expected_sha256} (file damaged)")


def load_embedded(split: str = "train", folder: Path | None = None) -> ImageDataset:
    """The shipped MNIST subset: ``uint8 (10000, 1, 28, 28)`` train or ``(2000, 1, 28, 28)`` test."""
    check_split("mnist-embedded", split, ("train", "test"))
    folder = Path(folder) if folder is not None else EMBEDDED_DIR
    manifest = _read_manifest(folder)
    paths = [folder / f for f in EMBEDDED_FILES[split]]
    for p in paths:
        entry = manifest.get("files", {}).get(p.name)
        if entry is None:
            raise file_error(folder / MANIFEST, f"has no entry for {p.name}")
        _verify(p, entry["sha256"])
    images, labels = load_idx_pair(paths[0], paths[1], 10)
    return ImageDataset(
        torch.from_numpy(images).unsqueeze(1),
        torch.from_numpy(labels),
        MNIST_CLASSES,
        "mnist-embedded",
        split,
        meta={"root": str(folder), "source": "MNIST (official split), class-balanced subset; see manifest.json"},
    )


def load_default(split: str = "train") -> ImageDataset:
    """The library's default real dataset: the embedded MNIST subset (offline, < 1 s)."""
    return load_embedded(split)
