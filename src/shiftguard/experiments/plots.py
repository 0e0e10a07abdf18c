"""PNG figures of a ``shiftguard run`` (matplotlib, Agg backend; no display needed).

Each function takes the ``results`` dict of ``results.json`` and a path, writes one PNG
atomically and returns the path:

- :func:`metric_vs_severity`: a metric (accuracy, ECE) against severity, mean over corruptions
  with a +/- std band, one panel per (model, context), one line per head (000, Fig. 4, 7, 10);
- :func:`drop_heatmap`: accuracy drop severity 0 -> max per corruption (000, Tables 1-2 by corruption);
- :func:`reliability_diagrams`: clean vs highest severity (004, Fig. 1);
- :func:`corruption_gallery`: the corruptions x severities on one test image;
- :func:`compare_runs`: several runs' accuracy and ECE curves side by side (``shiftguard report``).
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from shiftguard.io import atomic_write_bytes

__all__ = ["metric_vs_severity", "drop_heatmap", "reliability_diagrams", "corruption_gallery", "compare_runs",
           "primary_keys"]

METRIC_LABELS = {
    "accuracy": "accuracy", "ece_top_label": "ECE (top-label)", "ece_marginal": "ECE (marginal)",
    "nll": "NLL", "r_auroc": "R-AUROC", "map_at_5": "MAP@5", "recall_at_1": "Recall@1",
}


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> Path:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return atomic_write_bytes(path, buf.getvalue())


def _panels(results: dict) -> list[tuple[str, str]]:
    seen = []
    for a in results["aggregates"]:
        k = (a["model"], a["context"])
        if k not in seen:
            seen.append(k)
    return seen


def _label(model: str, ctx: str) -> str:
    return model if ctx == "none" else f"{model} [{ctx} context]"


def primary_keys(results: dict) -> list[tuple[str, str, str]]:
    """(model, context, head) of each model's protocol head (000, Sec. 4 Remark): the quantile
    classifier for QACT models, the logistic refit otherwise (else the model's first head)."""
    out = []
    for m in results["config"]["models"]:
        heads = m["heads"]
        head = "quantile" if "quantile" in heads else "logistic" if "logistic" in heads else heads[0]
        ctxs = sorted({a["context"] for a in results["aggregates"] if a["model"] == m["name"]},
                      key=lambda c: {"none": 0, "batch": 1, "frozen": 2}.get(c, 3))
        out += [(m["name"], c, head) for c in ctxs]
    return out


def metric_vs_severity(results: dict, metric: str, path: Path) -> Path:
    plt = _plt()
    panels = _panels(results)
    ncol = min(3, len(panels))
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.4 * nrow), squeeze=False, sharey=True)
    for ax, (model, ctx) in zip(axes.flat, panels):
        sel = [a for a in results["aggregates"] if a["model"] == model and a["context"] == ctx]
        for head in dict.fromkeys(a["head"] for a in sel):
            pts = sorted((a["severity"], a[f"{metric}_mean"], a[f"{metric}_std"] or 0.0)
                         for a in sel if a["head"] == head and a[f"{metric}_mean"] is not None)
            if not pts:
                continue
            s, m, sd = (np.array(v, dtype=float) for v in zip(*pts))
            ax.plot(s, m, marker="o", ms=3, label=head)
            ax.fill_between(s, m - sd, m + sd, alpha=0.15)
        ax.set_title(_label(model, ctx), fontsize=9)
        ax.set_xlabel("severity (0 = clean)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in axes[:, 0]:
        ax.set_ylabel(METRIC_LABELS.get(metric, metric) + " (mean ± std over corruptions)", fontsize=8)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(f"{METRIC_LABELS.get(metric, metric)} vs corruption severity", fontsize=10)
    return _save(fig, path)


def drop_heatmap(results: dict, path: Path) -> Path:
    plt = _plt()
    top = max(results["data"]["severities"])
    keys = primary_keys(results)
    corr = results["data"]["corruptions"]
    mat = np.full((len(keys), len(corr)), np.nan)
    for d in results["drops"]:
        k = (d["model"], d["context"], d["head"])
        if d["from"] == 0 and d["to"] == top and k in keys:
            for j, c in enumerate(corr):
                v = d["per_corruption"].get(c)
                mat[keys.index(k), j] = np.nan if v is None else v
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * len(corr) + 2), 0.5 * len(keys) + 1.8))
    vmax = np.nanmax(np.abs(mat)) if np.isfinite(mat).any() else 1.0
    im = ax.imshow(mat, cmap="Reds", vmin=min(0.0, np.nanmin(mat)) if np.isfinite(mat).any() else 0, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(corr)), corr, rotation=60, ha="right", fontsize=7)
    ax.set_yticks(range(len(keys)), [f"{_label(m, c)} / {h}" for m, c, h in keys], fontsize=7)
    for i in range(mat.shape[0]):
        for j in range(mat.shape[1]):
            if np.isfinite(mat[i, j]):
                ax.text(j, i, f"{mat[i, j]:.0f}", ha="center", va="center", fontsize=6)
    fig.colorbar(im, ax=ax, label=f"accuracy drop 0 → {top} (points)")
    ax.set_title(f"Accuracy drop from clean to severity {top}, per corruption", fontsize=10)
    return _save(fig, path)


def reliability_diagrams(results: dict, path: Path) -> Path:
    plt = _plt()
    keys = primary_keys(results)
    extra = [(r["model"], r["context"], r["head"]) for r in results["reliability"]]
    # protocol heads first, then NED / kNN for the 004 comparison
    for k in extra:
        if k not in keys and k[2] in ("ned", "knn"):
            keys.append(k)
    keys = [k for k in keys if k in extra]
    top = max(results["data"]["severities"])
    ncol = min(4, len(keys)) or 1
    nrow = (len(keys) + ncol - 1) // ncol or 1
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol, 3.6 * nrow), squeeze=False, layout="constrained")
    for ax, (model, ctx, head) in zip(axes.flat, keys):
        for sev, color in ((0, "tab:blue"), (top, "tab:red")):
            r = next((r for r in results["reliability"] if (r["model"], r["context"], r["head"], r["severity"]) == (model, ctx, head, sev)), None)
            if r is None:
                continue
            edges = np.array(r["edges"])
            acc = np.array([np.nan if a is None else a for a in r["accuracy"]], dtype=float)
            ax.bar(edges[:-1], acc, width=np.diff(edges), align="edge", alpha=0.45, color=color,
                   edgecolor=color, label="clean" if sev == 0 else f"severity {top} (all corruptions)")
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_title(f"{_label(model, ctx)}\n{head}", fontsize=8)
        ax.set_xlabel("confidence", fontsize=8)
        ax.set_ylabel("accuracy", fontsize=8)
        ax.legend(fontsize=6, loc="upper left")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.suptitle("Reliability diagrams: clean vs highest severity", fontsize=10)
    return _save(fig, path)


def corruption_gallery(images, corruptions: Sequence[str], severities: Sequence[int], path: Path, seed: int = 0) -> Path:
    """One test image (``images`` uint8 ``(1, C, H, W)``) under every corruption and severity."""
    from shiftguard.corruptions import gallery

    _plt()
    fig = gallery(images, names=list(corruptions), severities=(0, *severities), seed=seed)
    return _save(fig, path)


def compare_runs(runs: list[dict], metric: str, path: Path) -> Path:
    """The protocol head of each model in each run, on one axis per run."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(runs), figsize=(4.6 * len(runs), 3.4), squeeze=False, sharey=True)
    for ax, res in zip(axes[0], runs):
        for model, ctx, head in primary_keys(res):
            pts = sorted((a["severity"], a[f"{metric}_mean"], a[f"{metric}_std"] or 0.0) for a in res["aggregates"]
                         if (a["model"], a["context"], a["head"]) == (model, ctx, head) and a[f"{metric}_mean"] is not None)
            if not pts:
                continue
            s, m, sd = (np.array(v, dtype=float) for v in zip(*pts))
            ax.plot(s, m, marker="o", ms=3, label=f"{_label(model, ctx)} / {head}")
            ax.fill_between(s, m - sd, m + sd, alpha=0.15)
        ax.set_title(res["name"], fontsize=9)
        ax.set_xlabel("severity")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0, 0].set_ylabel(METRIC_LABELS.get(metric, metric))
    return _save(fig, path)
