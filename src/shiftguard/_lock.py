"""An exclusive, non-blocking lock on a directory, held by one process for a job's lifetime.

The lock is an advisory ``flock(LOCK_EX | LOCK_NB)`` on a file inside the directory (``.lock``).
The kernel releases it when its holder exits in any way (SIGKILL included), so a crashed job never
leaves a stale lock behind. The file itself is never deleted: deleting it would let a second process
lock a new file of the same name while a third still holds the old one. After taking the lock the
holder writes its process id into the file, which a refused process reads to say who holds it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

try:  # POSIX
    import fcntl
except ImportError:  # pragma: no cover - Windows: byte-range locking of the first byte instead
    fcntl = None  # type: ignore[assignment]
    import msvcrt

__all__ = ["DirectoryLock", "DirectoryInUseError", "LOCK_NAME"]

#: Name of the lock file inside a locked directory.
LOCK_NAME = ".lock"


class DirectoryInUseError(RuntimeError):
    """Another process holds the lock of the directory. ``directory`` and ``pid`` (``None`` when
    the holder's id could not be read) are attributes."""

    def __init__(self, directory: Path, pid: Optional[int]):
        self.directory, self.pid = directory, pid
        who = f"pid {pid}" if pid is not None else "pid unknown"
        super().__init__(f"run directory {directory} is in use by another shiftguard process ({who})")


class DirectoryLock:
    """Exclusive lock of ``directory`` (which must exist) through ``directory/.lock``.

    ``acquire()`` never waits: it raises :class:`DirectoryInUseError` when another process holds
    the lock (or another ``DirectoryLock`` object of this process: each holds its own open file).
    Use as a context manager, or call ``release()``; releasing twice is harmless.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self._fd: Optional[int] = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> "DirectoryLock":
        if self._fd is not None:
            raise RuntimeError(f"{self.path}: this lock is already held")
        # O_CLOEXEC: a program this process starts must not inherit (and so keep) the lock.
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            locked = _lock(fd)
        except OSError as exc:  # a file system without locks (ENOLCK): refused, never run unlocked
            os.close(fd)
            raise OSError(exc.errno, f"cannot lock the directory ({exc.strerror})", str(self.path)) from exc
        except BaseException:
            os.close(fd)
            raise
        if not locked:
            os.close(fd)
            raise DirectoryInUseError(self.directory, self._holder())
        self._fd = fd
        try:  # the holder's id is information for a refused process, not part of the lock
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))  # the file was just opened: offset 0
        except OSError:
            pass
        return self

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the file releases the lock

    def _holder(self) -> Optional[int]:
        """The process id the holder wrote; it may still be writing it, so look a few times."""
        for _ in range(20):
            try:
                text = self.path.read_text(encoding="ascii").strip()
            except (OSError, UnicodeDecodeError):
                return None
            if text.isdigit():
                return int(text)
            time.sleep(0.01)
        return None

    def __enter__(self) -> "DirectoryLock":
        return self.acquire() if self._fd is None else self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self):  # pragma: no cover - the garbage collector closes a forgotten lock
        self.release()


def _lock(fd: int) -> bool:
    """Take the exclusive lock of ``fd`` without waiting: ``True``, or ``False`` when another open
    file holds it; ``OSError`` when the file system cannot lock."""
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # EWOULDBLOCK: held elsewhere
            return False
        return True
    try:  # pragma: no cover
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:  # pragma: no cover - Windows reports a held range as EACCES / EDEADLOCK
        return False
    return True  # pragma: no cover
