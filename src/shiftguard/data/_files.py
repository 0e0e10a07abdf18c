"""Low-level file reading shared by the loaders: every failure becomes an error naming the file.

A loader never lets a bare ``zlib.error`` or ``EOFError`` escape: a user with a truncated
download must be told which file is broken and what was expected of it.
"""

from __future__ import annotations

import contextlib
import gzip
import os
import zlib
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Optional, Sequence, cast

import numpy as np

__all__ = [
    "file_error",
    "open_stream",
    "gzip_error",
    "read_bytes",
    "text_lines",
    "load_npy",
    "missing_files_error",
    "check_split",
    "DEFLATE_MAX_RATIO",
    "MAX_READ_BYTES",
    "GZIP_ERRORS",
    "CHUNK_BYTES",
]


def file_error(path: os.PathLike | str, message: str) -> ValueError:
    """A ``ValueError`` whose message starts with the offending file."""
    return ValueError(f"{path}: {message}")


#: Deflate (RFC 1951) expands at most 1032:1 (a 258-byte match per 2 bits; zlib technical
#: details, "Maximum compression factor"); a gzip file of ``n`` bytes never holds more than this
#: times ``n`` bytes, whatever its header claims.
DEFLATE_MAX_RATIO = 1032

#: Default bound on what :func:`read_bytes` returns (and on what an IDX header may declare).
MAX_READ_BYTES = 1 << 31

#: Size of one streamed read.
CHUNK_BYTES = 1 << 20

GZIP_ERRORS = (EOFError, OSError, zlib.error)  # truncated stream, bad CRC (BadGzipFile is an OSError), garbage


@contextlib.contextmanager
def open_stream(path: Path) -> Iterator[tuple[BinaryIO, int, bool]]:
    """Open ``path`` for streaming reads, gunzipping on the fly when it is a gzip file (by magic
    bytes, not by name). Yields ``(stream, size_on_disk, is_gzip)``.

    Nothing is decompressed ahead of the reads: a caller that reads ``n`` bytes holds ``n`` bytes.
    Raises ``FileNotFoundError`` for a missing file and ``ValueError`` naming it for a directory or
    a ``.gz`` name without gzip content. Decompression errors during reads are the caller's to
    wrap (see :func:`gzip_error`).
    """
    path = Path(path)
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise file_error(path, "expected a file, found a directory") from None
    with fh:
        size = os.fstat(fh.fileno()).st_size
        is_gzip = fh.read(2) == b"\x1f\x8b"
        fh.seek(0)
        if not is_gzip:
            if path.suffix == ".gz":
                raise file_error(path, "named .gz but is not a gzip file (bad magic bytes)")
            yield fh, size, False
            return
        with gzip.GzipFile(fileobj=fh, mode="rb") as gz:
            # GzipFile has the binary-file interface the readers use (read, seek, tell)
            yield cast(BinaryIO, gz), size, True


def gzip_error(path: os.PathLike | str, exc: BaseException) -> ValueError:
    return file_error(path, f"corrupt or truncated gzip data ({type(exc).__name__}: {exc})")


def read_bytes(path: Path, max_bytes: int = MAX_READ_BYTES) -> bytes:
    """The content of ``path``, gunzipped when it is a gzip file (by magic bytes, not by name).

    Decompression is streamed and stops after ``max_bytes``: content (decompressed) longer than
    that is a ``ValueError`` naming the file, raised without decompressing the rest.
    """
    path = Path(path)
    chunks: list[bytes] = []
    held = 0
    with open_stream(path) as (fh, _, is_gzip):
        while held <= max_bytes:  # chunked: one huge read() would reserve its whole size up front
            try:
                block = fh.read(min(CHUNK_BYTES, max_bytes + 1 - held))
            except GZIP_ERRORS as exc:
                if not is_gzip:
                    raise
                raise gzip_error(path, exc) from None
            if not block:
                break
            chunks.append(block)
            held += len(block)
    if held > max_bytes:
        raise file_error(path, f"holds more than max_bytes={max_bytes} bytes{' (decompressed)' if is_gzip else ''}")
    return b"".join(chunks)


def text_lines(path: Path) -> list[tuple[int, str]]:
    """The non-blank lines of a UTF-8 text file with their 1-based line numbers; a file that is not
    UTF-8 text is a ``ValueError`` naming it (index files such as ``wnids.txt``)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise file_error(path, f"not a text file ({exc})") from None
    return [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def load_npy(path: Path, *, mmap: bool = False) -> np.ndarray:
    """``numpy.load`` of a ``.npy`` file with pickles refused and every failure naming the file.

    ``mmap=True`` maps the file read-only instead of reading it (the CIFAR-10-C arrays are 150 MB
    each and a caller usually needs one fifth of them).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: file not found")
    _check_npy_size(path)
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except ValueError as exc:  # bad header, object arrays (pickle refused), size mismatch
        raise file_error(path, f"not a valid .npy array file ({exc})") from None
    except Exception as exc:  # truncated data (EOFError, OSError), mangled header (SyntaxError, TokenError, ...)
        raise file_error(path, f"corrupt or truncated .npy file ({type(exc).__name__}: {exc})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive under a .npy name
        raise file_error(path, "expected a single .npy array, found an .npz archive")
    return arr


def _check_npy_size(path: Path) -> None:
    """Compare the size the .npy header declares with the file's size before reading any data.

    Without this a corrupt shape field would make ``numpy.load`` allocate the declared size first.
    """
    from numpy.lib import format as npformat

    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            if fh.read(4) == b"PK\x03\x04":
                raise file_error(path, "expected a single .npy array, found an .npz (zip) archive")
            fh.seek(0)
            version = npformat.read_magic(fh)
            if version == (1, 0):
                shape, _, dtype = npformat.read_array_header_1_0(fh)
            elif version in ((2, 0), (3, 0)):
                shape, _, dtype = npformat.read_array_header_2_0(fh)
            else:
                raise file_error(path, f"unsupported .npy format version {version}")
            header_end = fh.tell()
    except ValueError as exc:
        if str(exc).startswith(str(path)):
            raise
        raise file_error(path, f"not a valid .npy array file ({exc})") from None
    except Exception as exc:  # truncated or mangled header (EOFError, SyntaxError, TokenError, ...)
        raise file_error(path, f"corrupt or truncated .npy header ({type(exc).__name__}: {exc})") from None
    if dtype.hasobject:
        raise file_error(path, f"holds Python objects (dtype {dtype}); pickled arrays are refused")
    expected = header_end + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != expected:
        kind = "truncated" if size < expected else "has trailing bytes"
        raise file_error(
            path, f"{kind}: header declares {dtype} {tuple(shape)} ({expected} bytes in all), file holds {size}"
        )


def check_split(name: str, split: str, allowed: Sequence[str]) -> str:
    if not isinstance(split, str) or split not in allowed:
        raise ValueError(f"split: {name!r} has splits {list(allowed)}, got {split!r}")
    return split


def missing_files_error(
    name: str,
    expected: Iterable[str],
    looked_in: Sequence[Path],
    hint: Optional[str] = None,
) -> FileNotFoundError:
    """The error for a dataset whose files are not where they were looked for."""
    where = "\n  ".join(str(p) for p in looked_in)
    files = ", ".join(expected)
    msg = f"{name}: expected files {files} in one of:\n  {where}"
    if hint:
        msg += f"\n{hint}"
    return FileNotFoundError(msg)
