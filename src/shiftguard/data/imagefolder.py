"""Image trees decoded with Pillow: generic class-per-folder trees and Tiny-ImageNet-200.

``imagefolder``: ``<root>/<class>/**/<image>`` (classes = sub-folder names, sorted; label = index
in that order, as ``torchvision.datasets.ImageFolder``). If ``<root>/<split>/`` exists the tree is
taken from there, so a ``root`` holding ``train/`` and ``test/`` trees works with ``split=``.

``tinyimagenet`` (Tiny-ImageNet-200, cs231n): ``wnids.txt`` (200 WordNet ids), ``words.txt``
(``wnid<TAB>names``), ``train/<wnid>/images/<wnid>_<i>.JPEG`` (500 per class) and
``val/images/val_<i>.JPEG`` labelled by ``val/val_annotations.txt``
(``file<TAB>wnid<TAB>x0<TAB>y0<TAB>x1<TAB>y1``). The official ``test/`` folder has no labels, so
``split="test"`` means the labelled validation set (``"val"`` is accepted as the same).
Labels are indices into the *sorted* wnid list, the convention Tiny-ImageNet-C loaders share.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from shiftguard.data._files import check_split, file_error, text_lines
from shiftguard.data.base import ImageDataset
from shiftguard.data.download import base_dir, locate

__all__ = ["IMAGE_EXTENSIONS", "decode_images", "scan_class_tree", "load_imagefolder", "load_tinyimagenet"]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".pbm")
_GRAY_MODES = {"1", "L", "I", "I;16", "F"}


def _parse_size(image_size) -> Optional[tuple[int, int]]:
    if image_size is None:
        return None
    size: tuple[int, ...]
    if isinstance(image_size, int) and not isinstance(image_size, bool):
        size = (image_size, image_size)
    else:
        try:
            size = tuple(int(s) for s in image_size)
        except TypeError:
            raise TypeError(f"image_size: expected an int or (height, width), got {image_size!r}") from None
    if len(size) != 2 or min(size) <= 0:
        raise ValueError(f"image_size: expected a positive int or (height, width), got {image_size!r}")
    return size  # (H, W)


def _to_mode(img, mode: str, size: Optional[tuple[int, int]]):
    from PIL import Image

    if img.mode in ("I;16", "I", "F") and mode == "L":
        # 16-bit / float grayscale: scale the full range to 0..255 rather than clipping.
        arr = np.asarray(img, dtype=np.float64)
        hi = 65535.0 if img.mode == "I;16" else max(float(arr.max()), 1.0)
        img = Image.fromarray(np.clip(arr / hi * 255.0 + 0.5, 0, 255).astype(np.uint8))
    img = img.convert(mode)
    if size is not None and img.size != (size[1], size[0]):
        # Pillow exports its resampling constants at run time (Image.Resampling from 9.1 on only)
        img = img.resize((size[1], size[0]), Image.BILINEAR)  # type: ignore[attr-defined]
    return img


def _decode_one(path: Path, mode: str, size: Optional[tuple[int, int]]) -> np.ndarray:
    """``uint8 (H, W)`` or ``(H, W, 3)``; errors name the file."""
    from PIL import Image

    try:
        with Image.open(path) as opened:
            opened.load()  # decode now: truncated data fails here, naming the file
            return np.asarray(_to_mode(opened, mode, size), dtype=np.uint8)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise file_error(path, f"unreadable image ({type(exc).__name__}: {exc})") from None


def decode_images(files: Sequence[Path], mode: Optional[str] = None, image_size=None) -> torch.Tensor:
    """Decode ``files`` into one ``uint8 (N, C, H, W)`` tensor.

    ``mode``: ``"L"`` (1 channel) or ``"RGB"`` (3 channels); ``None`` picks ``"L"`` when every file
    is grayscale, else ``"RGB"``. ``image_size``: ``(H, W)`` or an int to resize to (bilinear,
    antialiased); without it all images must share one size. An unreadable or truncated image
    raises ``ValueError`` naming the file.
    """
    from PIL import Image

    if mode not in (None, "L", "RGB"):
        raise ValueError(f"mode: expected None, 'L' or 'RGB', got {mode!r}")
    size = _parse_size(image_size)
    files = [Path(f) for f in files]
    if not files:
        raise ValueError("no image files to decode")

    if mode is None:
        mode = "L"
        for f in files:  # Image.open reads only the header: cheap
            try:
                with Image.open(f) as im:
                    if im.mode not in _GRAY_MODES:
                        mode = "RGB"
                        break
            except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
                raise file_error(f, f"unreadable image ({type(exc).__name__}: {exc})") from None
    channels = 1 if mode == "L" else 3
    first = _decode_one(files[0], mode, size)
    h, w = first.shape[:2]
    out = np.empty((len(files), channels, h, w), dtype=np.uint8)

    def put(i: int, arr: np.ndarray) -> None:
        if arr.shape[:2] != (h, w):
            raise file_error(
                files[i],
                f"image size {arr.shape[1]}x{arr.shape[0]} differs from {w}x{h} of {files[0].name}; "
                "pass image_size= to resize",
            )
        out[i] = arr[None] if channels == 1 else arr.transpose(2, 0, 1)

    put(0, first)
    rest = files[1:]
    workers = min(8, os.cpu_count() or 1) if len(rest) >= 512 else 1
    if workers > 1:
        # Pillow releases the GIL while decoding; map() yields in file order, so the output and
        # the first error reported do not depend on thread timing.
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(workers)
        try:
            for i, arr in enumerate(pool.map(lambda f: _decode_one(f, mode, size), rest), 1):
                put(i, arr)
        finally:  # on an error, drop the queued work instead of decoding the rest first
            pool.shutdown(wait=True, cancel_futures=True)
    else:
        for i, f in enumerate(rest, 1):
            put(i, _decode_one(f, mode, size))
    return torch.from_numpy(out)


def _is_hidden(p: Path) -> bool:
    return p.name.startswith(".")


def scan_class_tree(folder: Path) -> tuple[list[Path], list[int], list[str]]:
    """Files, labels and sorted class names of a class-per-folder tree.

    Hidden entries (``.name``) are ignored; any other non-image file is an error naming it
    (nothing is skipped silently); an empty class folder is an error.
    """
    folder = Path(folder)
    classes = sorted(p.name for p in folder.iterdir() if p.is_dir() and not _is_hidden(p))
    if not classes:
        raise FileNotFoundError(f"{folder}: no class sub-folders found (expected <class>/<image files>)")
    files: list[Path] = []
    labels: list[int] = []
    for k, cls in enumerate(classes):
        found = []
        for dirpath, dirnames, filenames in os.walk(folder / cls, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for fn in sorted(filenames):
                if fn.startswith("."):
                    continue
                p = Path(dirpath) / fn
                if p.suffix.lower() not in IMAGE_EXTENSIONS:
                    raise file_error(
                        p, f"not an image file (extensions {', '.join(IMAGE_EXTENSIONS)}); remove it or hide it"
                    )
                found.append(p)
        if not found:
            raise FileNotFoundError(f"{folder / cls}: class folder holds no images")
        files += found
        labels += [k] * len(found)
    return files, labels, classes


def load_imagefolder(split: str = "train", root=None, image_size=None, mode: Optional[str] = None) -> ImageDataset:
    """Any ``<class>/<images>`` tree (see the module docstring for ``split``)."""
    if root is None:
        raise ValueError("root: 'imagefolder' needs root= pointing at a <class>/<image> tree")
    base = base_dir("imagefolder", root)
    if not base.is_dir():
        raise FileNotFoundError(f"{base}: folder not found")
    split_dirs = [s for s in ("train", "val", "test") if (base / s).is_dir()]
    if (base / split).is_dir():
        tree = base / split
    elif split_dirs:
        raise ValueError(f"split: {base} has split folders {split_dirs}, no {split!r}")
    else:
        tree = base
    files, labels, classes = scan_class_tree(tree)
    images = decode_images(files, mode, image_size)
    return ImageDataset(
        images,
        torch.tensor(labels, dtype=torch.int64),
        classes,
        "imagefolder",
        split,
        meta={"root": str(tree), "files": [str(f) for f in files]},
    )


# -- Tiny-ImageNet-200 ----------------------------------------------------------------------------


def read_wnids(path: Path) -> list[str]:
    wnids = [line.strip() for _, line in text_lines(path)]
    if len(set(wnids)) != len(wnids):
        raise file_error(path, "holds duplicate wnids")
    return sorted(wnids)


def read_words(path: Path) -> dict[str, str]:
    """``wnid -> first name`` from a ``words.txt`` (``wnid<TAB>name, synonym, ...``)."""
    out: dict[str, str] = {}
    if not path.is_file():
        return out
    for i, line in text_lines(path):
        parts = line.split("\t", 1)
        if len(parts) != 2:
            raise file_error(path, f"line {i}: expected 'wnid<TAB>names', got {line!r}")
        out[parts[0].strip()] = parts[1].split(",")[0].strip()
    return out


def _tiny_files(folder: Path, split: str, wnids: list[str]) -> tuple[list[Path], list[int]]:
    index = {w: k for k, w in enumerate(wnids)}
    files: list[Path] = []
    labels: list[int] = []
    if split == "train":
        for w in wnids:
            d = folder / "train" / w / "images"
            if not d.is_dir():
                raise FileNotFoundError(f"{d}: missing training images of class {w} (listed in wnids.txt)")
            found = sorted(p for p in d.iterdir() if not _is_hidden(p))
            for p in found:
                if p.suffix.lower() not in IMAGE_EXTENSIONS:
                    raise file_error(p, "not an image file")
            if not found:
                raise FileNotFoundError(f"{d}: no images")
            files += found
            labels += [index[w]] * len(found)
        return files, labels
    ann = folder / "val" / "val_annotations.txt"
    for i, line in text_lines(ann):
        parts = line.split("\t")
        if len(parts) < 2:
            raise file_error(ann, f"line {i}: expected 'file<TAB>wnid<TAB>box', got {line!r}")
        fname, wnid = parts[0].strip(), parts[1].strip()
        if wnid not in index:
            raise file_error(ann, f"line {i}: wnid {wnid!r} is not in wnids.txt")
        p = folder / "val" / "images" / fname
        if not p.is_file():
            raise FileNotFoundError(f"{p}: listed in {ann} (line {i}) but missing")
        files.append(p)
        labels.append(index[wnid])
    if not files:
        raise file_error(ann, "lists no images")
    return files, labels


def load_tinyimagenet(split: str = "train", root=None, download: bool = False) -> ImageDataset:
    """Tiny-ImageNet-200 as ``uint8 (N, 3, 64, 64)`` (100,000 train / 10,000 val images, ~1.2 GB for train)."""
    split = "test" if split == "val" else split
    check_split("tinyimagenet", split, ("train", "test"))
    needed = ["wnids.txt", "train/" if split == "train" else "val/val_annotations.txt"]

    def complete(d: Path) -> bool:
        return (d / "wnids.txt").is_file() and (
            (d / "train").is_dir() if split == "train" else (d / "val" / "val_annotations.txt").is_file()
        )

    folder = locate("tinyimagenet", root, complete, needed, download)
    wnids = read_wnids(folder / "wnids.txt")
    words = read_words(folder / "words.txt")
    files, labels = _tiny_files(folder, split, wnids)
    images = decode_images(files, "RGB")
    return ImageDataset(
        images,
        torch.tensor(labels, dtype=torch.int64),
        [words.get(w, w) for w in wnids],
        "tinyimagenet",
        split,
        meta={"root": str(folder), "wnids": wnids},
    )
