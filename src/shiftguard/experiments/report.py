"""Reports of ``shiftguard run`` directories, and the ``shiftguard report`` command.

``build_report(run_dir, results)`` writes ``results.csv``, ``plots/*.png`` and a self-contained
``report.html`` (images embedded as base64) from the results dict. ``shiftguard report RUN_DIR
[RUN_DIR ...]`` rebuilds them from ``results.json``; with several runs it also writes a
side-by-side comparison page. A run without its ``COMPLETE`` marker is refused.
"""

from __future__ import annotations

import argparse
import base64
import csv
import html
import io
import json
from datetime import datetime
from pathlib import Path
from typing import Optional

from shiftguard.io import atomic_write_text

__all__ = ["add_arguments", "main", "build_report", "summary_rows", "format_summary", "load_run", "write_csv"]

CSV_FIXED = ["model", "context", "head", "corruption", "severity", "n"]


# --------------------------------------------------------------------------- summary
def summary_rows(results: dict) -> list[dict]:
    """One row per (model, context, head): clean and highest-severity accuracy and ECE, the
    accuracy drop 0 -> max (000, Tables 1-2) and the ECE drift (how flat calibration stays)."""
    top = max(results["data"]["severities"])
    agg = {(a["model"], a["context"], a["head"], a["severity"]): a for a in results["aggregates"]}
    drops = {(d["model"], d["context"], d["head"]): d for d in results["drops"] if d["from"] == 0 and d["to"] == top}
    out = []
    for (model, ctx, head, sev), a in agg.items():
        if sev != 0:
            continue
        b = agg.get((model, ctx, head, top))
        if b is None:
            continue
        d = drops.get((model, ctx, head), {})
        eces = [agg[(model, ctx, head, s)]["ece_top_label_mean"] for s in [0, *sorted(results["data"]["severities"])]
                if (model, ctx, head, s) in agg]
        out.append({
            "model": model, "context": ctx, "head": head,
            "acc_clean": a["accuracy_mean"], f"acc_s{top}": b["accuracy_mean"], f"acc_s{top}_std": b["accuracy_std"],
            "drop": d.get("drop_mean"), "drop_std": d.get("drop_std"),
            "ece_clean": a["ece_top_label_mean"], f"ece_s{top}": b["ece_top_label_mean"],
            "ece_drift": (b["ece_top_label_mean"] - a["ece_top_label_mean"]),
            "ece_range": max(eces) - min(eces) if eces else None,
            "ece_marginal_clean": a["ece_marginal_mean"], f"ece_marginal_s{top}": b["ece_marginal_mean"],
            "nll_clean": a["nll_mean"], f"nll_s{top}": b["nll_mean"],
            "map_clean": _first(a, "map_at_"), f"map_s{top}": _first(b, "map_at_", last=True),
            "r_auroc_clean": a["r_auroc_mean"], f"r_auroc_s{top}": b["r_auroc_mean"],
        })
    return out


def _first(row: dict, prefix: str, last: bool = False):
    keys = sorted((k for k in row if k.startswith(prefix) and k.endswith("_mean")), key=lambda k: int(k[len(prefix):-5]))
    return row[keys[-1]] if keys else None


def _fmt(v, scale: float = 100.0, nd: int = 1) -> str:
    return "—" if v is None else f"{v * scale:.{nd}f}"


def _summary_table(results: dict) -> tuple[list[str], list[list[str]]]:
    top = max(results["data"]["severities"])
    head = ["model", "context", "head", "acc s0", f"acc s{top}", f"drop 0→{top}", "ECE s0", f"ECE s{top}",
            "ECE range", f"MAP s0", f"MAP s{top}"]
    body = []
    for r in results["summary"]:
        drop = "—" if r["drop"] is None else f"{r['drop']:.1f} ± {r['drop_std'] or 0:.1f}"
        body.append([r["model"], r["context"], r["head"], _fmt(r["acc_clean"]), _fmt(r[f"acc_s{top}"]), drop,
                     _fmt(r["ece_clean"]), _fmt(r[f"ece_s{top}"]), _fmt(r["ece_range"]), _fmt(r["map_clean"]),
                     _fmt(r[f"map_s{top}"])])
    return head, body


def format_summary(results: dict) -> str:
    """The summary table as plain text (printed at the end of ``shiftguard run``)."""
    head, body = _summary_table(results)
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    d = results["data"]
    title = (f"{results['name']}: {d['dataset']}, {len(d['corruptions'])} corruptions x severities "
             f"{d['severities']} ({d['corruption_source']}); accuracy, ECE (top-label) and MAP in %, "
             f"drop = mean ± std over corruptions")
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *(line(r) for r in body)])


# --------------------------------------------------------------------------- files
def write_csv(path: Path, rows: list[dict]) -> Path:
    keys = list(CSV_FIXED)
    for r in rows:
        keys += [k for k in r if k not in keys]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=keys, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in keys})
    return atomic_write_text(path, buf.getvalue())


def make_plots(run_dir: Path, results: dict) -> dict[str, Path]:
    from . import plots as P

    d = run_dir / "plots"
    out = {
        "accuracy": P.metric_vs_severity(results, "accuracy", d / "accuracy_vs_severity.png"),
        "ece_top_label": P.metric_vs_severity(results, "ece_top_label", d / "ece_vs_severity.png"),
        "ece_marginal": P.metric_vs_severity(results, "ece_marginal", d / "ece_marginal_vs_severity.png"),
        "drop_heatmap": P.drop_heatmap(results, d / "accuracy_drop_heatmap.png"),
        "reliability": P.reliability_diagrams(results, d / "reliability_diagrams.png"),
    }
    if (d / "corruption_gallery.png").is_file():
        out["gallery"] = d / "corruption_gallery.png"
    return out


def _img(path: Path, alt: str) -> str:
    b64 = base64.b64encode(Path(path).read_bytes()).decode("ascii")
    return f'<figure><img alt="{html.escape(alt)}" src="data:image/png;base64,{b64}"><figcaption>{html.escape(alt)}</figcaption></figure>'


def _table(head: list[str], body: list[list[str]]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    trs = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{trs}</tbody></table>"


_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 7px;text-align:right}
td:nth-child(-n+3),th:nth-child(-n+3){text-align:left}th{background:#f3f3f3}figure{margin:1.5em 0}
img{max-width:100%}figcaption{font-size:12px;color:#555}code,pre{background:#f6f6f6;padding:2px 4px}
.small{font-size:12px;color:#555}"""


def _training_table(results: dict) -> str:
    head = ["model", "params", "epochs", "best epoch", "best val acc", "train s"]
    body = []
    for name, t in results["training"].items():
        body.append([name, f"{t.get('parameters', 0):,}", str(t.get("epochs_run")), str(t.get("best_epoch")),
                     f"{100 * t['best_val_acc']:.2f}", f"{results['timings']['train_s'].get(name, 0):.1f}"])
    return _table(head, body)


def render_html(results: dict, plots: dict[str, Path]) -> str:
    d = results["data"]
    head, body = _summary_table(results)
    captions = {
        "accuracy": "Accuracy vs severity (mean ± std over corruptions; severity 0 = clean test set).",
        "ece_top_label": "Top-label ECE vs severity: flat = calibration that survives the shift.",
        "ece_marginal": "Marginal ECE vs severity.",
        "drop_heatmap": "Accuracy drop clean → highest severity per corruption (protocol heads).",
        "reliability": "Reliability diagrams, clean vs highest severity pooled over corruptions.",
        "gallery": "The corruptions at each severity on one test image.",
    }
    figs = "".join(_img(p, captions.get(k, k)) for k, p in plots.items())
    t = results["timings"]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>shiftguard run {html.escape(results['name'])}</title>
<style>{_CSS}</style></head><body>
<h1>shiftguard run: {html.escape(results['name'])}</h1>
<p>Dataset <b>{html.escape(str(d['dataset']))}</b>: {d['n_train']} train / {d['n_val']} validation / {d['n_test']} test images,
{len(d['corruptions'])} corruptions × severities {d['severities']} ({html.escape(d['corruption_source'])} corruptions).
Heads are fitted on clean training embeddings only (000, Sec. 4 Remark). QACT models use the test batch as context
({results['config']['eval']['batch_size']} images); the <i>frozen</i> rows use the training context instead.</p>
<h2>Summary</h2>
<p class="small">Accuracy, ECE (top-label, {results['config']['eval']['ece_bins']} bins) and MAP@K in %;
drop = Acc@severity 0 − Acc@severity {max(d['severities'])} (000, Tables 1–2), mean ± std over corruptions;
ECE range = max − min of the mean ECE over severities.</p>
{_table(head, body)}
<h2>Training</h2>{_training_table(results)}
<h2>Figures</h2>{figs}
<h2>Provenance</h2>
<p class="small">seed {results['seed']}, device {html.escape(results['device'])}, created {html.escape(results['created'])},
config {html.escape(str(results.get('config_source')))}; total {t['total_s']:.0f} s (training {sum(t['train_s'].values()):.0f} s,
evaluation {t['evaluate_s']:.0f} s).<br>versions: {html.escape(json.dumps(results['versions']))}</p>
<p class="small">All numbers: <code>results.json</code> / <code>results.csv</code> in this folder.</p>
</body></html>"""


def build_report(run_dir: Path, results: dict, progress: bool = False) -> Path:
    """Write ``results.csv``, ``plots/`` and ``report.html`` for ``results`` into ``run_dir``."""
    run_dir = Path(run_dir)
    write_csv(run_dir / "results.csv", results["rows"])
    plots = make_plots(run_dir, results)
    return atomic_write_text(run_dir / "report.html", render_html(results, plots))


# --------------------------------------------------------------------------- comparison
def render_comparison(runs: list[dict], plots: dict[str, Path]) -> str:
    parts = []
    for res in runs:
        head, body = _summary_table(res)
        parts.append(f"<h2>{html.escape(res['name'])}</h2><p class='small'>{html.escape(str(res['data']['dataset']))}, "
                     f"config {html.escape(str(res.get('config_source')))}, seed {res['seed']}</p>{_table(head, body)}")
    figs = "".join(_img(p, k) for k, p in plots.items())
    names = ", ".join(html.escape(r["name"]) for r in runs)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>shiftguard comparison</title><style>{_CSS}</style></head>
<body><h1>Comparison: {names}</h1>{figs}{''.join(parts)}</body></html>"""


# --------------------------------------------------------------------------- loading runs
def load_run(run_dir: str | Path) -> dict:
    """``results.json`` of a finished run; clear errors for anything else."""
    from .run import COMPLETE_MARKER

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
    try:
        results = json.loads((d / "results.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{d}: has a {COMPLETE_MARKER} marker but no results.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{d / 'results.json'}: not valid JSON ({exc})") from None
    if results.get("status") != "complete":
        raise ValueError(f"{d / 'results.json'}: status is {results.get('status')!r}, not 'complete'")
    return results


# --------------------------------------------------------------------------- command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="one or more run directories of 'shiftguard run'")
    p.add_argument("--out", help="comparison page for several runs (default: <parent of the first run>/compare-<time>.html)")


def main(args) -> int:
    runs = [load_run(r) for r in args.runs]  # validate all before writing anything
    for d, res in zip(args.runs, runs):
        path = build_report(Path(d), res)
        print(f"rebuilt {path}")
        print(format_summary(res))
        print()
    if len(runs) > 1:
        from . import plots as P

        out = Path(args.out) if args.out else Path(args.runs[0]).parent / f"compare-{datetime.now():%Y%m%d-%H%M%S}.html"
        pdir = out.with_suffix("")
        plots = {
            "accuracy vs severity (protocol heads)": P.compare_runs(runs, "accuracy", pdir / "accuracy.png"),
            "ECE (top-label) vs severity (protocol heads)": P.compare_runs(runs, "ece_top_label", pdir / "ece.png"),
        }
        atomic_write_text(out, render_comparison(runs, plots))
        print(f"wrote comparison {out}")
    return 0
