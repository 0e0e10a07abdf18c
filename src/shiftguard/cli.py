"""The ``shiftguard`` command line: a thin dispatcher.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only picks the module, parses, and turns user errors into one
clear line and a non-zero exit (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("shiftguard.experiments.run", "train, shift, evaluate and write a report (the main job)"),
    "evaluate": ("shiftguard.experiments.evaluate", "evaluate your own model (module:factory + weights) under shift"),
    "report": ("shiftguard.experiments.report", "rebuild the report of one or more run directories"),
    "toy": ("shiftguard.experiments.toy", "the two-Gaussians failure-mode toy (paper 000, Figure 1)"),
    "corrupt": ("shiftguard.experiments.corrupt", "write a corrupted copy of a dataset (MNIST-C / CIFAR-10-C layout)"),
    "gallery": ("shiftguard.experiments.gallery", "save a PNG grid: corruptions x severities 0-5"),
}

# Errors a user can cause (bad names, missing files, bad configs). Anything else is a bug and
# keeps its traceback.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, PermissionError, KeyError)


def _top_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="shiftguard",
        description="Accuracy and calibration under distribution shift.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {k:<10} {v[1]}" for k, v in COMMANDS.items()),
    )
    p.add_argument("--version", action="store_true", help="print the version and exit")
    p.add_argument("command", nargs="?", choices=sorted(COMMANDS), metavar="command")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        ns, _ = top.parse_known_args(argv[:1])
        if ns.version:
            from shiftguard import __version__

            print(f"shiftguard {__version__}")
            return 0
        top.print_help()
        return 0 if not argv else 2
    name, rest = argv[0], argv[1:]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"shiftguard {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        print("shiftguard: interrupted", file=sys.stderr)
        return 130
    except USER_ERRORS as exc:
        if debug:
            raise
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"shiftguard {name}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
