"""The ``shiftguard`` command line: a thin dispatcher.

Each sub-command lives in its own module exposing ``add_arguments(parser)`` and
``main(args) -> int``; this file only picks the module, parses, and turns user errors into one
clear line and a non-zero exit (``--debug`` shows the traceback instead).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import sys
from typing import Optional, Sequence

from shiftguard._lock import DirectoryInUseError
from shiftguard._malloc import reuse_large_blocks
from shiftguard._openmp import choose_waiting

# name -> (module, one-line help). Modules are imported only when their command runs.
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("shiftguard.commands.run", "train, shift, evaluate and write a report (the main job)"),
    "evaluate": ("shiftguard.commands.evaluate", "evaluate your own model (module:factory + weights) under shift"),
    "report": ("shiftguard.commands.report", "rebuild the report of one or more run directories"),
    "toy": ("shiftguard.commands.toy", "the two-Gaussians failure-mode toy of the QACT paper [QACT, Fig. 1]"),
    "corrupt": ("shiftguard.commands.corrupt", "write a corrupted copy of a dataset (MNIST-C / CIFAR-10-C layout)"),
    "gallery": ("shiftguard.commands.gallery", "save a PNG grid: corruptions x severities 0-5"),
    "transfer": ("shiftguard.commands.transfer", "the URL transfer benchmark on MNIST / Fashion-MNIST [Kirchhof]"),
}

# Errors a user can cause (bad names, missing files, bad configs, a run directory another process
# is using, a training that diverges with the learning rate given). Anything else is a bug and keeps its traceback.
USER_ERRORS = (
    ValueError,
    TypeError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    KeyError,
    DirectoryInUseError,
    FloatingPointError,
)

# OSErrors that the environment causes, not the program: a full disk or quota, a read-only or
# forbidden place, a file where a folder should be (or the reverse), a path that cannot resolve, a
# failing device, a file system without locks. Each is one line naming the file and the cause; any
# other OSError (EBADF, EINVAL, ...) points at a bug and keeps its traceback.
ENVIRONMENT_ERRNOS = frozenset(
    e
    for e in (
        getattr(errno, n, None)
        for n in (
            "ENOSPC",
            "EDQUOT",
            "EFBIG",
            "EROFS",
            "EACCES",
            "EPERM",
            "ENOTDIR",
            "EISDIR",
            "ENOENT",
            "EEXIST",
            "ENAMETOOLONG",
            "ELOOP",
            "EIO",
            "ENXIO",
            "ENODEV",
            "ETXTBSY",
            "EMLINK",
            "ESTALE",
            "ENOLCK",
        )
    )
    if e is not None
)
_FULL = frozenset(e for e in (getattr(errno, n, None) for n in ("ENOSPC", "EDQUOT", "EFBIG")) if e is not None)


def is_user_error(exc: BaseException) -> bool:
    """Whether ``exc`` is the user's or the environment's doing (one line, exit 2), not a bug."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno in ENVIRONMENT_ERRNOS
    return isinstance(exc, USER_ERRORS)


def describe_error(exc: BaseException, command: str) -> str:
    """The one line ``shiftguard <command>: error: ...`` says after the prefix: the message, or for an
    ``OSError`` of the environment the file and the cause (plus what to do when the disk is full)."""
    if isinstance(exc, KeyError) and exc.args:
        text = str(exc.args[0])
    elif isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        where = f"{exc.filename}: " if exc.filename is not None else ""
        text = f"{where}{exc.strerror} (errno {errno.errorcode.get(exc.errno, exc.errno)})"
        if exc.errno in _FULL:
            text += (
                "; free space, then run the same command with --resume to continue: finished steps are kept"
                if command == "run"
                else "; free space, then run the same command again"
            )
    else:
        text = str(exc)
    return " ".join(text.splitlines())


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
    reuse_large_blocks()
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    if debug:
        argv.remove("--debug")
    if not argv or argv[0] not in COMMANDS:
        top = _top_parser()
        ns, _ = top.parse_known_args(argv[:1])
        if ns.version:
            from shiftguard._version import __version__

            print(f"shiftguard {__version__}")
            return 0
        top.print_help()
        return 0 if not argv else 2
    name, rest = argv[0], argv[1:]
    # before the command's module imports torch, whose OpenMP runtime reads the setting once
    choose_waiting()
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"shiftguard {name}", description=COMMANDS[name][1])
    module.add_arguments(parser)
    args = parser.parse_args(rest)
    try:
        return int(module.main(args) or 0)
    except KeyboardInterrupt:
        print("shiftguard: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug or not is_user_error(exc):
            raise
        print(f"shiftguard {name}: error: {describe_error(exc, name)}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
