"""Names shared by the commands that write a run directory (``shiftguard run``,
:mod:`shiftguard.commands.run`) and the ones that only read it (``shiftguard report``,
:mod:`shiftguard.commands.report`), so that neither command module imports the other.

The layout of a run directory is described in :mod:`shiftguard.commands.run`.
"""

from __future__ import annotations

__all__ = ["COMPLETE_MARKER"]

#: File written last into a finished run directory (its content: the results' creation time); a
#: directory without it is an interrupted run, which ``shiftguard report`` refuses.
COMPLETE_MARKER = "COMPLETE"
