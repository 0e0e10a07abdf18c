"""Crash-safe file writing: every result, manifest and checkpoint goes through here.

A write goes to a temporary file in the same directory, is flushed and fsync'ed, and is then
renamed over the target (``os.replace`` is atomic on POSIX), so a reader never sees a half-written
file: it sees the old content or the new one.

A write that the system refuses (disk full, read-only file system, no permission, a file where a
folder should be) raises the ``OSError`` of that cause with ``filename`` set to the target path,
also when a serialiser (``torch.save``) wrapped the failing write in an exception of its own; the
target keeps its previous content and no temporary file is left.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import IO, Any, Callable, cast

__all__ = ["atomic_write", "atomic_write_bytes", "atomic_write_text", "atomic_write_json", "sha256_file"]


class _WriteGuard:
    """The file object a writer gets: remembers the first ``OSError`` a write raised, so that an
    exception a serialiser builds from it (``torch.save`` reports a failed write as a
    ``RuntimeError`` about stream positions) can be replaced by its cause."""

    def __init__(self, fh: IO[bytes]):
        self._fh = fh
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._fh.write(data)
        except OSError as exc:
            if self.error is None:
                self.error = exc
            raise

    def __getattr__(self, name: str):
        return getattr(self._fh, name)


def _naming(exc: OSError, path: Path) -> OSError:
    """``exc`` with ``filename`` set to ``path`` (the target, not a temporary file): same errno, so
    the same ``OSError`` subclass; ``exc`` itself when it has no errno or already names ``path``."""
    if exc.errno is None or exc.filename == str(path):
        return exc
    return OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path))


@contextlib.contextmanager
def _named_failures(path: Path):
    """Re-raise an ``OSError`` of the block as the same error naming ``path``."""
    try:
        yield
    except OSError as exc:
        named = _naming(exc, path)
        if named is exc:
            raise
        raise named from exc


def atomic_write(path: str | os.PathLike, writer: Callable[[IO[bytes]], object]) -> Path:
    """Call ``writer(fileobj)`` on a temporary file, then atomically move it to ``path``.

    Raises the ``OSError`` (``filename`` = ``path``) of a write the system refused, see the module
    docstring; any other exception of ``writer`` (an ``OSError`` of its own reading included)
    propagates unchanged. Either way ``path`` keeps its previous content.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _named_failures(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        fh = os.fdopen(fd, "wb")
        try:
            with _named_failures(path):
                # mkstemp creates 0600; give the file the mode a plain open() would (0666 & ~umask).
                umask = os.umask(0)
                os.umask(umask)
                os.chmod(tmp, 0o666 & ~umask)
            guard = _WriteGuard(fh)
            try:
                writer(cast(IO[bytes], guard))  # duck-typed: write() guarded, the rest delegated
            except Exception as exc:
                if guard.error is None:
                    raise
                named = _naming(guard.error, path)
                raise named from (exc if exc is not named else None)
            with _named_failures(path):
                fh.flush()
                os.fsync(fh.fileno())
        except BaseException:
            # The first failure is the one reported; closing may fail again on the same full disk,
            # and the temporary file's buffered bytes are thrown away with it.
            with contextlib.suppress(OSError):
                fh.close()
            raise
        with _named_failures(path):
            fh.close()
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
