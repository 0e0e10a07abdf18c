"""Crash-safe file writing: every result, manifest and checkpoint goes through here.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, and is then
renamed over the target (``os.replace`` is atomic on POSIX), so a reader never sees a half-written
file: it sees the old content or the new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, IO

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "sha256_file"]


def atomic_write(path: str | os.PathLike, writer: Callable[[IO[bytes]], None]) -> Path:
    """Call ``writer(fileobj)`` on a temporary file, then atomically move it to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would (0666 & ~umask).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as fh:
            writer(fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return path


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    return atomic_write(path, lambda fh: fh.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, **kwargs) -> Path:
    kwargs.setdefault("indent", 2)
    kwargs.setdefault("sort_keys", False)
    return atomic_write_text(path, json.dumps(obj, **kwargs) + "\n")


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(chunk), b""):
            h.update(block)
    return h.hexdigest()
