"""Crash-safe training checkpoints.

Each checkpoint ``epoch-0007.pt`` is written atomically (``shiftguard.io``) and followed by a
``epoch-0007.pt.sha256`` file holding its SHA-256. Loading verifies the checksum and reads the
file with ``torch.load(weights_only=True)`` (no pickled code runs). A missing, truncated or
corrupt checkpoint is skipped with a warning and the previous good one is used, so a run killed
while writing resumes from the last complete epoch.
"""

from __future__ import annotations

import io
import os
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import torch

from shiftguard.io import atomic_write_bytes, atomic_write_text, sha256_file

__all__ = [
    "save_checkpoint",
    "load_checkpoint",
    "load_latest_checkpoint",
    "list_checkpoints",
    "CheckpointError",
    "write_checksum",
    "checksum_problem",
]

_NAME = re.compile(r"^epoch-(\d{4,})\.pt$")


class CheckpointError(ValueError):
    """A checkpoint file that is missing its checksum, fails it, or cannot be read."""


def write_checksum(path: str | os.PathLike) -> Path:
    """Write ``<path>.sha256`` (atomically) holding the SHA-256 of the file ``path``; return its path.

    Call it once ``path`` is complete: a crash in between leaves a file without a checksum, which
    :func:`checksum_problem` reports as unverified."""
    p = Path(path)
    return atomic_write_text(p.with_name(p.name + ".sha256"), sha256_file(p) + "\n")


def checksum_problem(path: str | os.PathLike) -> Optional[str]:
    """``None`` when the file ``path`` matches its ``<path>.sha256``; else why not, as a phrase
    ("no checksum file <name>", "unreadable checksum file <name> (...)", "checksum mismatch with <name>
    (...)"). ``FileNotFoundError`` when ``path`` itself is missing."""
    p = Path(path)
    sidecar = p.with_name(p.name + ".sha256")
    if not sidecar.is_file():
        return f"no checksum file {sidecar.name}"
    try:
        expected = sidecar.read_text(encoding="ascii").strip()
    except (UnicodeDecodeError, OSError) as exc:
        return f"unreadable checksum file {sidecar.name} ({exc})"
    if sha256_file(p) != expected:
        return f"checksum mismatch with {sidecar.name} (file truncated or corrupt)"
    return None


def _path(directory: Path, epoch: int) -> Path:
    return directory / f"epoch-{epoch:04d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(epoch, path)`` of the checkpoint files in ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def save_checkpoint(directory: str | os.PathLike, epoch: int, state: dict, keep: int = 2) -> Path:
    """Write ``state`` as the checkpoint of ``epoch`` (atomically, with a checksum file).

    ``state`` must hold only tensors, numbers, strings and containers of them (it is read back
    with ``weights_only=True``). Only the newest ``keep`` checkpoints are kept.
    """
    d = Path(directory)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = _path(d, epoch)
    atomic_write_bytes(path, data)
    # The checksum is written after the data: a crash in between leaves a file without a checksum,
    # which the loader treats as incomplete and skips.
    write_checksum(path)
    if keep > 0:
        for _, old in list_checkpoints(d)[:-keep]:
            for f in (old, old.with_name(old.name + ".sha256")):
                try:
                    f.unlink()
                except FileNotFoundError:
                    pass
    return path


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> dict:
    """Verify the checksum of ``path`` and load it; :class:`CheckpointError` if it is damaged."""
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint {p}: file not found")
    problem = checksum_problem(p)
    if problem is not None:
        interrupted = " (write interrupted?)" if problem.startswith("no checksum file") else ""
        raise CheckpointError(f"checkpoint {p}: {problem}{interrupted}")
    try:
        state = torch.load(p, map_location=map_location, weights_only=True)
    except Exception as exc:  # unpickling errors come in many types
        raise CheckpointError(f"checkpoint {p}: cannot be read ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {p}: expected a dict, got {type(state).__name__}")
    return state


def load_latest_checkpoint(directory: str | os.PathLike, map_location: Any = "cpu") -> Optional[dict]:
    """The newest checkpoint in ``directory`` that passes its checksum, or ``None``.

    Damaged checkpoints are skipped with a ``RuntimeWarning`` naming them.
    """
    for _epoch, path in reversed(list_checkpoints(directory)):
        try:
            return load_checkpoint(path, map_location)
        except CheckpointError as exc:
            warnings.warn(f"{exc}; falling back to an older checkpoint", RuntimeWarning, stacklevel=2)
    return None
