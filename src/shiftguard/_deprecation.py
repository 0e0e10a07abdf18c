"""Deprecated names, kept working for one release with a ``DeprecationWarning`` that names the new one."""

from __future__ import annotations

import warnings
from typing import Optional

__all__ = ["REMOVED_IN", "positional_dims", "warn_deprecated"]

#: The release that removes what is deprecated now.
REMOVED_IN = "0.3"


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated and will be removed in :data:`REMOVED_IN`, naming ``new``;
    ``stacklevel`` 3 points the warning at the caller of the function that calls this one."""
    warnings.warn(
        f"{old} is deprecated and will be removed in shiftguard {REMOVED_IN}; use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def positional_dims(
    call: str, args: tuple, num_classes: Optional[int], embedding_dim: Optional[int]
) -> tuple[Optional[int], Optional[int]]:
    """``(num_classes, embedding_dim)`` of a function whose dimensions became keyword-only (in the
    order ``num_classes, embedding_dim`` of every loss), given the ``args`` it received by position
    in its former order ``(embedding_dim, num_classes)``: those are read in that order, with a
    ``DeprecationWarning`` that asks for keywords (a silent change of their meaning would swap them).
    ``call`` spells the new call, e.g. ``"build_loss(name, num_classes=..., embedding_dim=...)"``.

    Raises ``TypeError`` for more than two positional dimensions, or one given both ways.
    """
    if not args:
        return num_classes, embedding_dim
    if len(args) > 2:
        raise TypeError(f"embedding_dim, num_classes: at most 2 dimensions by position, got {len(args)}")
    if embedding_dim is not None or (len(args) == 2 and num_classes is not None):
        name = "embedding_dim" if embedding_dim is not None else "num_classes"
        raise TypeError(f"{name}: given both by position and by keyword")
    warn_deprecated(
        f"passing (embedding_dim, num_classes) by position to {call.split('(')[0]}",
        f"keywords: {call}",
        stacklevel=4,
    )
    return (args[1] if len(args) == 2 else num_classes), args[0]
