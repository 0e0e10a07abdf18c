"""``shiftguard report RUN_DIR [RUN_DIR ...] [--out DIR]``: rebuild or compare finished runs' reports.

The input runs are only read. One run: its report (``results.csv``, ``plots/``, ``report.html``)
is rebuilt from its ``results.json`` into ``--out`` (default: a new folder ``<run>-report-<time>``
beside it). Several runs: one comparison folder (default ``<parent of the first>/compare-<time>``)
with their curves on the same axes, the differences to the first run and a warning when their
protocols differ. A run without its ``COMPLETE`` marker is refused. The rendering lives in
:mod:`shiftguard.evaluation.report`.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

from shiftguard.evaluation.report import build_comparison, build_report, format_summary

from .rundir import COMPLETE_MARKER

__all__ = ["add_arguments", "main", "load_run"]


# --------------------------------------------------------------------------- loading runs
def load_run(run_dir: str | Path) -> dict:
    """``results.json`` of a finished run; clear errors for anything else."""
    d = Path(run_dir)
    if not d.exists():
        raise FileNotFoundError(f"run directory not found: {d}")
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory")
    if not (d / "config.json").is_file() and not (d / "results.json").is_file():
        raise ValueError(f"{d}: not a shiftguard run directory (no config.json or results.json)")
    if not (d / COMPLETE_MARKER).is_file():
        raise ValueError(f"{d}: the run is incomplete (no {COMPLETE_MARKER} marker); finish it with "
                         f"'shiftguard run --resume --name {d.name} --out {d.parent}' (same --config)")
    path = d / "results.json"
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{d}: has a {COMPLETE_MARKER} marker but no results.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    except RecursionError:  # json's decoder recurses once per nesting level
        raise ValueError(f"{path}: not a results file (JSON nested too deeply to read)") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path}: not a results file (a JSON {type(results).__name__}, expected an object)")
    if results.get("status") != "complete":
        raise ValueError(f"{path}: status is {results.get('status')!r}, not 'complete'")
    _check_shape(results, path)
    return results


# Keys of a row (shiftguard.evaluation.grid) that are names or counts; every other key is a metric.
_ROW_NAMES = frozenset({"model", "context", "adaptation", "head", "corruption", "group"})
_ROW_COUNTS = frozenset({"severity", "n"})


def _check_shape(results, path: Path) -> None:
    """The outline every ``results.json`` object has (``rows`` a list of objects whose names are
    strings and whose metrics are numbers or null; ``data``, where present, an object), so that a malformed file is
    refused by name before anything is rendered, never shown as if it were a result."""
    rows = results.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError(f"{path}: not a results file ('rows' must be a list of objects)")
    if not isinstance(results.get("data", {}), dict):
        raise ValueError(f"{path}: not a results file ('data' must be an object)")
    for i, row in enumerate(rows):
        for key, value in row.items():
            if key in _ROW_NAMES:
                ok = isinstance(value, str)
            elif key in _ROW_COUNTS:
                ok = isinstance(value, int) and not isinstance(value, bool)
            else:  # a metric: a number, or null where it is undefined
                ok = value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))
            if not ok:
                raise ValueError(f"{path}: malformed results file: rows[{i}].{key} is {json.dumps(value)[:40]}, "
                                 f"expected {'a string' if key in _ROW_NAMES else 'a number'}")


# Exceptions that rendering a results file whose outline is right but whose values are not
# (a missing key, a string where a number belongs, values nested too deeply) can raise.
_MALFORMED = (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError)


def _malformed(exc: BaseException, sources: list[str]) -> ValueError:
    what = sources[0] if len(sources) == 1 else "one of " + ", ".join(sources)
    cause = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    return ValueError(f"{what}: malformed results file, the report cannot be built from it "
                      f"({type(exc).__name__}: {cause}); --debug shows where")


# --------------------------------------------------------------------------- output folder
def _new_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... : the first name not taken."""
    out, i = base, 1
    while out.exists():
        i += 1
        out = base.with_name(f"{base.name}-{i}")
    return out


def output_dir(runs: list[Path], out: str | None) -> Path:
    """The folder the report goes to; refused when it is (or is inside) an input run, or is not empty,
    so no file of an input run and no earlier report is ever overwritten."""
    stamp = f"{datetime.now():%Y%m%d-%H%M%S}"
    if out is None:
        first = runs[0].resolve()
        base = first.parent / (f"{first.name}-report-{stamp}" if len(runs) == 1 else f"compare-{stamp}")
        return _new_folder(base)
    path = Path(out)
    target = path.resolve()
    for r in runs:
        src = r.resolve()
        if target == src or src in target.parents:
            raise ValueError(f"--out: {path} is inside the input run {r}; the report never writes into its input runs")
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"--out: {path} already exists and is not an empty folder; give a new folder")
    return path


# --------------------------------------------------------------------------- command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one or more finished run directories (only read)")
    p.add_argument("--out", metavar="DIR",
                   help="new folder for the report (default: one run: <run>-report-<time>/ beside it; several: "
                        "<parent of the first run>/compare-<time>/)")


def main(args) -> int:
    dirs = [Path(r) for r in args.runs]
    runs = [load_run(d) for d in dirs]  # validate every run before writing anything
    out = output_dir(dirs, args.out)
    sources = [str(d / "results.json") for d in dirs]
    try:
        if len(runs) == 1:
            gallery = dirs[0] / "plots" / "corruption_gallery.png"
            path = build_report(out, runs[0], gallery=gallery if gallery.is_file() else None, source=sources[0])
            print(format_summary(runs[0]))
            print(f"\nwrote {path}")
            return 0
        for res in runs:
            print(format_summary(res))
            print()
        path = build_comparison(out, runs, sources=sources)
    except _MALFORMED as exc:
        raise _malformed(exc, sources) from exc
    print(f"wrote comparison {path}")
    return 0
