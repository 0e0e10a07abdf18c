"""``shiftguard.experiments``, the former name of the command modules, for one release."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path


def test_the_old_name_warns_and_gives_the_very_command_modules():
    # a fresh interpreter: the warning is raised once, at the package's first import
    code = (
        "import warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        "try:\n"
        "    import shiftguard.experiments.run\n"
        "except DeprecationWarning as w:\n"
        "    print('warned:', w)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "warned: shiftguard.experiments is deprecated" in out and "shiftguard.commands" in out


def test_every_command_module_is_reachable_under_the_old_name(recwarn):
    commands = importlib.import_module("shiftguard.commands")
    import shiftguard.experiments as old

    here = {p.stem for p in Path(commands.__file__).parent.glob("*.py") if p.stem != "__init__"}
    assert set(old.__all__) == here, "a command module without its old name, or the reverse"
    for name in old.__all__:
        new = importlib.import_module(f"shiftguard.commands.{name}")
        assert importlib.import_module(f"shiftguard.experiments.{name}") is new
        assert getattr(old, name) is new
    from shiftguard.experiments.run import execute

    assert execute is importlib.import_module("shiftguard.commands.run").execute
    assert commands is not old
