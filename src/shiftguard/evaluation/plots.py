"""PNG figures of an evaluation's results dict (matplotlib, Agg backend; no display needed).

Each figure function takes the ``results`` dict (the content of ``results.json``) and a path,
writes one PNG atomically and returns the path:

- :func:`metric_vs_severity`: a metric against severity, mean over the benchmark corruptions with a
  +/- std band, one panel per (model, context), one line per head [QACT, Fig. 4, 7, 10];
- :func:`drop_heatmap`: accuracy drop clean -> highest severity per corruption [QACT, Tables 1-2];
- :func:`reliability_diagrams`: clean vs highest severity, with the bin counts [NED, Fig. 1], per
  primary head; :func:`reliability_every_head` the same as small multiples of every head;
- :func:`corruption_gallery`: the corruptions x severities on one test image;
- :func:`compare_runs`: several results dicts' curves overlaid on one axis.

Rates (accuracy, ECE, AUROC, MAP, recall, AURC) are drawn in %, NLL and Brier score as they are.
A std band is clipped to the metric's valid range ([0, 100] % for a rate, >= 0 for NLL and Brier):
the band shows the spread over corruptions, and a value outside the range has no meaning.

The helpers :func:`primary_keys`, :func:`cell_index`, :func:`severity_curve`,
:func:`benchmark_corruptions` and :func:`as_number` read the results dict; the report uses them too,
so the tables and the figures are computed from the same cells.
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from shiftguard.io import atomic_write_bytes

from .aggregate import primary_head, series_key

__all__ = [
    "pyplot",
    "save_png",
    "metric_vs_severity",
    "drop_heatmap",
    "reliability_diagrams",
    "corruption_gallery",
    "compare_runs",
    "primary_keys",
    "cell_index",
    "severity_curve",
    "benchmark_corruptions",
    "as_number",
    "is_rate",
    "metric_label",
    "mean_std",
    "severities",
    "per_corruption_drops",
    "run_labels",
    "CLEAN",
    "adversarial_cells",
    "metric_vs_eps",
    "reliability_every_head",
    "head_color",
    "HEAD_COLORS",
    "FEW_IMAGES",
]

#: The corruption name of the clean test set's cell (severity 0).
CLEAN = "clean"

METRIC_LABELS = {
    "accuracy": "accuracy",
    "ece_top_label": "ECE (top-label)",
    "ece_marginal": "ECE (marginal)",
    "nll": "NLL",
    "brier": "Brier score",
    "r_auroc": "R-AUROC",
    "auroc_error": "error-AUROC",
    "aurc": "AURC",
    "mean_confidence": "mean confidence",
}
#: Metrics that are not rates: drawn and tabulated as they are, never in %.
PLAIN_METRICS = ("nll", "brier")
_CONTEXT_ORDER = {"none": 0, "batch": 1, "frozen": 2}

#: One colour per head in every figure of a report, so a head is recognised across panels; heads
#: outside this table take the unused colours of the palette in sorted-name order.
HEAD_COLORS = {
    "softmax": "#1f77b4",
    "temperature": "#ff7f0e",
    "logistic": "#2ca02c",
    "quantile": "#d62728",
    "ned": "#9467bd",
    "knn": "#8c564b",
    "wknn": "#e377c2",
    "1nn": "#7f7f7f",
    "distance_ratio": "#bcbd22",
}
_MARKERS = ("o", "s", "^", "D", "v", "P", "X")
_STYLES = ("-", "--", "-.", ":")
_SPARE_COLORS = ("#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d")
#: A reliability bin with fewer images than this is drawn as an outline: its accuracy is one of a
#: handful of 0/1 outcomes, not a rate.
FEW_IMAGES = 10


def head_color(head: str, heads: Sequence[str] = ()) -> str:
    """The colour of ``head`` in every figure; ``heads``: all heads of the results (fixes the spare
    colours of unlisted heads by their sorted position)."""
    if head in HEAD_COLORS:
        return HEAD_COLORS[head]
    others = sorted({h for h in (*heads, head) if h not in HEAD_COLORS})
    return _SPARE_COLORS[others.index(head) % len(_SPARE_COLORS)]


def _all_heads(results: dict) -> list[str]:
    return sorted({str(r.get("head")) for r in results.get("rows") or []})


def is_rate(metric: str) -> bool:
    """Whether ``metric`` is a rate in [0, 1], shown in % (everything but NLL, Brier score and the
    conformal set sizes)."""
    return metric not in PLAIN_METRICS and not metric.startswith("set_size_")


def metric_label(metric: str) -> str:
    for prefix, what in (("coverage_", "coverage"), ("set_size_", "set size")):
        if metric.startswith(prefix):
            method, _, weighted = metric[len(prefix) :].partition("_")
            return f"{method.upper()} {what}" + (" (weighted)" if weighted else "")
    if metric.startswith("map_at_"):
        return "MAP@" + metric[len("map_at_") :]
    if metric.startswith("recall_at_"):
        return "Recall@" + metric[len("recall_at_") :]
    return METRIC_LABELS.get(metric, metric)


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files only, no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path: Path) -> Path:
    """Write ``fig`` as a PNG to ``path`` atomically, close it, return the path."""
    buf = io.BytesIO()
    # A constrained layout already fits the figure to its canvas; "tight" would lay it out and
    # draw it once more only to measure it (a third of the time of the report's largest figures).
    from matplotlib.layout_engine import ConstrainedLayoutEngine

    tight = None if isinstance(fig.get_layout_engine(), ConstrainedLayoutEngine) else "tight"
    fig.savefig(buf, format="png", dpi=110, bbox_inches=tight)
    pyplot().close(fig)
    return atomic_write_bytes(path, buf.getvalue())


# --------------------------------------------------------------------------- reading the results dict
def as_number(value) -> Optional[float]:
    """``value`` as a finite float; ``None`` for ``None`` and for anything that is not a finite number
    (the report lists such values of results.json as problems, so none is skipped unseen)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def _text(s) -> str:
    """A string drawn by matplotlib as written: ``$`` would start mathtext, a leading ``_`` hides a
    legend entry."""
    s = str(s).replace("$", r"\$")
    return " " + s if s.startswith("_") else s


def _label(model, ctx, arm="none") -> str:
    """A panel's name: the model, its QACT context, its adaptation arm (the static arm unnamed)."""
    text = model if ctx == "none" else f"{model} [{ctx} context]"
    return _text(text if arm in ("none", None) else f"{text} + {arm}")


def severities(results: dict) -> list[int]:
    return sorted(results["data"].get("severities") or [])


def benchmark_corruptions(results: dict) -> tuple[list[str], list[str]]:
    """``(benchmark, extra)``: the corruptions in the means, and those reported apart (``data.extra_corruptions``
    and rows of ``group`` "extra", e.g. CIFAR-10-C's 4 extra corruptions; Hendrycks & Dietterich 2019, Sec. 3)."""
    d = results["data"]
    extra = list(d.get("extra_corruptions") or [])
    extra += [
        c
        for c in dict.fromkeys(r["corruption"] for r in results["rows"] if r.get("group") == "extra")
        if c not in extra
    ]
    bench = [c for c in d.get("corruptions") or [] if c not in extra]
    seen = set(bench) | set(extra)
    for r in results["rows"]:  # a corruption present in the rows but not listed in data: still shown
        c = r["corruption"]
        if c != CLEAN and c not in seen and r.get("group") != "adversarial":
            bench.append(c)
            seen.add(c)
    return bench, extra


def adversarial_cells(results: dict) -> dict[tuple, dict[str, list[tuple[float, dict]]]]:
    """``{(model, context, adaptation, head): {attack: [(eps, row), ...]}}`` of the adversarial cells, by
    increasing eps (severity ``i`` is budget ``data.attacks[attack].eps[i - 1]``)."""
    eps_of = {name: a.get("eps") or [] for name, a in (results["data"].get("attacks") or {}).items()}
    out: dict[tuple, dict[str, list[tuple[float, dict]]]] = {}
    for r in results["rows"]:
        if r.get("group") != "adversarial":
            continue
        budgets = eps_of.get(r["corruption"], [])
        eps = budgets[r["severity"] - 1] if 0 < r["severity"] <= len(budgets) else float("nan")
        out.setdefault(series_key(r), {}).setdefault(r["corruption"], []).append((eps, r))
    for per in out.values():
        for cells in per.values():
            cells.sort(key=lambda t: t[0])
    return out


def cell_index(results: dict) -> dict[tuple, dict[tuple, dict]]:
    """``{(model, context, adaptation, head): {(corruption, severity): row}}``
    (:func:`~.aggregate.series_key`); the clean cell is ``(CLEAN, 0)``."""
    out: dict[tuple, dict[tuple, dict]] = {}
    for r in results["rows"]:
        out.setdefault(series_key(r), {})[(r["corruption"], r["severity"])] = r
    return out


def mean_std(values: list) -> tuple[Optional[float], Optional[float], int]:
    """Mean, std (population, ddof=0) and count of the defined values."""
    v = np.array([x for x in (as_number(y) for y in values) if x is not None], dtype=float)
    if v.size == 0:
        return None, None, 0
    return float(v.mean()), float(v.std()), int(v.size)


def severity_curve(results: dict, key: tuple, metric: str, index: Optional[dict] = None) -> list[tuple]:
    """``[(severity, mean, std, n)]`` of ``metric`` for ``key = (model, context, adaptation, head)``: severity 0 is the
    clean cell (std 0); each other severity the mean and std over the benchmark corruptions (extra
    corruptions excluded) of the cells where the metric is defined (``n`` of them)."""
    cells = (index or cell_index(results)).get(tuple(key), {})
    bench, _ = benchmark_corruptions(results)
    out: list[tuple[int, float, Optional[float], int]] = []
    clean = as_number(cells.get((CLEAN, 0), {}).get(metric))
    if clean is not None:
        out.append((0, clean, 0.0, 1))
    for s in severities(results):
        mean, std, n = mean_std([cells[(c, s)].get(metric) for c in bench if (c, s) in cells])
        if mean is not None:
            out.append((s, mean, std, n))
    return out


def _sort_contexts(ctxs) -> list[str]:
    return sorted(ctxs, key=lambda c: (_CONTEXT_ORDER.get(c, 3), str(c)))


def _settings(results: dict, model: str, ctxs: Sequence[str]) -> list[tuple[str, str]]:
    """The ``(context, adaptation)`` pairs of ``model`` that have rows: arm by arm in row order, and
    within an arm its contexts in the order of ``ctxs``."""
    present = list(dict.fromkeys(series_key(r)[1:3] for r in results["rows"] if r["model"] == model))
    arms = list(dict.fromkeys(a for _, a in present))
    order = {c: i for i, c in enumerate(ctxs)}
    return [
        (c, a)
        for a in arms
        for c in sorted({c for c, b in present if b == a}, key=lambda c: (order.get(c, len(order)), str(c)))
    ]


def primary_keys(results: dict) -> list[tuple[str, str, str, str]]:
    """``(model, context, adaptation, head)`` of each model's primary head, for every context and
    adaptation arm it was evaluated in and that has result rows.

    From ``results["models"]`` (``primary_head``, ``contexts``) when present; otherwise from
    ``results["config"]["models"]`` or the rows, with the rule of ``aggregate.primary_head`` (the
    model's own softmax, else the quantile classifier, else the logistic refit, else the first head)."""
    present = {series_key(r) for r in results["rows"]}
    contexts: dict = {}
    for m, c, _, _ in present:
        contexts.setdefault(m, set()).add(c)
    out = []
    if results.get("models"):
        for m in results["models"]:
            ctxs = m.get("contexts") or _sort_contexts(contexts.get(m["name"], ()))
            if m.get("primary_head") is not None:  # None: every head of the model was skipped
                out += [(m["name"], c, a, m["primary_head"]) for c, a in _settings(results, m["name"], ctxs)]
    else:
        cfg_models = (results.get("config") or {}).get("models")
        if cfg_models:
            heads = {m["name"]: list(m["heads"]) for m in cfg_models}
        else:
            heads = {}
            for r in results["rows"]:
                heads.setdefault(r["model"], [])
                if r["head"] not in heads[r["model"]]:
                    heads[r["model"]].append(r["head"])
        for name, hs in heads.items():
            if hs:
                out += [
                    (name, c, a, primary_head(hs))
                    for c, a in _settings(results, name, _sort_contexts(contexts.get(name, ())))
                ]
    return [k for k in out if k in present]


def _panels(results: dict) -> list[tuple]:
    return list(dict.fromkeys(series_key(r)[:3] for r in results["rows"]))


def _band(ax, s, m, sd, rate: bool, **kw):
    lo, hi = m - sd, m + sd
    lo = np.clip(lo, 0.0, None)
    if rate:
        hi = np.clip(hi, None, 100.0)
    ax.fill_between(s, lo, hi, **kw)


# --------------------------------------------------------------------------- figures
def _panel_grid(plt, n_panels: int):
    """``(fig, axes)``: a grid of ``n_panels`` (model, context) panels, three to a row, one y axis."""
    ncol = min(3, n_panels)
    nrow = (n_panels + ncol - 1) // ncol
    return plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.4 * nrow), squeeze=False, sharey=True)


def _finish_panels(fig, axes, n_panels: int, rate: bool, ylabel: str, title: str) -> None:
    """The shared y range of a rate (0-100 %), the y labels of the first column, the unused panels
    hidden, the figure's title."""
    if rate:
        axes[0, 0].set_ylim(0, 100)
    for ax in axes[:, 0]:
        ax.set_ylabel(ylabel, fontsize=8)
    for ax in list(axes.flat)[n_panels:]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)


def metric_vs_severity(results: dict, metric: str, path: Path, target: Optional[float] = None) -> Path:
    """``metric`` against severity per (model, context, adaptation) panel, one line per head, +/- std over the
    benchmark corruptions as a band clipped to the metric's range; ``target`` (a rate) drawn as a
    dashed line in every panel (the ``1 - alpha`` of the conformal coverage)."""
    plt = pyplot()
    rate = is_rate(metric)
    scale = 100.0 if rate else 1.0
    index = cell_index(results)
    panels = _panels(results) or [("", "none", "none")]
    fig, axes = _panel_grid(plt, len(panels))
    heads = _all_heads(results)
    for ax, panel in zip(axes.flat, panels):
        for i, head in enumerate(dict.fromkeys(k[3] for k in index if k[:3] == panel)):
            pts = severity_curve(results, (*panel, head), metric, index)
            if not pts:
                continue
            s, m, sd = (np.array(v, dtype=float) for v in list(zip(*pts))[:3])
            color = head_color(str(head), heads)
            # heads often coincide (softmax and temperature have one accuracy): a line style and
            # marker per head keep a curve visible under the one drawn after it
            ax.plot(
                s,
                m * scale,
                marker=_MARKERS[i % len(_MARKERS)],
                ms=4,
                ls=_STYLES[i % len(_STYLES)],
                label=_text(head),
                color=color,
                alpha=0.9,
            )
            _band(ax, s, m * scale, sd * scale, rate, alpha=0.12, color=color)
        if target is not None:
            ax.axhline(target * scale, color="k", ls="--", lw=0.8, label=f"target {target * scale:g}")
        ax.set_title(_label(*panel), fontsize=9)
        ax.set_xticks([0, *severities(results)])
        ax.set_xlabel("severity (0 = clean)")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    _finish_panels(
        fig,
        axes,
        len(panels),
        rate,
        metric_label(metric) + (" (%)" if rate else "") + "\nmean ± std over corruptions",
        f"{metric_label(metric)} vs corruption severity",
    )
    return save_png(fig, path)


def metric_vs_eps(results: dict, metric: str, path: Path) -> Path:
    """``metric`` against the attack budget: one row of panels per (model, context, adaptation), one
    panel per attack, one line per head in the head's colour (:func:`head_color`) from the clean cell
    (eps 0) through every budget of the adversarial cells (:func:`adversarial_cells`)."""
    plt = pyplot()
    rate = is_rate(metric)
    scale = 100.0 if rate else 1.0
    cells = adversarial_cells(results)
    index = cell_index(results)
    heads = _all_heads(results)
    series = list(dict.fromkeys(k[:3] for k in cells)) or [("", "none", "none")]
    attacks = list(dict.fromkeys(a for per in cells.values() for a in per)) or ["none"]
    fig, axes = plt.subplots(
        len(series),
        len(attacks),
        figsize=(4.2 * len(attacks), 3.2 * len(series)),
        squeeze=False,
        sharey=True,
        sharex="col",
    )
    for i, panel in enumerate(series):
        for j, attack in enumerate(attacks):
            ax = axes[i, j]
            for key, per in cells.items():
                if key[:3] != panel or attack not in per:
                    continue
                clean = as_number(index.get(key, {}).get((CLEAN, 0), {}).get(metric))
                xs = ([0.0] if clean is not None else []) + [eps for eps, _ in per[attack]]
                ys = ([clean] if clean is not None else []) + [as_number(r.get(metric)) for _, r in per[attack]]
                keep = [(x, y) for x, y in zip(xs, ys) if y is not None]
                if keep:
                    ax.plot(
                        [x for x, _ in keep],
                        [y * scale for _, y in keep],
                        marker="o",
                        ms=3,
                        color=head_color(str(key[3]), heads),
                        label=_text(key[3]),
                    )
            ax.set_title(f"{_label(*panel)}\n{_text(attack)}", fontsize=8)
            ax.grid(alpha=0.3)
            if i == len(series) - 1:
                ax.set_xlabel("attack budget eps (0 = clean)", fontsize=8)
            if j == 0:
                ax.set_ylabel(metric_label(metric) + (" (%)" if rate else ""), fontsize=8)
            if ax.lines:
                ax.legend(fontsize=6)
    if rate:
        axes[0, 0].set_ylim(0, 100)
    fig.suptitle(f"{metric_label(metric)} vs attack budget", fontsize=10)
    fig.tight_layout()  # a second row's titles clear the first row's axis labels
    return save_png(fig, path)


def per_corruption_drops(results: dict, key: tuple, index: Optional[dict] = None) -> dict[str, Optional[float]]:
    """``{corruption: 100 * (clean accuracy - accuracy at the highest severity)}`` for ``key`` (accuracy
    points; [QACT, App. C, Tables 1-2]), every corruption including the extra ones; ``None`` where a cell
    is missing."""
    cells = (index or cell_index(results)).get(tuple(key), {})
    sevs = severities(results)
    bench, extra = benchmark_corruptions(results)
    clean = as_number(cells.get((CLEAN, 0), {}).get("accuracy"))
    out = {}
    for c in bench + extra:
        a = as_number(cells.get((c, sevs[-1]), {}).get("accuracy")) if sevs else None
        out[c] = None if clean is None or a is None else 100.0 * (clean - a)
    return out


def drop_heatmap(results: dict, path: Path) -> Path:
    """Accuracy drop clean -> highest severity, per corruption (columns) and primary head (rows)."""
    plt = pyplot()
    sevs = severities(results)
    top = sevs[-1] if sevs else 0
    keys = primary_keys(results)
    bench, extra = benchmark_corruptions(results)
    corr = bench + extra
    index = cell_index(results)
    mat = np.full((max(1, len(keys)), max(1, len(corr))), np.nan)
    for i, k in enumerate(keys):
        drops = per_corruption_drops(results, k, index)
        for j, c in enumerate(corr):
            v = drops.get(c)
            mat[i, j] = np.nan if v is None else v
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(corr) + 2), 0.5 * len(keys) + 1.8))
    finite = np.isfinite(mat).any()
    vmax = float(np.nanmax(np.abs(mat))) if finite else 1.0
    vmin = min(0.0, float(np.nanmin(mat))) if finite else 0.0
    im = ax.imshow(mat, cmap="Reds", vmin=vmin, vmax=vmax or 1.0, aspect="auto")
    ax.set_xticks(
        range(len(corr)),
        [_text(c) + (" (extra)" if c in extra else "") for c in corr],
        rotation=60,
        ha="right",
        fontsize=7,
    )
    ax.set_yticks(range(len(keys)), [f"{_label(m, c, a)} / {_text(h)}" for m, c, a, h in keys], fontsize=7)
    for i in range(len(keys)):
        for j in range(len(corr)):
            ax.text(j, i, f"{mat[i, j]:.0f}" if np.isfinite(mat[i, j]) else "n/a", ha="center", va="center", fontsize=6)
    fig.colorbar(im, ax=ax, label=f"accuracy drop 0 → {top} (points)")
    ax.set_title(f"Accuracy drop from clean to severity {top}, per corruption", fontsize=10)
    return save_png(fig, path)


def _reliability_entry(results: dict, key: tuple, severity) -> Optional[dict]:
    for r in results.get("reliability") or []:
        if (*series_key(r), r["severity"]) == (*key, severity):
            return r
    return None


def _reliability_panel(sub, results: dict, key: tuple, series: list[tuple], title: str) -> None:
    """One reliability diagram in subfigure ``sub``: accuracy per confidence bin above (a bin with
    fewer than :data:`FEW_IMAGES` images as a hatched outline), images per bin below (log scale)."""
    ax, hx = sub.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    any_count = False
    for sev, color, name, offset in series:
        r = _reliability_entry(results, key, sev)
        if r is None:
            continue
        edges = np.array([as_number(e) for e in r["edges"]], dtype=float) * 100.0
        acc = np.array([np.nan if as_number(a) is None else as_number(a) for a in r["accuracy"]]) * 100.0
        count = np.array([as_number(c) or 0.0 for c in r["count"]], dtype=float)
        filled = (count >= FEW_IMAGES) & np.isfinite(acc)
        few = (count > 0) & (count < FEW_IMAGES) & np.isfinite(acc)
        width = np.diff(edges) / 2
        left = edges[:-1] + offset * np.diff(edges)
        ax.bar(
            left[filled],
            acc[filled],
            width=width[filled],
            align="edge",
            alpha=0.45,
            color=color,
            edgecolor=color,
            label=name,
        )
        if few.any():
            ax.bar(
                left[few],
                acc[few],
                width=width[few],
                align="edge",
                fill=False,
                hatch="///",
                edgecolor=color,
                linewidth=0.6,
                alpha=0.7,
            )
        ax.plot((left + width / 2)[filled | few], acc[filled | few], "o", ms=2.5, color=color)
        if (count > 0).any():
            hx.bar(left[count > 0], count[count > 0], width=width[count > 0], align="edge", color=color, alpha=0.6)
            any_count = True
    ax.plot([0, 100], [0, 100], "k--", lw=0.8)
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=8)
    ax.set_ylabel("accuracy (%)", fontsize=8)
    ax.tick_params(labelsize=7)
    if ax.patches:
        ax.legend(fontsize=6, loc="upper left")
    if any_count:
        from matplotlib.ticker import FuncFormatter, NullFormatter

        hx.set_yscale("log")
        hx.axhline(FEW_IMAGES, color="0.5", lw=0.6, ls=":")
        hx.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        hx.yaxis.set_minor_formatter(NullFormatter())
    hx.set_ylabel("images", fontsize=8)
    hx.set_xlabel("confidence (%)", fontsize=8)
    hx.tick_params(labelsize=7)


def _reliability_series(results: dict) -> list[tuple]:
    sevs = severities(results)
    top = sevs[-1] if sevs else None
    series = [(0, "tab:blue", "clean", 0.0)]
    if top is not None:
        series.append((top, "tab:red", f"severity {top} (all corruptions)", 0.5))
    return series


_FEW_NOTE = f"hatched: a bin of fewer than {FEW_IMAGES} images; empty bins have no bar"


def reliability_diagrams(results: dict, path: Path) -> Path:
    """Clean vs highest severity (pooled over corruptions) per primary head, plus NED / kNN heads
    [NED, Fig. 1]: accuracy per confidence bin above, the number of images per bin below (log
    scale). An empty bin has neither bar nor marker, so it cannot be read as zero accuracy; a bin of
    fewer than :data:`FEW_IMAGES` images is a hatched outline, so one image cannot read as a 100% bar."""
    plt = pyplot()
    rel = results.get("reliability") or []
    present = list(dict.fromkeys(series_key(r) for r in rel))
    keys = primary_keys(results)
    # protocol heads first, then NED / kNN for the comparison of [NED]
    keys += [k for k in present if k not in keys and k[3] in ("ned", "knn")]
    keys = [k for k in keys if k in present]
    ncol = min(4, len(keys)) or 1
    nrow = (len(keys) + ncol - 1) // ncol or 1
    fig = plt.figure(figsize=(3.6 * ncol, 4.4 * nrow), layout="constrained")
    subs = fig.subfigures(nrow, ncol, squeeze=False)
    series = _reliability_series(results)
    for sub, (model, ctx, arm, head) in zip(subs.flat, keys):
        _reliability_panel(sub, results, (model, ctx, arm, head), series, f"{_label(model, ctx, arm)}\n{_text(head)}")
    for sub in list(subs.flat)[len(keys) :]:
        sub.subplots().axis("off")
    fig.suptitle(f"Reliability diagrams: clean vs highest severity ({_FEW_NOTE})", fontsize=10)
    return save_png(fig, path)


def reliability_every_head(results: dict, path: Path) -> Path:
    """Small multiples of :func:`reliability_diagrams` for every head that was scored: one row per
    (model, context, adaptation), one column per head (the same head in the same column)."""
    plt = pyplot()
    present = list(dict.fromkeys(series_key(r) for r in results.get("reliability") or []))
    rows = list(dict.fromkeys(k[:3] for k in present))
    heads = [h for h in _all_heads(results) if any(k[3] == h for k in present)]
    heads.sort(key=lambda h: (list(HEAD_COLORS).index(h) if h in HEAD_COLORS else len(HEAD_COLORS), h))
    nrow, ncol = len(rows) or 1, len(heads) or 1
    fig = plt.figure(figsize=(2.9 * ncol, 3.5 * nrow), layout="constrained")
    subs = fig.subfigures(nrow, ncol, squeeze=False)
    series = _reliability_series(results)
    for i, panel in enumerate(rows):
        for j, head in enumerate(heads):
            if (*panel, head) in present:
                _reliability_panel(subs[i, j], results, (*panel, head), series, f"{_label(*panel)}\n{_text(head)}")
            else:
                subs[i, j].subplots().axis("off")
    fig.suptitle(f"Reliability of every head: clean vs highest severity ({_FEW_NOTE})", fontsize=10)
    return save_png(fig, path)


def corruption_gallery(
    images, corruptions: Sequence[str], severities: Sequence[int], path: Path, seed: int = 0
) -> Path:
    """One test image (``images`` uint8 ``(1, C, H, W)``) under every corruption and severity."""
    from shiftguard.corruptions import gallery

    pyplot()
    fig = gallery(images, names=list(corruptions), severities=(0, *severities), seed=seed)
    return save_png(fig, path)


def run_labels(runs: Sequence[dict]) -> list[str]:
    """Each results dict's name, with ``#i`` (1-based position) added where names repeat."""
    names = [str(r.get("name")) for r in runs]
    return [f"{n} #{i + 1}" if names.count(n) > 1 else n for i, n in enumerate(names)]


def compare_runs(runs: list[dict], metric: str, path: Path) -> Path:
    """Several results dicts on the same axes: one line per (run, primary head) -- the line style
    tells the runs apart -- with its +/- std band over corruptions clipped to the metric's range."""
    plt = pyplot()
    rate = is_rate(metric)
    scale = 100.0 if rate else 1.0
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for i, (res, name) in enumerate(zip(runs, run_labels(runs))):
        index = cell_index(res)
        for model, ctx, arm, head in primary_keys(res):
            pts = severity_curve(res, (model, ctx, arm, head), metric, index)
            if not pts:
                continue
            s, m, sd = (np.array(v, dtype=float) for v in list(zip(*pts))[:3])
            (line,) = ax.plot(
                s,
                m * scale,
                styles[i % len(styles)],
                marker="o",
                ms=3,
                label=f"{_text(name)}: {_label(model, ctx, arm)} / {_text(head)}",
            )
            _band(ax, s, m * scale, sd * scale, rate, alpha=0.08, color=line.get_color())
    ticks = sorted({0, *(s for res in runs for s in severities(res))})
    ax.set_xticks(ticks)
    ax.set_xlabel("severity (0 = clean)")
    ax.set_ylabel(metric_label(metric) + (" (%)" if rate else "") + ", mean ± std over corruptions")
    if rate:
        ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(f"{metric_label(metric)} vs severity, primary heads of every run", fontsize=10)
    return save_png(fig, path)
