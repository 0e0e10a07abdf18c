"""Deprecated names, kept working for one release with a ``DeprecationWarning`` that names the new one."""

from __future__ import annotations

import warnings

__all__ = ["REMOVED_IN", "warn_deprecated"]

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
