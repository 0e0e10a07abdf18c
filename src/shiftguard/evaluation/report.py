"""The report of an evaluation: ``results.csv``, ``plots/*.png`` and a self-contained ``report.html``.

``build_report(out_dir, results)`` writes the three from the results dict (the content of
``results.json``); ``build_comparison(out_dir, runs)`` writes one page comparing several results
dicts: their curves overlaid on the same axes, their headline numbers and the differences to the
first, and a warning listing what differs when their protocols are not the same.

Units, everywhere: every rate (accuracy, ECE, AUROC, MAP, recall, AURC) in %, NLL and Brier score
as they are; accuracy drops and differences in percentage points. ``a ± b`` is the mean and the
standard deviation (ddof = 0) over the benchmark corruptions; ``x [lo, hi]`` an estimate with the
confidence interval that ``results["interval_info"]`` describes.

Every value taken from the results dict is escaped before it is written into the page; numbers
are formatted through ``float()``, and a value that is not a number is shown as escaped text and
listed at the top of the page as a problem of the results file.

Older results dicts without ``kind``, ``models``, ``robustness``, ``intervals``, ``skipped_heads``,
``data.suite`` or ``data.extra_corruptions`` render with those parts left out.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from pathlib import Path
from typing import Iterable, Optional, Sequence

from shiftguard.io import atomic_write_bytes, atomic_write_text

from . import plots as P
from .aggregate import series_fields, series_key
from .plots import CLEAN, as_number, benchmark_corruptions, cell_index, primary_keys, severity_curve

__all__ = [
    "build_report",
    "render_html",
    "make_plots",
    "write_csv",
    "csv_text",
    "summary_rows",
    "format_summary",
    "headline_rows",
    "build_comparison",
    "render_comparison",
    "protocol_differences",
    "delta_rows",
    "results_problems",
]

CSV_FIXED = ["model", "context", "adaptation", "head", "corruption", "severity", "n"]
_LABEL_FIELDS = ("model", "context", "adaptation", "head", "corruption", "group")


# --------------------------------------------------------------------------- formatting (plain text)
def _fmt(v, scale: float = 100.0, nd: int = 1) -> str:
    """A number scaled and rounded; ``—`` for None; anything that is not a number as its text."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    try:
        x = float(v)
    except (TypeError, ValueError, OverflowError):
        return str(v)
    return f"{x * scale:.{nd}f}"


def _plain(v, nd: int = 3) -> str:
    return _fmt(v, 1.0, nd)


def _int(v) -> str:
    x = as_number(v)
    return str(v) if x is None or x != int(x) else f"{int(x)}"


def _signed(v, nd: int = 1) -> str:
    x = as_number(v)
    return "—" if x is None else f"{x:+.{nd}f}"


def _pm(mean, std, scale: float = 100.0, nd: int = 1) -> str:
    if mean is None:
        return "—"
    return _fmt(mean, scale, nd) if std is None else f"{_fmt(mean, scale, nd)} ± {_fmt(std, scale, nd)}"


def _ci(value, ci: Optional[dict], scale: float = 100.0, nd: int = 1) -> str:
    """``estimate [lo, hi]`` when an interval is known (its own estimate is shown: the interval is
    about that number), else the value."""
    if not ci:
        return _fmt(value, scale, nd)
    return f"{_fmt(ci.get('estimate'), scale, nd)} [{_fmt(ci.get('lo'), scale, nd)}, {_fmt(ci.get('hi'), scale, nd)}]"


def _key_label(model, ctx, arm, head) -> str:
    text = f"{model}" if ctx == "none" else f"{model} [{ctx}]"
    return text + ("" if arm in ("none", None) else f" + {arm}") + f" / {head}"


def _has_arms(*runs: dict) -> bool:
    """Whether any of the results dicts scored a test-time adaptation arm besides the static one:
    only then do tables show an adaptation column."""
    return any(series_key(r)[2] != "none" for res in runs for r in res.get("rows") or [])


def _transductive(results: dict) -> set:
    return {
        str(a.get("name")) for a in results.get("adaptation") or [] if isinstance(a, dict) and a.get("transductive")
    }


def _label_head(arms: bool) -> list[str]:
    return ["model", "context", "adaptation", "head"] if arms else ["model", "context", "head"]


def _label_cells(key: tuple, arms: bool, transductive: frozenset | set = frozenset()) -> list[str]:
    """The label columns of a ``(model, context, adaptation, head)`` key; a transductive arm is marked ``*``."""
    model, ctx, arm, head = key
    if not arms:
        return [str(model), str(ctx), str(head)]
    return [str(model), str(ctx), str(arm) + (" *" if arm in transductive else ""), str(head)]


# --------------------------------------------------------------------------- numbers
def _mean_over(values: Iterable) -> tuple[Optional[float], int, int]:
    """Mean of the defined values, how many were defined, how many there were."""
    vals = list(values)
    nums = [x for x in (as_number(v) for v in vals) if x is not None]
    return (sum(nums) / len(nums) if nums else None), len(nums), len(vals)


def _largest_k(row: dict, prefix: str) -> Optional[str]:
    ks = sorted(int(k[len(prefix) :]) for k in row if k.startswith(prefix) and k[len(prefix) :].isdigit())
    return f"{prefix}{ks[-1]}" if ks else None


def summary_rows(results: dict) -> list[dict]:
    """One row per (model, context, adaptation, head) with a clean cell, in the order of ``results["rows"]``.

    Keys (rates as fractions in [0, 1]; drops in accuracy points):

    - ``acc_clean``, ``acc_s{top}``, ``acc_s{top}_std``: accuracy on the clean test set and at the
      highest severity (mean, std over the benchmark corruptions);
    - ``drop``, ``drop_std``: ``Acc@0 - Acc@top`` of the mean accuracies [QACT, App. C, Tables 1-2],
      and the std over corruptions of the per-corruption drop;
    - ``ece_clean``, ``ece_s{top}``, ``ece_drift`` (``s{top}`` minus clean), ``ece_range`` (max - min of
      the mean top-label ECE over severities 0..top), ``ece_marginal_*``, ``nll_*``, ``r_auroc_*``,
      ``map_*`` (MAP@K at the largest K, ``map_k``): clean and at the highest severity;
    - ``acc_corrupted``, ``ece_corrupted``, ``nll_corrupted`` and ``*_corrupted`` of ``brier``, ``aurc``,
      ``r_auroc``, ``auroc_error``, ``map``: the mean over the benchmark corrupted cells
      (uncertainty-baselines' convention), from ``results["robustness"]`` where it has them;
    - ``mca``: the mean accuracy over the benchmark corruptions x severities (robustbench's mean corruption
      accuracy); ``mca_extra`` the same over the extra corruptions (``None`` without any); ``mce``,
      ``relative_mce`` from ``results["robustness"]`` (``None`` without);
    - ``partial``: the ``*_corrupted`` keys averaged over only the cells where the metric is defined
      (an AUROC is undefined in a cell without errors).
    """
    sevs = P.severities(results)
    top = sevs[-1] if sevs else None
    index = cell_index(results)
    bench, extra = benchmark_corruptions(results)
    robust = {series_key(r): r for r in results.get("robustness") or []}
    out = []
    for key, cells in index.items():
        clean = cells.get((CLEAN, 0))
        if clean is None:
            continue
        corrupted = [r for (c, s), r in cells.items() if c in bench and s != 0]
        curves = {
            m: {s: (mean, std) for s, mean, std, _ in severity_curve(results, key, m, index)}
            for m in ("accuracy", "ece_top_label", "ece_marginal", "nll", "r_auroc")
        }
        map_key = _largest_k(clean, "map_at_")
        row = {
            **series_fields(key),
            "acc_clean": clean.get("accuracy"),
            "ece_clean": clean.get("ece_top_label"),
            "ece_marginal_clean": clean.get("ece_marginal"),
            "nll_clean": clean.get("nll"),
            "r_auroc_clean": clean.get("r_auroc"),
            "auroc_error_clean": clean.get("auroc_error"),
            "brier_clean": clean.get("brier"),
            "aurc_clean": clean.get("aurc"),
            "map_clean": clean.get(map_key) if map_key else None,
            "map_k": int(map_key[len("map_at_") :]) if map_key else None,
        }
        if top is not None:
            t = f"s{top}"
            acc_top = curves["accuracy"].get(top, (None, None))
            drops = [d for c, d in P.per_corruption_drops(results, key, index).items() if c in bench]
            ece_means = [v[0] for v in curves["ece_top_label"].values()]
            ece_top = curves["ece_top_label"].get(top, (None, None))[0]
            acc_clean = as_number(row["acc_clean"])
            ece_clean = as_number(row["ece_clean"])
            row.update(
                {
                    f"acc_{t}": acc_top[0],
                    f"acc_{t}_std": acc_top[1],
                    "drop": None if acc_clean is None or acc_top[0] is None else 100.0 * (acc_clean - acc_top[0]),
                    "drop_std": P.mean_std(drops)[1],
                    f"ece_{t}": ece_top,
                    "ece_drift": None if ece_top is None or ece_clean is None else ece_top - ece_clean,
                    "ece_range": max(ece_means) - min(ece_means) if ece_means else None,
                    f"ece_marginal_{t}": curves["ece_marginal"].get(top, (None,))[0],
                    f"nll_{t}": curves["nll"].get(top, (None,))[0],
                    f"r_auroc_{t}": curves["r_auroc"].get(top, (None,))[0],
                    f"map_{t}": _mean_over(cells[(c, top)].get(map_key) for c in bench if (c, top) in cells)[0]
                    if map_key
                    else None,
                }
            )
        partial = []
        for name, metric in (
            ("acc", "accuracy"),
            ("ece", "ece_top_label"),
            ("nll", "nll"),
            ("brier", "brier"),
            ("aurc", "aurc"),
            ("r_auroc", "r_auroc"),
            ("auroc_error", "auroc_error"),
            ("map", map_key),
        ):
            if metric is None or not corrupted or all(metric not in r for r in corrupted):
                row[f"{name}_corrupted"] = None
                continue
            mean, n_def, n_all = _mean_over(r.get(metric) for r in corrupted)
            row[f"{name}_corrupted"] = mean
            if 0 < n_def < n_all:
                partial.append(f"{name}_corrupted")
        row["mca"] = _mean_over(cells[(c, s)].get("accuracy") for c in bench for s in sevs if (c, s) in cells)[0]
        row["mca_extra"] = (
            _mean_over(cells[(c, s)].get("accuracy") for c in extra for s in sevs if (c, s) in cells)[0]
            if extra
            else None
        )
        row["mce"] = row["relative_mce"] = None
        rob = robust.get(key)
        if rob is not None:
            for ours, theirs in (
                ("acc_corrupted", "corrupted_accuracy"),
                ("ece_corrupted", "corrupted_ece"),
                ("nll_corrupted", "corrupted_nll"),
                ("mca", "mca"),
                ("mca_extra", "mca_extra"),
                ("mce", "mce"),
                ("relative_mce", "relative_mce"),
            ):
                if theirs in rob:
                    row[ours] = rob[theirs]
                    if ours in partial:
                        partial.remove(ours)
        row["partial"] = partial
        out.append(row)
    return out


def headline_rows(results: dict) -> list[dict]:
    """The numbers a comparison lines up, one row per primary head: ``acc_clean``, ``mca``, ``drop``
    (points), ``ece_clean``, ``ece_corrupted``, ``mce``."""
    rows = {series_key(r): r for r in summary_rows(results)}
    keep = ("acc_clean", "mca", "drop", "ece_clean", "ece_corrupted", "mce")
    return [{**series_fields(k), **{f: rows[k].get(f) for f in keep}} for k in primary_keys(results) if k in rows]


def results_problems(results: dict, limit: int = 10) -> list[str]:
    """Values of ``results["rows"]`` that should be numbers (or null) and are not, each as
    ``rows[i].field = value``: in a metric the report knows, or in a field that holds numbers in other
    rows. At most ``limit`` of them, then a count of the rest."""
    rows = results.get("rows") or []
    numeric = {"severity", "n", *P.METRIC_LABELS}
    numeric |= {k for r in rows for k, v in r.items() if k not in _LABEL_FIELDS and as_number(v) is not None}
    found = [
        f"rows[{i}].{k} = {v!r}"
        for i, r in enumerate(rows)
        for k, v in r.items()
        if k in numeric and v is not None and as_number(v) is None
    ]
    if len(found) > limit:
        found = found[:limit] + [f"... and {len(found) - limit} more"]
    return found


# --------------------------------------------------------------------------- plain-text summary
def _summary_table(results: dict) -> tuple[list[str], list[list[str]]]:
    sevs = P.severities(results)
    top = sevs[-1] if sevs else None
    t = f"s{top}"
    rows = summary_rows(results)
    k = next((r["map_k"] for r in rows if r.get("map_k")), None)
    mapname = f"MAP@{k}" if k else "MAP"
    arms = _has_arms(results)
    head = [
        *_label_head(arms),
        "acc s0",
        f"acc {t}",
        f"drop 0→{top}",
        "ECE s0",
        f"ECE {t}",
        "ECE range",
        f"{mapname} s0",
        f"{mapname} {t}",
    ]
    body = []
    trans = _transductive(results)
    for r in rows:
        body.append(
            [
                *_label_cells(series_key(r), arms, trans),
                _fmt(r["acc_clean"]),
                _fmt(r.get(f"acc_{t}")),
                _pm(r.get("drop"), r.get("drop_std"), 1.0),
                _fmt(r["ece_clean"]),
                _fmt(r.get(f"ece_{t}")),
                _fmt(r.get("ece_range")),
                _fmt(r["map_clean"]),
                _fmt(r.get(f"map_{t}")),
            ]
        )
    return head, body


def format_summary(results: dict) -> str:
    """The summary table as plain text (printed at the end of ``shiftguard run``)."""
    head, body = _summary_table(results)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    labels = len(_label_head(_has_arms(results)))

    def line(cells):
        return "  ".join(c.ljust(w) if i < labels else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    d = results["data"]
    title = (
        f"{results.get('name')}: {d.get('dataset')}, {len(d.get('corruptions') or [])} corruptions x severities "
        f"{d.get('severities')} ({d.get('corruption_source')}); accuracy, ECE (top-label) and MAP in %, "
        f"drop in points = mean ± std over corruptions"
    )
    lines = [title, line(head), line(["-" * w for w in widths]), *(line(r) for r in body)]
    notes = _arm_notes(results)
    if notes:
        lines.append("* " + " ".join(notes))
    adv = P.adversarial_cells(results)
    if adv:
        lines.append("adversarial shift: accuracy / ECE (top-label) in % at each eps")
        for (model, ctx, _, head_name), per in adv.items():
            for attack, pts in per.items():
                cells = ", ".join(
                    f"{eps:.4g}: {_fmt(r.get('accuracy'))} / {_fmt(r.get('ece_top_label'))}" for eps, r in pts
                )
                lines.append(f"  {model} {ctx} {head_name} {attack}: {cells}")
    return "\n".join(lines)


def _arm_notes(results: dict) -> list[str]:
    """One sentence per transductive arm of ``results``: what it saw of each test cell before scoring it."""
    out = []
    for a in results.get("adaptation") or []:
        if not isinstance(a, dict) or not a.get("transductive"):
            continue
        passes, images = as_number(a.get("passes")), as_number(a.get("images"))
        seen = (
            f"{_int(passes)} pass(es) over the {_int(images)} unlabelled images of each cell"
            if passes is not None and images is not None
            else "the unlabelled images of each cell"
        )
        out.append(f"{a.get('name')}: transductive, it adapts on {seen} ({a.get('description')}).")
    return out


# --------------------------------------------------------------------------- files
def write_csv(path: Path, rows: list[dict]) -> Path:
    """Every result row, one line each (``CSV_FIXED`` columns first); ``None`` as an empty field."""
    return atomic_write_text(path, csv_text(rows))


def csv_text(rows: list[dict]) -> str:
    """The CSV of :func:`write_csv` as a string."""
    keys = list(CSV_FIXED)
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: _csv_cell(r.get(k)) for k in keys})
    return buf.getvalue()


def _csv_cell(v):
    """A value as a CSV field: ``None`` empty; text that a spreadsheet would read as a formula (a
    leading ``=``, ``+``, ``-``, ``@``, tab or carriage return) behind a ``'`` (OWASP's CSV
    injection rule); numbers as they are."""
    if v is None:
        return ""
    if isinstance(v, str) and v[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + v
    return v


#: The largest corruption gallery a report embeds (the ones shiftguard draws are well under 1 MB).
MAX_GALLERY_BYTES = 16 * 1024 * 1024
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def safe_png(path: Optional[Path], folder: Path) -> Optional[Path]:
    """``path`` when it is a PNG that a report may embed: a regular file (not a symbolic link) inside
    ``folder``, at most :data:`MAX_GALLERY_BYTES`, starting with the PNG signature; else None. A
    report inlines the file's bytes, so anything else (a link to a private file, a huge file) is
    left out."""
    if path is None:
        return None
    path = Path(path)
    try:
        if path.is_symlink() or not path.is_file():
            return None
        if Path(folder).resolve() not in path.resolve().parents:
            return None
        if path.stat().st_size > MAX_GALLERY_BYTES:
            return None
        with open(path, "rb") as fh:
            return path if fh.read(len(_PNG_SIGNATURE)) == _PNG_SIGNATURE else None
    except OSError:
        return None


def make_plots(out_dir: Path, results: dict, gallery: Optional[Path] = None) -> dict[str, Path]:
    """Write the report's figures into ``out_dir/plots``; ``gallery``: an existing corruption gallery PNG
    copied in (default: the one already in ``out_dir/plots``, if any). A gallery is embedded only when
    :func:`safe_png` accepts it (inside its own folder, or inside ``out_dir``)."""
    d = Path(out_dir) / "plots"
    metrics = {r_k for r in results["rows"] for r_k in r}
    out = {
        "accuracy": P.metric_vs_severity(results, "accuracy", d / "accuracy_vs_severity.png"),
        "ece_top_label": P.metric_vs_severity(results, "ece_top_label", d / "ece_vs_severity.png"),
        "ece_marginal": P.metric_vs_severity(results, "ece_marginal", d / "ece_marginal_vs_severity.png"),
        "nll": P.metric_vs_severity(results, "nll", d / "nll_vs_severity.png"),
    }
    if "brier" in metrics:
        out["brier"] = P.metric_vs_severity(results, "brier", d / "brier_vs_severity.png")
    out["drop_heatmap"] = P.drop_heatmap(results, d / "accuracy_drop_heatmap.png")
    if P.adversarial_cells(results):
        out["adversarial_accuracy"] = P.metric_vs_eps(results, "accuracy", d / "accuracy_vs_attack_eps.png")
        out["adversarial_ece"] = P.metric_vs_eps(results, "ece_top_label", d / "ece_vs_attack_eps.png")
    if results.get("reliability"):
        out["reliability"] = P.reliability_diagrams(results, d / "reliability_diagrams.png")
        out["reliability_every_head"] = P.reliability_every_head(results, d / "reliability_every_head.png")
    sets = results.get("conformal") or {}
    for m in sets.get("methods") or []:
        for variant in ("", "_weighted"):
            cov, size = f"coverage_{m}{variant}", f"set_size_{m}{variant}"
            if cov in metrics:
                out[cov] = P.metric_vs_severity(
                    results, cov, d / f"{cov}_vs_severity.png", target=as_number(sets.get("target_coverage"))
                )
                out[size] = P.metric_vs_severity(results, size, d / f"{size}_vs_severity.png")
    target = d / "corruption_gallery.png"
    source = safe_png(gallery, Path(gallery).parent.parent) if gallery is not None else None
    if source is not None and source.resolve() != target.resolve():
        atomic_write_bytes(target, source.read_bytes())
    if safe_png(target, Path(out_dir)) is not None:
        out["gallery"] = target
    return out


def build_report(
    run_dir: Path,
    results: dict,
    progress: bool = False,
    *,
    gallery: Optional[Path] = None,
    source: Optional[str] = None,
) -> Path:
    """Write ``results.csv``, ``plots/`` and ``report.html`` for ``results`` into ``run_dir``; return the
    page's path.

    ``gallery``: a corruption gallery PNG to include (copied into ``plots/``); ``source``: where the
    results came from, shown in the page (default: ``results.json`` in the same folder). ``progress``
    is accepted for the callers' signature and draws nothing. Raises ``KeyError`` when ``results`` lacks
    ``data`` or ``rows``."""
    run_dir = Path(run_dir)
    write_csv(run_dir / "results.csv", results["rows"])
    plots = make_plots(run_dir, results, gallery=gallery)
    return atomic_write_text(run_dir / "report.html", render_html(results, plots, source=source))


# --------------------------------------------------------------------------- HTML pieces
def _e(v) -> str:
    return html.escape(str(v), quote=True)


def _img(path: Path, caption: str) -> str:
    b64 = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return (
        f'<figure><img alt="{_e(caption)}" src="data:image/png;base64,{b64}">'
        f"<figcaption>{_e(caption)}</figcaption></figure>"
    )


def _table(head: Sequence[str], body: Sequence[Sequence[str]], left: int = 3) -> str:
    """Every header and cell is escaped here; the first ``left`` columns are labels (left-aligned)."""

    def cell(tag, i, c):
        return f'<{tag} class="l">{_e(c)}</{tag}>' if i < left else f"<{tag}>{_e(c)}</{tag}>"

    th = "".join(cell("th", i, h) for i, h in enumerate(head))
    trs = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(r)) + "</tr>" for r in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1250px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
.l{text-align:left}th{background:#f3f3f3}figure{margin:1.5em 0}
img{max-width:100%}figcaption{font-size:12px;color:#555}code,pre{background:#f6f6f6;padding:2px 4px}
.small{font-size:12px;color:#555}.warn{border:2px solid #c60;background:#fff4e5;padding:.5em 1em;margin:1em 0}"""


def _interval_map(results: dict) -> dict[tuple, dict]:
    return {(*series_key(i), i.get("metric")): i for i in results.get("intervals") or []}


def _interval_sentence(results: dict) -> str:
    if not results.get("intervals"):
        return ""
    info = results.get("interval_info") or {}
    if not info:
        return (
            "<b>x [lo, hi]</b> is the estimate x followed by a confidence interval; results.json does not "
            "describe how it was computed."
        )
    level = as_number(info.get("level"))
    what = ", ".join(
        _e(x)
        for x in (
            f"{level * 100:g}% confidence interval"
            if level is not None
            else f"confidence interval (level {info.get('level')})",
            info.get("method"),
            f"{_int(info['n_boot'])} resamples" if "n_boot" in info else None,
            f"seed {info['seed']}" if "seed" in info else None,
        )
        if x
    )
    out = (
        f"<b>x [lo, hi]</b> is the estimate x followed by its {what}, in the unit of its column; x is the "
        f"number the interval is about."
    )
    metrics = info.get("metrics")
    if isinstance(metrics, dict) and metrics:
        out += " Estimates: " + "; ".join(f"<i>{_e(k)}</i> = {_e(v)}" for k, v in metrics.items()) + "."
    return out


def _units_note(results: dict, rows: list[dict]) -> str:
    parts = [
        "Every rate (accuracy, ECE, AUROC, MAP, recall, AURC) is in %; NLL and Brier score are plain numbers; "
        "drops are in accuracy points.",
        "<b>a ± b</b> is the mean and the standard deviation (ddof = 0) over the benchmark corruptions at one "
        "severity.",
        "<b>corrupted</b> = the mean over the benchmark corruptions × severities (uncertainty-baselines' "
        "convention; for accuracy this is the mean corruption accuracy, mCA); extra corruptions are "
        "reported apart.",
    ]
    if any(r.get("partial") for r in rows):
        parts.append(
            "<b>†</b>: the metric is undefined in some corrupted cells (an AUROC of a cell without "
            "errors); the mean is over the cells where it is defined."
        )
    ci = _interval_sentence(results)
    if ci:
        parts.append(ci)
    return "<p class='small'>" + " ".join(parts) + "</p>"


def _cell(r: dict, key: str, scale: float = 100.0, nd: int = 1, ci: Optional[dict] = None) -> str:
    text = _ci(r.get(key), ci, scale, nd)
    return text + " †" if key in r.get("partial", ()) else text


def _summary_tables(results: dict, rows: list[dict]) -> str:
    sevs = P.severities(results)
    top = sevs[-1] if sevs else None
    t = f"s{top}"
    _, extra = benchmark_corruptions(results)
    ivs = _interval_map(results)
    has = lambda k: any(r.get(k) is not None for r in rows)
    cols = [("acc clean", lambda r, c: _cell(r, "acc_clean", ci=c("accuracy_clean")))]
    cols.append(("acc corrupted", lambda r, c: _cell(r, "acc_corrupted", ci=c("accuracy_corrupted"))))
    if extra:
        cols.append(("acc extra corruptions", lambda r, c: _cell(r, "mca_extra")))
    if top is not None:
        cols += [
            (f"acc {t}", lambda r, c: _pm(r.get(f"acc_{t}"), r.get(f"acc_{t}_std"))),
            (f"drop 0→{top}", lambda r, c: _pm(r.get("drop"), r.get("drop_std"), 1.0)),
        ]
    cols.append(("ECE clean", lambda r, c: _cell(r, "ece_clean", ci=c("ece_clean"))))
    pooled = any(k[4] == "ece_corrupted" for k in ivs)
    if pooled:
        # The interval's estimate pools the corrupted cells into one ECE, which differs from the mean
        # of the per-cell ECEs: the summary shows the pooled one with its interval, the details the mean.
        cols.append(
            ("ECE corrupted, pooled", lambda r, c: _ci(None, c("ece_corrupted")) if c("ece_corrupted") else "—")
        )
    else:
        cols.append(("ECE corrupted", lambda r, c: _cell(r, "ece_corrupted")))
    if top is not None:
        cols += [(f"ECE {t}", lambda r, c: _cell(r, f"ece_{t}")), ("ECE range", lambda r, c: _cell(r, "ece_range"))]
    cols += [
        ("NLL clean", lambda r, c: _cell(r, "nll_clean", 1.0, 3)),
        ("NLL corrupted", lambda r, c: _cell(r, "nll_corrupted", 1.0, 3)),
    ]
    second = [("ECE corrupted, mean of cells", "ece_corrupted", 100.0, 1)] if pooled else []
    second += [
        ("R-AUROC clean", "r_auroc_clean", 100.0, 1),
        ("R-AUROC corrupted", "r_auroc_corrupted", 100.0, 1),
        ("error-AUROC clean", "auroc_error_clean", 100.0, 1),
        ("error-AUROC corrupted", "auroc_error_corrupted", 100.0, 1),
        ("Brier clean", "brier_clean", 1.0, 4),
        ("Brier corrupted", "brier_corrupted", 1.0, 4),
        ("AURC clean", "aurc_clean", 100.0, 2),
        ("AURC corrupted", "aurc_corrupted", 100.0, 2),
    ]
    k = next((r["map_k"] for r in rows if r.get("map_k")), None)
    if k:
        second += [(f"MAP@{k} clean", "map_clean", 100.0, 1), (f"MAP@{k} corrupted", "map_corrupted", 100.0, 1)]
    second = [s for s in second if has(s[1])]

    arms = _has_arms(results)
    trans = _transductive(results)
    labels = _label_head(arms)

    def body(columns):
        out = []
        for r in rows:
            key = series_key(r)
            c = lambda m: ivs.get((*key, m))
            out.append([*_label_cells(key, arms, trans), *(f(r, c) for _, f in columns)])
        return out

    first = _table([*labels, *(h for h, _ in cols)], body(cols), left=len(labels))
    if not second:
        return first
    cols2 = [(h, (lambda key, sc, nd: lambda r, c: _cell(r, key, sc, nd))(key, sc, nd)) for h, key, sc, nd in second]
    return (
        first
        + "<h3>Uncertainty and retrieval</h3>"
        + _table([*labels, *(h for h, _ in cols2)], body(cols2), left=len(labels))
    )


def _per_corruption_table(results: dict) -> str:
    sevs = P.severities(results)
    keys = primary_keys(results)
    if not sevs or not keys:
        return "<p>No corrupted cells.</p>"
    top = sevs[-1]
    index = cell_index(results)
    bench, extra = benchmark_corruptions(results)
    head = ["corruption"]
    for k in keys:
        head += [f"{_key_label(*k)}: mean s{sevs[0]}–{top}", f"{_key_label(*k)}: s{top}"]

    def row(label, corrs):
        out = [label]
        for k in keys:
            cells = index.get(k, {})
            over_sevs = (cells[(c, s)].get("accuracy") for c in corrs for s in sevs if (c, s) in cells)
            out.append(_fmt(_mean_over(over_sevs)[0]))
            out.append(_fmt(_mean_over(cells[(c, top)].get("accuracy") for c in corrs if (c, top) in cells)[0]))
        return out

    body = [row(str(c), [c]) for c in bench] + [row("mean (benchmark corruptions)", bench)]
    body += [row(f"{c} (extra)", [c]) for c in extra]
    if extra:
        body.append(row("mean (extra corruptions)", extra))
    return _table(head, body, left=1)


def _per_severity_table(results: dict, metric: str) -> str:
    sevs = P.severities(results)
    index = cell_index(results)
    scale = 100.0 if P.is_rate(metric) else 1.0
    nd = 1 if P.is_rate(metric) else 3
    arms = _has_arms(results)
    trans = _transductive(results)
    head = [*_label_head(arms), "clean", *(f"s{s}" for s in sevs)]
    body = []
    for key in index:
        pts = {s: (m, sd) for s, m, sd, _ in severity_curve(results, key, metric, index)}
        cells = [_fmt(pts[0][0], scale, nd) if 0 in pts else "—"]
        cells += [_pm(*pts[s], scale, nd) if s in pts else "—" for s in sevs]
        body.append([*_label_cells(key, arms, trans), *cells])
    return _table(head, body, left=len(_label_head(arms)))


#: Accuracy above chance, in points, that an undefended model should not keep under an iterative
#: white-box attack at a budget of at least :data:`_LARGE_EPS` (pixel units of [0, 1] images): at
#: 0.1 L-inf the standard PGD removes all accuracy of every undefended MNIST / CIFAR model in the
#: literature (Madry et al. 2018; Carlini et al. 2019, "On evaluating adversarial robustness").
_KEPT_POINTS = 10.0
_LARGE_EPS = 0.1


def _first_lower(
    points: list[tuple[float, float]], reference: list[tuple[float, float]]
) -> Optional[tuple[float, float, float]]:
    """The first ``(eps, accuracy, reference accuracy)`` at which ``points`` is more than a point
    below ``reference`` at the same budget (accuracies in %); ``None`` where it never is."""
    ref = dict(reference)
    return next(((e, v, ref[e]) for e, v in points if e in ref and v < ref[e] - 1.0), None)


def masking_signs(results: dict) -> list[str]:
    """Signs of gradient masking in the adversarial cells (Athalye, Carlini & Wagner 2018, Sec. 3.1;
    Carlini et al. 2019, Sec. 5): per series, (1) a one-step attack (FGSM) removes more accuracy
    than an iterative one (BIM / PGD, same norm) at the same budget, (2) accuracy rises with the
    budget under an attack, (3) an iterative L-inf attack at a budget >= ``_LARGE_EPS`` leaves
    more than ``_KEPT_POINTS`` points above chance. One sentence per sign found."""
    cells = P.adversarial_cells(results)
    raw = results["data"].get("attacks")
    attacks: dict = raw if isinstance(raw, dict) else {}
    k = as_number(results["data"].get("num_classes"))
    chance = 100.0 / k if k else None
    out = []
    for key, per in cells.items():
        label = _e(_key_label(*key))
        # accuracy in % per attack: (eps, accuracy) of the cells whose both values are numbers
        acc: dict[str, list[tuple[float, float]]] = {}
        for a, pts in per.items():
            acc[a] = []
            for eps, r in pts:
                e, v = as_number(eps), as_number(r.get("accuracy"))
                if e is not None and v is not None:
                    acc[a].append((e, 100.0 * v))
        kind: dict[str, dict] = {a: attacks[a] for a in acc if isinstance(attacks.get(a), dict)}
        for a, vals in acc.items():
            rises = [(e1, v0, v1) for (_, v0), (e1, v1) in zip(vals, vals[1:]) if v1 > v0 + 1.0]
            if rises:
                e1, v0, v1 = rises[0]
                out.append(
                    f"{label}: accuracy under {_e(a)} rises with the budget ({v0:.1f}% → {v1:.1f}% at eps {e1:.4g})"
                )
            spec = kind.get(a, {})
            iterative = spec.get("attack") in ("bim", "pgd") and not spec.get("transfer")
            if iterative and spec.get("norm", "linf") == "linf" and chance is not None:
                big = [(e, v) for e, v in vals if e >= _LARGE_EPS and v > chance + _KEPT_POINTS]
                if big:
                    e, v = big[-1]
                    out.append(
                        f"{label}: keeps {v:.1f}% under {_e(a)} at eps {e:.4g} (chance {chance:.1f}%), "
                        "a budget at which an iterative white-box attack leaves an undefended model at "
                        "chance"
                    )
        one = [a for a in kind if kind[a].get("attack") == "fgsm" and not kind[a].get("transfer")]
        multi = [a for a in kind if kind[a].get("attack") in ("bim", "pgd") and not kind[a].get("transfer")]
        for a1 in one:
            for am in multi:
                if kind[a1].get("norm", "linf") != kind[am].get("norm", "linf"):
                    continue
                worse = _first_lower(acc[a1], acc[am])
                if worse:
                    e, v1, vm = worse
                    out.append(
                        f"{label}: one-step {_e(a1)} ({v1:.1f}%) beats iterative {_e(am)} ({vm:.1f}%) at eps {e:.4g}"
                    )
        for at, spec in kind.items():
            base, src = at.partition("@")[0], spec.get("source")
            if not spec.get("transfer") or src == key[0] or base not in acc:
                continue
            beaten = _first_lower(acc[at], acc[base])
            if beaten:
                e, v, w = beaten
                out.append(
                    f"{label}: images made on {_e(src)} ({_e(at)}, {v:.1f}%) remove more accuracy than "
                    f"its own white-box {_e(base)} ({w:.1f}%) at eps {e:.4g}"
                )
    return out


def _adversarial_section(results: dict) -> str:
    """Accuracy of every head under each attack and budget as a pivot (rows the series, columns
    attack x eps), the signs of gradient masking found (:func:`masking_signs`), and every metric
    (accuracy, top-label ECE, NLL, R-AUROC) per cell in a folded table ([NED, Sec. 5]); empty
    without attacks."""
    cells = P.adversarial_cells(results)
    if not cells:
        return ""
    index = cell_index(results)
    arms = _has_arms(results)
    cols = list(dict.fromkeys((a, eps) for per in cells.values() for a, pts in per.items() for eps, _ in pts))
    pivot_head = [*_label_head(arms), "clean", *(f"{a} {eps:.4g}" for a, eps in cols)]
    pivot = []
    for key, per in cells.items():
        at = {(a, eps): r for a, pts in per.items() for eps, r in pts}
        clean = index.get(key, {}).get((CLEAN, 0)) or {}
        pivot.append(
            [
                *_label_cells(key, arms),
                _fmt(clean.get("accuracy")),
                *(_fmt(at[c].get("accuracy")) if c in at else "—" for c in cols),
            ]
        )
    metrics = (
        ("accuracy", "acc (%)", 100.0, 1),
        ("ece_top_label", "ECE (%)", 100.0, 1),
        ("nll", "NLL", 1.0, 3),
        ("r_auroc", "R-AUROC", 1.0, 3),
    )
    head = [*_label_head(arms), "attack", "eps", *(label for _, label, _, _ in metrics)]
    body = []
    for key, per in cells.items():
        clean_row = index.get(key, {}).get((CLEAN, 0))
        if clean_row is not None:
            body.append(
                [
                    *_label_cells(key, arms),
                    "none (clean)",
                    "0",
                    *(_fmt(clean_row.get(m), sc, nd) for m, _, sc, nd in metrics),
                ]
            )
        for attack, pts in per.items():
            for eps, r in pts:
                body.append(
                    [
                        *_label_cells(key, arms),
                        attack,
                        f"{eps:.4g}",
                        *(_fmt(r.get(m), sc, nd) for m, _, sc, nd in metrics),
                    ]
                )
    attacks = results["data"].get("attacks")
    attacks = attacks if isinstance(attacks, dict) else {}
    desc = "; ".join(
        (f"{_e(n)}: {_e(a.get('steps'))} steps" if a.get("attack") != "fgsm" else f"{_e(n)}: one step")
        + (f", images made on {_e(a.get('source'))} (transfer)" if a.get("transfer") else "")
        for n, a in attacks.items()
        if isinstance(a, dict)
    )
    signs = masking_signs(results)
    transfer = any(isinstance(a, dict) and a.get("transfer") for a in attacks.values())
    caveat = ""
    if signs:
        caveat = (
            "<div class='warn'><b>Possible gradient masking.</b> Accuracy kept under a white-box attack is "
            "evidence of robustness only when the attack's gradient is informative (Athalye, Carlini &amp; "
            "Wagner 2018). Signs found:<ul>"
            + "".join(f"<li>{s}</li>" for s in signs)
            + "</ul>A model whose forward is piecewise constant in its input (QACT's quantiles) is attacked "
            "through a surrogate gradient. "
            + (
                "Where images made on another model (a transfer attack, columns <code>attack@model</code>) "
                "remove more accuracy than the model's own white-box attack, its gradient is uninformative "
                "and the kept accuracy is masking, not robustness.</div>"
                if transfer
                else "A transfer attack (<code>transfer_from=</code>, <code>[eval] transfer_from</code>) is "
                "needed before this accuracy can be read as robustness.</div>"
            )
        )
    return (
        "<h2>Adversarial shift</h2><p class='small'>White-box attacks on each model in each context (eps in "
        f"pixel units of images in [0, 1]; {desc}); every head is scored on the same adversarial images. "
        "Not part of any corruption mean; scored without test-time adaptation.</p>"
        + caveat
        + "<h3>Accuracy (%) per attack and budget</h3>"
        + _table(pivot_head, pivot, left=len(_label_head(arms)))
        + "<details><summary>Every metric per cell</summary>"
        + _table(head, body, left=len(head) - len(metrics))
        + "</details>"
    )


def _robustness_section(results: dict) -> str:
    rob = results.get("robustness") or []
    if not rob:
        return ""
    has_extra = any(r.get("mca_extra") is not None for r in rob)
    arms = _has_arms(results)
    trans = _transductive(results)
    # mCA is the mean accuracy over the corrupted cells (the summary's "acc corrupted"): one column
    head = [
        *_label_head(arms),
        "baseline",
        "mCA",
        *(["mCA (extra)"] if has_extra else []),
        "ECE corrupted",
        "NLL corrupted",
        "mCE",
        "relative mCE",
    ]
    body = []
    for r in rob:
        body.append(
            [
                *_label_cells(series_key(r), arms, trans),
                "—" if r.get("baseline") is None else str(r.get("baseline")),
                _fmt(r.get("mca")),
                *([_fmt(r.get("mca_extra"))] if has_extra else []),
                _fmt(r.get("corrupted_ece")),
                _plain(r.get("corrupted_nll")),
                _fmt(r.get("mce")),
                _fmt(r.get("relative_mce")),
            ]
        )
    baselines = list(dict.fromkeys(str(r["baseline"]) for r in rob if r.get("baseline") is not None))
    if baselines:
        note = (
            f"Corruption errors relative to the baseline {_e(', '.join(baselines))} (Hendrycks &amp; Dietterich "
            "2019, Sec. 3): CE<sub>c</sub> = Σ<sub>s</sub> E<sub>s,c</sub> / "
            "Σ<sub>s</sub> E<sup>base</sup><sub>s,c</sub>, "
            "relative CE<sub>c</sub> = Σ<sub>s</sub> (E<sub>s,c</sub> − E<sub>clean</sub>) / Σ<sub>s</sub> "
            "(E<sup>base</sup><sub>s,c</sub> − E<sup>base</sup><sub>clean</sub>); mCE and relative mCE are their "
            "means over the benchmark corruptions, in %: 100% = the baseline's errors, lower is better."
        )
    else:
        note = "No baseline model was given, so no corruption errors (mCE) are reported."
    out = (
        f"<h2>Robustness: mean corruption accuracy and mCE</h2><p class='small'>mCA = mean accuracy over the "
        f"benchmark corruptions × severities (robustbench's convention). {note}</p>"
        + _table(head, body, left=len(_label_head(arms)))
    )
    with_ce = [r for r in rob if r.get("ce")]
    if with_ce:
        corrs = list(dict.fromkeys(c for r in with_ce for c in r["ce"]))
        head = ["corruption"]
        for r in with_ce:
            lab = _key_label(*series_key(r))
            head += [f"{lab}: CE", f"{lab}: relative CE"]
        body = [
            [str(c), *(v for r in with_ce for v in (_fmt(r["ce"].get(c)), _fmt((r.get("relative_ce") or {}).get(c))))]
            for c in corrs
        ]
        out += "<h3>Corruption error per corruption (%)</h3>" + _table(head, body, left=1)
    return out


def _intervals_table(results: dict) -> str:
    ivs = results.get("intervals") or []
    if not ivs:
        return ""
    body = []
    arms = _has_arms(results)
    trans = _transductive(results)
    for i in ivs:
        rate = P.is_rate(str(i.get("metric")).rsplit("_", 1)[0])
        sc, nd = (100.0, 2) if rate else (1.0, 4)
        body.append(
            [
                *_label_cells(series_key(i), arms, trans),
                str(i.get("metric")),
                _fmt(i.get("estimate"), sc, nd),
                _fmt(i.get("lo"), sc, nd),
                _fmt(i.get("hi"), sc, nd),
            ]
        )
    labels = _label_head(arms)
    return (
        "<h2>Confidence intervals</h2><p class='small'>"
        + _interval_sentence(results)
        + "</p>"
        + _table([*labels, "metric", "estimate", "lo", "hi"], body, left=len(labels) + 1)
    )


def _skipped_section(results: dict) -> str:
    sk = results.get("skipped_heads") or []
    ska = results.get("skipped_adaptations") or []
    out = ""
    if sk:
        body = [[str(s.get("model")), str(s.get("head")), str(s.get("reason"))] for s in sk]
        out += (
            "<h2>Skipped heads</h2><p class='small'>These heads were asked for and not evaluated; they have no "
            "numbers in this report.</p>" + _table(["model", "head", "reason"], body, left=3)
        )
    if ska:
        body = [[str(s.get("model")), str(s.get("adaptation")), str(s.get("reason"))] for s in ska]
        out += (
            "<h2>Skipped adaptation arms</h2><p class='small'>These test-time adaptation arms were asked for and "
            "could not act on the model; they have no numbers in this report.</p>"
            + _table(["model", "adaptation", "reason"], body, left=3)
        )
    return out


def _training_section(results: dict) -> str:
    training = results.get("training") or {}
    if not training:
        return ""
    train_s = (results.get("timings") or {}).get("train_s") or {}
    body = []
    for name, t in training.items():
        t = t or {}
        params = as_number(t.get("parameters"))
        body.append(
            [
                str(name),
                f"{int(params):,}" if params is not None else _fmt(t.get("parameters"), 1.0, 0),
                _int(t.get("epochs_run")),
                _int(t.get("best_epoch")),
                _fmt(t.get("best_val_acc"), 100.0, 2),
                _fmt(train_s.get(name), 1.0, 1),
            ]
        )
    return "<h2>Training</h2>" + _table(
        ["model", "params", "epochs", "best epoch", "best val acc (%)", "train s"], body, left=1
    )


def _ece_bins(results: dict):
    cfg = results.get("config") or {}
    bins = (cfg.get("eval") or {}).get("ece_bins") if isinstance(cfg, dict) else None
    if bins is None and results.get("reliability"):
        bins = len(results["reliability"][0].get("edges") or []) - 1
    return bins


def _data_paragraph(results: dict) -> str:
    d = results["data"]
    sevs = d.get("severities") or []
    bench, extra = benchmark_corruptions(results)
    parts = [f"Dataset <b>{_e(d.get('dataset'))}</b>"]
    if d.get("suite") is not None:
        parts.append(f", corruption suite <b>{_e(d['suite'])}</b>")
    # n_support (the heads' support set) is not the model's training data; results written before
    # n_support existed call the support set n_train.
    sizes = (
        (("n_train", "model training"), ("n_support", "support (the heads are fitted on them)"))
        if "n_support" in d
        else (("n_train", "train"),)
    ) + (("n_val", "validation"), ("n_test", "test"))
    counts = [f"{_e(_int(d[k]))} {label}" for k, label in sizes if d.get(k) is not None]
    if counts:
        parts.append(": " + " / ".join(counts) + " images")
    if "n_support" in d and d.get("n_train") is None and results.get("kind") != "run":
        parts.append("; the images the model was trained on: not known (it was trained outside this evaluation)")
    parts.append(
        f"; {len(bench)} corruptions × severities {_e(', '.join(_int(s) for s in sevs))} "
        f"({_e(d.get('corruption_source'))} corruptions)."
    )
    if extra:
        parts.append(f" Extra corruptions, reported apart and not in any mean: {_e(', '.join(map(str, extra)))}.")
    ctxs = {r["context"] for r in results["rows"]}
    fitted = (
        "Heads are fitted on clean support embeddings only [QACT, Sec. 4, Remark]."
        if "n_support" in d and results.get("kind") != "run"
        else "Heads are fitted on clean training embeddings only [QACT, Sec. 4, Remark]."
    )
    parts.append(" " + fitted)
    if ctxs & {"batch", "frozen"}:
        cfg = results.get("config") or {}
        bs = (cfg.get("eval") or {}).get("batch_size") if isinstance(cfg, dict) else None
        size = f" ({_e(_int(bs))} images)" if bs is not None else ""
        parts.append(
            f" QACT models use the test batch as context{size}; the <i>frozen</i> rows use the training "
            "context instead."
        )
    if _has_arms(results):
        parts.append(
            " Test-time adaptation arms are scored side by side (the <i>adaptation</i> column; "
            "<i>none</i> = the static model); every arm starts each cell from the trained model, and the "
            "heads fitted on the static model's clean training embeddings score every arm."
        )
        for note in _arm_notes(results):
            parts.append(" * " + _e(note))
    return "<p>" + "".join(parts) + "</p>"


def _provenance(results: dict, source: Optional[str]) -> str:
    """Where the numbers come from: seed, device, time, the config file (a run), the time spent
    (training only where something was trained), the command, what ``shiftguard evaluate`` recorded
    (weights and their SHA-256, normalisation, dataset folder), the preprocessing and the versions.
    A field that does not apply to this kind of result is left out, never shown as a placeholder."""
    t = results.get("timings") or {}
    train_s = t.get("train_s") or {}
    bits = [
        f"seed {_e(results.get('seed'))}",
        f"device {_e(results.get('device'))}",
        f"created {_e(results.get('created'))}",
    ]
    if results.get("config_source") is not None:
        bits.append(f"config {_e(results.get('config_source'))}")
    if t.get("total_s") is not None:
        if isinstance(train_s, dict) and train_s:
            train = sum(x for x in (as_number(v) for v in train_s.values()) if x is not None)
            bits.append(
                f"total {_e(_fmt(t.get('total_s'), 1.0, 0))} s (training {train:.0f} s, evaluation "
                f"{_e(_fmt(t.get('evaluate_s'), 1.0, 0))} s)"
            )
        else:
            bits.append(f"evaluation {_e(_fmt(t.get('total_s'), 1.0, 0))} s")
    lines = []
    if results.get("command"):
        lines.append(f"command: <code>{_e(results['command'])}</code>")
    rec = results.get("record")
    rec = rec if isinstance(rec, dict) else {}
    if "weights" in rec:
        w = rec["weights"]
        lines.append(
            f"weights: <code>{_e(w.get('path'))}</code>, SHA-256 <code>{_e(w.get('sha256'))}</code>"
            if isinstance(w, dict)
            else "weights: none (the factory's initialisation, --random-weights)"
        )
    cfg = results.get("config")
    if isinstance(cfg, dict) and "preprocess" in cfg:
        pre = "none (pixels in [0, 1])" if cfg["preprocess"] is None else f"<code>{_e(cfg['preprocess'])}</code>"
        norm = rec.get("normalize")
        if isinstance(norm, dict):
            pre += f" (--normalize: mean {_e(norm.get('mean'))}, std {_e(norm.get('std'))})"
        lines.append(f"preprocessing after corruption: {pre}")
    if rec.get("root") is not None:
        lines.append(f"dataset folder: <code>{_e(rec['root'])}</code>")
    lines.append(f"versions: {_e(json.dumps(results.get('versions')))}")
    src = f"<code>{_e(source)}</code>" if source is not None else "<code>results.json</code> in this folder"
    return (
        f"<h2>Provenance</h2><p class='small'>{'; '.join(bits)}.<br>{'<br>'.join(lines)}</p>"
        f"<p class='small'>All numbers: {src}; every cell in <code>results.csv</code> in this folder.</p>"
    )


def _problems_box(results: dict) -> str:
    probs = results_problems(results)
    if not probs:
        return ""
    items = "".join(f"<li><code>{_e(p)}</code></li>" for p in probs)
    return (
        f"<div class='warn'><b>results.json has values that are not numbers where numbers belong.</b> They are "
        f"shown as text in the tables and left out of every mean and figure:<ul>{items}</ul></div>"
    )


_CAPTIONS = {
    "accuracy": "Accuracy (%) vs severity: mean ± std over the benchmark corruptions (band clipped to 0–100%); "
    "severity 0 = clean test set.",
    "ece_top_label": "Top-label ECE (%) vs severity: flat = calibration that survives the shift.",
    "ece_marginal": "Marginal ECE (%) vs severity.",
    "nll": "NLL vs severity (band clipped at 0).",
    "brier": "Brier score vs severity (band clipped at 0).",
    "drop_heatmap": "Accuracy drop (points) clean → highest severity per corruption, primary heads.",
    "reliability": "Reliability diagrams of the primary heads (and NED / kNN), clean vs highest severity pooled over "
    "corruptions; below each, the number of images per confidence bin (log scale, dotted at "
    f"{P.FEW_IMAGES}). An empty bin has no bar; a bin of fewer than {P.FEW_IMAGES} images is a "
    "hatched outline.",
    "reliability_every_head": "Reliability diagrams of every head that was scored, one row per model, context and "
    "adaptation arm, one column per head.",
    "gallery": "The corruptions at each severity on one test image.",
    "adversarial_accuracy": "Accuracy (%) under each attack vs its budget eps (pixel units of [0, 1] images), "
    "one line per head and attack; eps 0 = clean test set.",
    "adversarial_ece": "Top-label ECE (%) under each attack vs its budget eps.",
    "coverage": "Coverage (%) of the conformal prediction sets vs severity, one line per head; dashed: the "
    "target 1 - alpha the sets guarantee on clean (exchangeable) data.",
    "set_size": "Mean size of the conformal prediction sets vs severity.",
}


def _caption(key: str) -> str:
    if key in _CAPTIONS:
        return _CAPTIONS[key]
    for prefix, cap in (("coverage_", "coverage"), ("set_size_", "set_size")):
        if key.startswith(prefix):
            return f"{P.metric_label(key)}: " + _CAPTIONS[cap]
    return key


def _conformal_section(results: dict) -> str:
    """Coverage and set size of every series' prediction sets at each severity (rates in %)."""
    sets = results.get("conformal") or {}
    methods = sets.get("methods") or []
    if not methods:
        return ""
    index = cell_index(results)
    sevs = P.severities(results)
    arms = _has_arms(results)
    trans = _transductive(results)
    variants = ["", "_weighted"] if sets.get("weighted") else [""]
    head = [*_label_head(arms), "method"]
    for s in (0, *sevs):
        head += [f"coverage s{s}", f"size s{s}"]
    body = []
    for key in index:
        for m in methods:
            for v in variants:
                cells = []
                for sev in (0, *sevs):
                    pts = {x[0]: x[1] for x in severity_curve(results, key, f"coverage_{m}{v}", index)}
                    sz = {x[0]: x[1] for x in severity_curve(results, key, f"set_size_{m}{v}", index)}
                    cells += [_fmt(pts.get(sev)), _fmt(sz.get(sev), 1.0, 2)]
                body.append([*_label_cells(key, arms, trans), m + (" (weighted)" if v else ""), *cells])
    target = as_number(sets.get("target_coverage"))
    cal = _e(sets.get("calibration"))
    note = (
        f"Split conformal prediction sets at target coverage {_fmt(target)}%, calibrated on {cal} "
        f"({_e(_int(sets.get('n_calibration')))} images) with each head's probabilities on clean data; "
        "coverage = the share of test images whose set holds the label, size = the mean number of labels "
        "per set; at severities above 0, means over the benchmark corruptions. The guarantee holds for "
        "exchangeable data only: below the target under shift is what the shift costs."
    )
    if sets.get("weighted"):
        note += (
            " <i>weighted</i>: the weighted split conformal of Tibshirani et al. (2019), with a likelihood "
            "ratio estimated on each unlabelled cell (transductive)."
        )
    out = (
        "<h2>Conformal prediction sets</h2><p class='small'>"
        + note
        + "</p>"
        + _table(head, body, left=len(_label_head(arms)) + 1)
    )
    # per corruption: the coverage at the highest severity of every series, one table per method
    bench, _ = benchmark_corruptions(results)
    if sevs and bench:
        top = sevs[-1]
        keys = list(index)
        for m in methods:
            for v in variants:
                metric = f"coverage_{m}{v}"
                chead = ["corruption", *(_key_label(*k) for k in keys)]
                cbody = [[str(c), *(_fmt(index[k].get((c, top), {}).get(metric)) for k in keys)] for c in bench]
                out += f"<h3>{_e(P.metric_label(metric))} (%) at severity {_e(top)}, per corruption</h3>" + _table(
                    chead, cbody, left=1
                )
    return out


def render_html(results: dict, plots: dict[str, Path], source: Optional[str] = None) -> str:
    """The self-contained page (figures inlined as base64 PNG) of one results dict."""
    rows = summary_rows(results)
    kind = results.get("kind") or "run"
    bins = _ece_bins(results)
    figs = "".join(_img(p, _caption(k)) for k, p in plots.items())
    sevs = P.severities(results)
    top = sevs[-1] if sevs else None
    ece_note = f"ECE is top-label with {_e(_int(bins))} equal-width bins" if bins is not None else "ECE is top-label"
    drop_note = (
        f" drop = Acc@0 − Acc@{_e(top)} of the mean accuracies [QACT, Tables 1–2], ± the std over "
        f"corruptions of the per-corruption drop; ECE range = max − min of the mean ECE over severities "
        f"0–{_e(top)}."
        if top is not None
        else ""
    )
    sev_tables = ""
    if sevs:
        sev_tables = (
            "<h2>Per severity</h2><h3>Accuracy (%)</h3>"
            + _per_severity_table(results, "accuracy")
            + "<h3>Top-label ECE (%)</h3>"
            + _per_severity_table(results, "ece_top_label")
        )
    title = f"shiftguard {_e(kind)} {_e(results.get('name'))}"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{_CSS}</style></head><body>
<h1>shiftguard {_e(kind)}: {_e(results.get("name"))}</h1>
{_problems_box(results)}
{_data_paragraph(results)}
{_units_note(results, rows)}
<h2>Summary</h2>
<p class="small">{ece_note}.{drop_note}</p>
{_summary_tables(results, rows)}
<h2>Per corruption: accuracy (%) of the primary heads</h2>
<p class="small">Mean over the severities of each corruption, and at the highest severity.</p>
{_per_corruption_table(results)}
{sev_tables}
{_robustness_section(results)}
{_conformal_section(results)}
{_adversarial_section(results)}
{_intervals_table(results)}
{_skipped_section(results)}
{_training_section(results)}
<h2>Figures</h2>{figs}
{_provenance(results, source)}
</body></html>"""


# --------------------------------------------------------------------------- comparison
_PROTOCOL = (
    ("dataset", lambda r: r["data"].get("dataset")),
    ("suite", lambda r: r["data"].get("suite")),
    ("corruptions", lambda r: sorted(map(str, r["data"].get("corruptions") or []))),
    ("extra corruptions", lambda r: sorted(map(str, r["data"].get("extra_corruptions") or []))),
    ("severities", lambda r: sorted(r["data"].get("severities") or [])),
    ("n_test", lambda r: r["data"].get("n_test")),
    ("corruption_source", lambda r: r["data"].get("corruption_source")),
    (
        "attacks",
        lambda r: sorted(
            (n, tuple(a.get("eps") or []), a.get("steps")) for n, a in (r["data"].get("attacks") or {}).items()
        ),
    ),
    ("seed", lambda r: r.get("seed")),
)


def protocol_differences(runs: Sequence[dict]) -> list[tuple[str, list]]:
    """``[(field, [value of each run])]`` for each protocol field on which the runs differ: dataset, suite,
    corruptions, extra corruptions, severities, n_test, corruption_source, seed. A field that some
    results dict does not record (``suite`` in older files) is compared among those that do."""
    out = []
    for name, get in _PROTOCOL:
        vals = [get(r) for r in runs]
        known = [v for v in vals if v is not None and v != []] if name == "suite" else vals
        if any(v != known[0] for v in known[1:]):
            out.append((name, vals))
    return out


_HEADLINE = (
    ("acc_clean", "acc clean", True),
    ("mca", "mean corruption acc", True),
    ("drop", "drop", False),
    ("ece_clean", "ECE clean", True),
    ("ece_corrupted", "ECE corrupted", True),
    ("mce", "mCE", True),
)


def comparison_matches(
    runs: Sequence[dict],
    pairs: Optional[dict] = None,
    *,
    names: Optional[Sequence[str]] = None,
    argument: str = "pairs",
) -> list[tuple[list[tuple[tuple, tuple]], str]]:
    """For each later run, ``([(first run's series key, its series key)], rule)``: which series are
    compared, by :func:`shiftguard.evaluation.compare.match_series` over every series of both (the
    full key; when that matches nothing and each holds one model, those two models, a model
    without QACT standing against every context of the other; ``pairs`` maps the first run's
    model names to the later run's). ``ValueError`` (one line, the series of both) when a later run
    matches nothing; ``names`` name the runs in it (default: their names)."""
    from .compare import match_series

    names = list(names) if names is not None else P.run_labels(runs)
    first = [series_key(r) for r in runs[0].get("rows") or []]
    return [
        match_series(
            first, [series_key(r) for r in res.get("rows") or []], pairs, names=(names[0], name), argument=argument
        )
        for name, res in zip(names[1:], runs[1:])
    ]


def delta_rows(
    runs: Sequence[dict], pairs: Optional[dict] = None, *, names: Optional[Sequence[str]] = None
) -> list[dict]:
    """Each later run's headline numbers minus the first run's, in percentage points (``d_<name>`` for the
    names of :func:`headline_rows`; ``None`` where either number is missing).

    One row per primary series of a later run and each series of the first run it is matched with
    (:func:`comparison_matches`; ``match`` names the rule); a primary series matched with nothing has
    one row with ``reference`` ``None``. ``d_acc_clean_ci`` / ``d_mca_ci``: the paired percentile
    bootstrap interval (points) of the difference over the test images
    (:func:`shiftguard.evaluation.compare.paired_accuracy_intervals`, the first run's ``interval_info``),
    given only where both scored the same images; ``interval_note`` says why not otherwise."""
    from .compare import bootstrap_settings, paired_accuracy_intervals, pairing_problems

    labels = P.run_labels(runs)
    first = {series_key(r): r for r in summary_rows(runs[0])}
    boot = bootstrap_settings(runs[0])
    out = []
    for label, res, (found, rule) in zip(labels[1:], runs[1:], comparison_matches(runs, pairs, names=names)):
        refs: dict[tuple, list[Optional[tuple]]] = {}
        for first_key, later_key in found:
            refs.setdefault(later_key, []).append(first_key)
        clean_why, corrupted_why = pairing_problems(res, runs[0], names=(label, labels[0]))
        for h in headline_rows(res):
            key = series_key(h)
            for ref in refs.get(key) or [None]:
                b = first.get(ref) if ref is not None else None
                row = {
                    "run": label,
                    **series_fields(key),
                    "reference": None if ref is None else _key_label(*ref),
                    "match": rule,
                }
                for name, _, rate in _HEADLINE:
                    x = as_number(h.get(name))
                    y = None if b is None else as_number(b.get(name))
                    row[f"d_{name}"] = None if x is None or y is None else (x - y) * (100.0 if rate else 1.0)
                ivs = (
                    {}
                    if ref is None or clean_why
                    else paired_accuracy_intervals(res, key, runs[0], ref, corrupted=corrupted_why is None, **boot)
                )
                for name, metric in (("acc_clean", "accuracy_clean"), ("mca", "mca")):
                    ci = ivs.get(metric)
                    row[f"d_{name}_ci"] = None if ci is None else (100.0 * ci[1], 100.0 * ci[2])
                row["interval_note"] = clean_why or (f"clean accuracy only: {corrupted_why}" if corrupted_why else None)
                out.append(row)
    return out


def render_comparison(
    runs: Sequence[dict],
    plots: dict[str, Path],
    sources: Optional[Sequence] = None,
    pairs: Optional[dict] = None,
    rows: Optional[list[dict]] = None,
) -> str:
    """The comparison page of several results dicts (the first is the reference of the differences;
    ``pairs`` and ``rows``, the :func:`delta_rows` already computed, as in :func:`delta_rows`)."""
    labels = P.run_labels(runs)
    diffs = protocol_differences(runs)
    if diffs:
        items = "".join(
            f"<li><b>{_e(name)}</b>: " + "; ".join(f"{_e(lab)}: {_e(v)}" for lab, v in zip(labels, vals)) + "</li>"
            for name, vals in diffs
        )
        protocol = (
            f"<div class='warn'><b>Warning: these runs do not share one protocol</b>, so their numbers are "
            f"not directly comparable. They differ in:<ul>{items}</ul></div>"
        )
    else:
        d = runs[0]["data"]
        protocol = (
            f"<p class='small'>Every run has the same protocol: dataset {_e(d.get('dataset'))}, "
            f"{len(d.get('corruptions') or [])} corruptions, severities {_e(d.get('severities'))}, "
            f"{_e(d.get('n_test'))} test images, {_e(d.get('corruption_source'))} corruptions, seed "
            f"{_e(runs[0].get('seed'))}.</p>"
        )
    show_mce = any(h.get("mce") is not None for r in runs for h in headline_rows(r))
    metrics = [m for m in _HEADLINE if show_mce or m[0] != "mce"]
    arms = _has_arms(*runs)
    lh = _label_head(arms)
    head = ["run", *lh, *(f"{lab} ({'%' if rate else 'points'})" for _, lab, rate in metrics)]
    body = []
    for lab, res in zip(labels, runs):
        for h in headline_rows(res):
            body.append(
                [
                    lab,
                    *_label_cells(series_key(h), arms, _transductive(res)),
                    *(_fmt(h.get(n), 100.0 if rate else 1.0) for n, _, rate in metrics),
                ]
            )
    headline = _table(head, body, left=1 + len(lh))
    drows = delta_rows(runs, pairs) if rows is None else rows

    def delta(r: dict, name: str) -> str:
        ci = r.get(f"d_{name}_ci")
        return _signed(r[f"d_{name}"]) + ("" if ci is None else f" [{_signed(ci[0])}, {_signed(ci[1])}]")

    dhead = ["run", *lh, f"compared with ({labels[0]})", *(f"Δ {lab} (points)" for _, lab, _ in metrics)]
    dbody = [
        [
            r["run"],
            *_label_cells(series_key(r), arms),
            r["reference"] or "— (no matching row)",
            *(delta(r, n) for n, _, _ in metrics),
        ]
        for r in drows
    ]
    deltas = _table(dhead, dbody, left=2 + len(lh))
    from .compare import bootstrap_settings

    boot = bootstrap_settings(runs[0])
    notes = []
    for lab in labels[1:]:
        mine = [r for r in drows if r["run"] == lab]
        rule = next((r["match"] for r in mine), None)
        why = next((r["interval_note"] for r in mine if r.get("interval_note")), None)
        text = f"{_e(lab)}: series matched by {_e(rule)}. "
        if why is None or why.startswith("clean accuracy only"):
            text += (
                f"[lo, hi]: paired {100 * boot['level']:.4g}% percentile bootstrap interval of the difference "
                f"over the same test images ({boot['n_boot']} resamples)"
            )
            text += f"; Δ mean corruption acc has none: {_e(why.partition(': ')[2])}." if why else "."
        else:
            text += f"No interval for the differences: {_e(why)}."
        notes.append(text)
    deltas += "<p class='small'>" + "<br>".join(notes) + "</p>"
    figs = "".join(_img(p, k) for k, p in plots.items())
    parts = []
    for i, (lab, res) in enumerate(zip(labels, runs)):
        src = f", from <code>{_e(sources[i])}</code>" if sources else ""
        rows = summary_rows(res)
        config = f", config {_e(res.get('config_source'))}" if res.get("config_source") is not None else ""
        parts.append(
            f"<h3>{_e(lab)}</h3><p class='small'>{_e(res.get('kind') or 'run')} on "
            f"{_e(res['data'].get('dataset'))}{config}, seed {_e(res.get('seed'))}{src}</p>"
            + _units_note(res, rows)
            + _summary_tables(res, rows)
        )
    names = ", ".join(_e(x) for x in labels)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>shiftguard comparison</title>
<style>{_CSS}</style></head><body><h1>Comparison: {names}</h1>
{protocol}
<p class="small">Rates in %, drops and differences (Δ) in accuracy points; mean corruption acc = mean over the
benchmark corruptions × severities; drop = clean accuracy − mean accuracy at the highest severity. Δ = this run's
number minus the first run's ({_e(labels[0])}).</p>
<h2>Figures</h2>{figs}
<h2>Headline numbers</h2>{headline}
<h2>Differences to {_e(labels[0])}</h2>{deltas}
<h2>Each run</h2>{"".join(parts)}
</body></html>"""


def build_comparison(
    out_dir: Path, runs: Sequence[dict], sources: Optional[Sequence] = None, pairs: Optional[dict] = None
) -> Path:
    """Write ``plots/`` (accuracy and ECE vs severity, every run on the same axes), ``comparison.csv``
    (the differences of :func:`delta_rows`, with their paired intervals where there are any) and
    ``report.html`` into ``out_dir``; return the page's path. ``runs`` may mix ``shiftguard run`` and
    ``shiftguard evaluate`` results; ``pairs`` maps the first run's model names to the others'
    (:func:`comparison_matches`). Raises ``ValueError`` for fewer than two runs, or a later run
    none of whose series matches the first's (before anything is written)."""
    if len(runs) < 2:
        raise ValueError(f"runs: expected at least 2 results dicts to compare, got {len(runs)}")
    rows = delta_rows(runs, pairs)
    out_dir = Path(out_dir)
    d = out_dir / "plots"
    band = "primary heads; mean ± std over corruptions, band clipped to 0–100%"
    plots = {
        f"Accuracy (%) vs severity, {band}": P.compare_runs(list(runs), "accuracy", d / "accuracy_vs_severity.png"),
        f"Top-label ECE (%) vs severity, {band}": P.compare_runs(
            list(runs), "ece_top_label", d / "ece_vs_severity.png"
        ),
    }
    buf = io.StringIO()
    fields = [
        "run",
        "model",
        "context",
        "adaptation",
        "head",
        "reference",
        *(f"d_{n}" for n, _, _ in _HEADLINE),
        "d_acc_clean_lo",
        "d_acc_clean_hi",
        "d_mca_lo",
        "d_mca_hi",
        "match",
        "interval_note",
    ]
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        flat = {
            **r,
            **{
                f"d_{n}_{end}": (r.get(f"d_{n}_ci") or (None, None))[i]
                for n in ("acc_clean", "mca")
                for i, end in enumerate(("lo", "hi"))
            },
        }
        w.writerow({k: _csv_cell(flat.get(k)) for k in fields})
    atomic_write_text(out_dir / "comparison.csv", buf.getvalue())
    return atomic_write_text(out_dir / "report.html", render_comparison(runs, plots, sources, pairs, rows))
