"""MNIST and Fashion-MNIST in the official IDX format (gzip-compressed or raw).

IDX layout (LeCun et al., http://yann.lecun.com/exdb/mnist/): two zero bytes, one type byte
(0x08 = uint8, 0x09 = int8, 0x0B = int16, 0x0C = int32, 0x0D = float32, 0x0E = float64), one byte
with the number of dimensions, then one big-endian uint32 per dimension, then the values,
big-endian, row-major. Images are magic ``0x00000803`` (uint8, 3 dims ``N, H, W``), labels
``0x00000801`` (uint8, 1 dim ``N``).

Files: ``train-images-idx3-ubyte[.gz]``, ``train-labels-idx1-ubyte[.gz]``,
``t10k-images-idx3-ubyte[.gz]``, ``t10k-labels-idx1-ubyte[.gz]``.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from shiftguard.data._files import (
    CHUNK_BYTES,
    DEFLATE_MAX_RATIO,
    GZIP_ERRORS,
    MAX_READ_BYTES,
    check_split,
    file_error,
    gzip_error,
    open_stream,
)
from shiftguard.data.base import ImageDataset
from shiftguard.data.download import locate

__all__ = [
    "read_idx",
    "parse_idx",
    "write_idx",
    "load_idx_pair",
    "load_mnist_like",
    "MAX_IDX_BYTES",
    "MNIST_CLASSES",
    "FASHION_MNIST_CLASSES",
]

MNIST_CLASSES = [str(d) for d in range(10)]
FASHION_MNIST_CLASSES = [
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
]

_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
_CODE_OF = {
    np.dtype(np.uint8): 0x08,
    np.dtype(np.int8): 0x09,
    np.dtype(np.int16): 0x0B,
    np.dtype(np.int32): 0x0C,
    np.dtype(np.float32): 0x0D,
    np.dtype(np.float64): 0x0E,
}

_SPLIT_PREFIX = {"train": "train", "test": "t10k"}


#: Largest payload an IDX header may declare unless ``max_bytes=`` says otherwise (2 GiB). The
#: largest published IDX sets are far below it (EMNIST ByClass training images: 547 MB).
MAX_IDX_BYTES = MAX_READ_BYTES


def _read_idx_stream(
    fh, path, expect_magic: Optional[int], size: Optional[int], max_bytes: int, gzip_size: Optional[int] = None
) -> np.ndarray:
    """Decode one IDX stream, reading exactly the bytes its header declares plus one (the check for
    trailing data). ``size`` is the stream's exact length when known (raw files); ``gzip_size`` the
    compressed file's size when the stream is gunzipped on the fly.

    Peak memory is the declared payload (read into its final array, byte-swapped in place) plus one
    chunk; a stream holding more than its header declares is refused without reading the rest.
    """
    head = fh.read(4)
    if len(head) < 4:
        raise file_error(path, f"too short for an IDX header ({len(head)} bytes)")
    magic = int.from_bytes(head, "big")
    if expect_magic is not None and magic != expect_magic:
        raise file_error(path, f"wrong IDX magic number 0x{magic:08X}, expected 0x{expect_magic:08X}")
    if head[0] != 0 or head[1] != 0 or head[2] not in _IDX_DTYPES:
        raise file_error(path, f"not an IDX file (magic 0x{magic:08X})")
    head += fh.read(4 * head[3])
    if len(head) < 4 + 4 * head[3]:
        raise file_error(path, f"truncated IDX header ({len(head)} bytes, need {4 + 4 * head[3]})")
    dims = tuple(int.from_bytes(head[4 + 4 * i : 8 + 4 * i], "big") for i in range(head[3]))
    dtype = np.dtype(_IDX_DTYPES[head[2]])
    nbytes = math.prod(dims) * dtype.itemsize  # Python ints: no overflow
    expected = len(head) + nbytes
    what = f"header declares shape {dims} ({expected} bytes in all)"
    if nbytes > max_bytes:
        raise file_error(path, f"{what}: more than max_bytes={max_bytes} (pass a larger max_bytes= to read it)")
    if gzip_size is not None and expected > DEFLATE_MAX_RATIO * gzip_size:
        raise file_error(
            path,
            f"truncated: {what}, more than a gzip file of {gzip_size} bytes can hold "
            f"(deflate expands at most {DEFLATE_MAX_RATIO}:1)",
        )
    if size is not None and size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise file_error(path, f"{kind}: {what}, file holds {size} bytes")
    arr = np.empty(dims, dtype=dtype)
    # an ndarray has the buffer protocol; numpy's stubs declare it for Python >= 3.12 only
    view = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    got = 0
    while got < nbytes:
        n = fh.readinto(view[got : got + CHUNK_BYTES])
        if not n:
            raise file_error(path, f"truncated: {what}, file holds {len(head) + got} bytes")
        got += n
    if fh.read(1):
        raise file_error(path, f"has trailing bytes: {what}, file holds more")
    if not dtype.isnative:  # big-endian on disk: swap in place, then read the same bytes as native
        arr = arr.byteswap(inplace=True).view(dtype.newbyteorder("="))
    return arr


def parse_idx(
    data: bytes, path: Path | str = "<bytes>", expect_magic: Optional[int] = None, *, max_bytes: int = MAX_IDX_BYTES
) -> np.ndarray:
    """Decode IDX bytes into a writable array (native byte order); errors name ``path``.

    Raises ``ValueError`` for a wrong magic number, a truncated header or payload, trailing bytes,
    or a declared payload larger than ``max_bytes``.
    """
    return _read_idx_stream(io.BytesIO(data), path, expect_magic, len(data), max_bytes)


def read_idx(path: Path | str, expect_magic: Optional[int] = None, *, max_bytes: int = MAX_IDX_BYTES) -> np.ndarray:
    """Read an IDX file (gzip or raw, detected by its magic bytes) into a writable native-order array.

    gzip files are streamed: the header is read first, and a declared size above ``max_bytes`` or
    above what deflate can expand the file to (1032:1) is refused before any payload is read; then
    exactly the declared bytes are read, and data beyond them is an error (the IDX format has no
    trailer), so memory is bounded by the declared size. Every failure is a ``ValueError`` naming
    ``path`` (``FileNotFoundError`` when it does not exist).
    """
    path = Path(path)
    with open_stream(path) as (fh, size, is_gzip):
        if not is_gzip:
            return _read_idx_stream(fh, path, expect_magic, size, max_bytes)
        try:
            return _read_idx_stream(fh, path, expect_magic, None, max_bytes, gzip_size=size)
        except GZIP_ERRORS as exc:
            raise gzip_error(path, exc) from None


def encode_idx(arr: np.ndarray) -> bytes:
    """IDX bytes for ``arr`` (inverse of :func:`parse_idx`)."""
    arr = np.asarray(arr)
    if arr.dtype not in _CODE_OF:
        raise ValueError(f"arr: IDX cannot store dtype {arr.dtype}")
    head = bytes([0, 0, _CODE_OF[arr.dtype], arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    return head + np.ascontiguousarray(arr.astype(arr.dtype.newbyteorder(">"), copy=False)).tobytes()


def write_idx(path: Path | str, arr: np.ndarray, compress: Optional[bool] = None) -> Path:
    """Write ``arr`` as IDX, gzip-compressed (deterministic: level 9, mtime 0) when the name ends in .gz."""
    import gzip

    from shiftguard.io import atomic_write_bytes

    path = Path(path)
    data = encode_idx(arr)
    if compress if compress is not None else path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=9, mtime=0)
    return atomic_write_bytes(path, data)


def _find_file(folder: Path, stem: str) -> Optional[Path]:
    for cand in (folder / f"{stem}.gz", folder / stem):
        if cand.is_file():
            return cand
    return None


def load_idx_pair(images_path: Path, labels_path: Path, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
    """Images ``uint8 (N, H, W)`` and labels ``int64 (N,)`` from an IDX image/label file pair, checked."""
    images = read_idx(images_path, expect_magic=0x00000803)
    labels = read_idx(labels_path, expect_magic=0x00000801)
    if images.shape[0] != labels.shape[0]:
        raise file_error(
            labels_path, f"holds {labels.shape[0]} labels but {images_path.name} holds {images.shape[0]} images"
        )
    if labels.size and int(labels.max()) >= num_classes:
        bad = int(np.argmax(labels >= num_classes))
        raise file_error(labels_path, f"label {int(labels[bad])} at index {bad} is out of range 0..{num_classes - 1}")
    return images, labels.astype(np.int64)


def load_mnist_like(
    name: str,
    split: str = "train",
    root=None,
    download: bool = False,
    classes: Optional[list[str]] = None,
) -> ImageDataset:
    """``mnist`` / ``fashion-mnist`` (or any IDX pair with the official names) as an ImageDataset."""
    check_split(name, split, ("train", "test"))
    prefix = _SPLIT_PREFIX[split]
    stems = (f"{prefix}-images-idx3-ubyte", f"{prefix}-labels-idx1-ubyte")

    def complete(d: Path) -> bool:
        return all(_find_file(d, s) is not None for s in stems)

    folder = locate(name, root, complete, [f"{s}.gz (or uncompressed)" for s in stems], download)
    img_path, lab_path = (_find_file(folder, s) for s in stems)
    assert img_path is not None and lab_path is not None  # locate returns a folder where complete holds
    images, labels = load_idx_pair(img_path, lab_path, 10)
    classes = classes or (FASHION_MNIST_CLASSES if name == "fashion-mnist" else MNIST_CLASSES)
    return ImageDataset(
        torch.from_numpy(np.ascontiguousarray(images)).unsqueeze(1),
        torch.from_numpy(labels),
        classes,
        name,
        split,
        meta={"root": str(folder), "files": [str(img_path), str(lab_path)]},
    )
