"""Deprecated: the command modules are :mod:`shiftguard.commands`; this name is removed in shiftguard 0.3.

``import shiftguard.experiments.run`` (and every other command module) still works, with a
``DeprecationWarning``: each ``shiftguard.experiments.<name>`` is the very module
``shiftguard.commands.<name>``, so its functions and classes are the same objects.
"""

from __future__ import annotations

import importlib
import sys

from shiftguard._deprecation import warn_deprecated

warn_deprecated("shiftguard.experiments", "shiftguard.commands", stacklevel=2)

_MODULES = ("arguments", "config", "corrupt", "evaluate", "gallery", "report", "run", "rundir", "toy", "transfer")

for _name in _MODULES:
    _module = importlib.import_module(f"shiftguard.commands.{_name}")
    sys.modules[f"{__name__}.{_name}"] = _module
    globals()[_name] = _module

__all__ = list(_MODULES)
