"""``shiftguard report DIR [DIR ...] [--out DIR] [--match FIRST=OTHER ...]``: rebuild or compare reports.

Each input is a ``shiftguard run`` directory or a ``shiftguard evaluate`` output folder, in any
mix; they are only read. One input: its report (``results.csv``, ``plots/``, ``report.html``)
is rebuilt from its ``results.json`` into ``--out`` (default: a new folder ``<run>-report-<time>``
beside it). Several: one comparison folder (default ``<parent of the first>/compare-<time>``)
with their curves on the same axes, the differences to the first (series matched as
:func:`shiftguard.evaluation.report.comparison_matches` says; ``--match`` pairs model names) and a
warning when their protocols differ. A run without its ``COMPLETE`` marker, or an evaluation
folder without its ``results.json`` (written last), is refused. The rendering lives in
:mod:`shiftguard.evaluation.report`.
"""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from pathlib import Path

from shiftguard._lock import LOCK_NAME
from shiftguard.commands.arguments import ListAction
from shiftguard.evaluation.report import build_comparison, build_report, comparison_matches, format_summary

from .rundir import COMPLETE_MARKER

__all__ = ["add_arguments", "main", "load_run"]


# --------------------------------------------------------------------------- loading runs
def load_run(run_dir: str | Path) -> dict:
    """``results.json`` of a finished ``shiftguard run`` directory or ``shiftguard evaluate`` output
    folder; one-line errors for anything else.

    A run directory (it holds ``config.json`` or ``COMPLETE``) is finished when its ``COMPLETE``
    marker exists (written last); an unfinished one is resumed with ``shiftguard run --resume``. An
    evaluation folder (``shiftguard evaluate --out``, ``EvaluationResult.write_report``) has no
    marker: its ``results.json`` is written after every other file and removed first by
    ``--overwrite``, so the folder is finished exactly when ``results.json`` exists."""
    d = Path(run_dir)
    if not d.exists():
        raise FileNotFoundError(f"run or evaluation folder not found: {d}")
    if not d.is_dir():
        raise ValueError(f"{d}: not a directory")
    is_run = (d / "config.json").is_file() or (d / COMPLETE_MARKER).is_file()
    if is_run and not (d / COMPLETE_MARKER).is_file():
        raise ValueError(
            f"{d}: the run is incomplete (no {COMPLETE_MARKER} marker); finish it with "
            f"'shiftguard run --resume --name {d.name} --out {d.parent}' (same --config)"
        )
    if not is_run and not (d / "results.json").is_file():
        if any((d / n).exists() for n in ("report.html", "results.csv", "plots", LOCK_NAME)):
            raise ValueError(
                f"{d}: the evaluation output is incomplete (no results.json, which shiftguard evaluate "
                "writes last): it is still being written or was interrupted; run that evaluation "
                f"again with --overwrite --out {d}"
            )
        raise ValueError(f"{d}: not a shiftguard run directory or evaluation folder (no config.json or results.json)")
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
                raise ValueError(
                    f"{path}: malformed results file: rows[{i}].{key} is {json.dumps(value)[:40]}, "
                    f"expected {'a string' if key in _ROW_NAMES else 'a number'}"
                )


# Exceptions that rendering a results file whose outline is right but whose values are not
# (a missing key, a string where a number belongs, values nested too deeply) can raise.
_MALFORMED = (KeyError, TypeError, AttributeError, IndexError, ValueError, RecursionError)


def _malformed(exc: BaseException, sources: list[str]) -> ValueError:
    what = sources[0] if len(sources) == 1 else "one of " + ", ".join(sources)
    cause = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
    return ValueError(
        f"{what}: malformed results file, the report cannot be built from it "
        f"({type(exc).__name__}: {cause}); --debug shows where"
    )


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
    p.add_argument(
        "runs",
        nargs="+",
        metavar="DIR",
        help="one or more finished shiftguard run directories or shiftguard evaluate output folders, in "
        "any mix (only read)",
    )
    p.add_argument(
        "--match",
        nargs="+",
        action=ListAction,
        metavar="FIRST=OTHER",
        help="compare model FIRST of the first folder with model OTHER of each later one (e.g. relu=qact); "
        "default: the same series key, else the only model of each side",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="new folder for the report (default: one run: <run>-report-<time>/ beside it; several: "
        "<parent of the first run>/compare-<time>/)",
    )


def parse_match(values) -> dict[str, str] | None:
    """``--match A=B C=D`` as ``{"A": "B", "C": "D"}``; ``None`` without it."""
    if not values:
        return None
    pairs: dict[str, str] = {}
    for v in values:
        first, sep, other = v.partition("=")
        if not sep or not first or not other or "=" in other:
            raise ValueError(
                f"--match: expected FIRST=OTHER (a model of the first folder = a model of the others), got {v!r}"
            )
        if first in pairs:
            raise ValueError(f"--match: model {first!r} is paired twice")
        pairs[first] = other
    return pairs


def main(args) -> int:
    dirs = [Path(r) for r in args.runs]
    pairs = parse_match(getattr(args, "match", None))
    if pairs is not None and len(dirs) < 2:
        raise ValueError("--match: pairs the models of two or more folders; give at least two")
    runs = [load_run(d) for d in dirs]  # validate every run before writing anything
    if len(runs) > 1:  # a comparison that matches nothing is refused before anything is written
        comparison_matches(runs, pairs, names=[str(d) for d in dirs], argument="--match")
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
        path = build_comparison(out, runs, sources=sources, pairs=pairs)
    except _MALFORMED as exc:
        raise _malformed(exc, sources) from exc
    print(f"wrote comparison {path}")
    return 0
