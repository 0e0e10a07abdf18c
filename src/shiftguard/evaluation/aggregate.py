"""From cells to the numbers robustness papers report.

- :func:`aggregate`: mean and std over corruptions per (model, context, adaptation, head, severity);
- :func:`accuracy_drops`: ``Acc@Dist_i - Acc@Dist_j`` [QACT, App. C, Tables 1-2];
- :func:`robustness_table`: mean corruption accuracy over the benchmark corruptions x severities
  (robustbench's convention), the corrupted accuracy / NLL / ECE means (uncertainty-baselines'
  convention), and CE / mCE / relative mCE against a baseline the user passes (Hendrycks &
  Dietterich 2019, Sec. 3; no AlexNet constant is assumed);
- :func:`intervals`: percentile-bootstrap 95% intervals over the test images for the headline numbers.

Only the *benchmark* corruptions enter the means; extra corruptions (CIFAR-10-C's four) are
reported apart (``mca_extra``), as the benchmark does.
"""

from __future__ import annotations

from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from shiftguard import metrics as M

__all__ = [
    "CLEAN",
    "SERIES",
    "aggregate",
    "accuracy_drops",
    "robustness_table",
    "intervals",
    "INTERVAL_METRICS",
    "series_key",
    "series_text",
    "parse_series",
    "primary_head",
]

CLEAN = "clean"

#: Metrics that get a bootstrap interval, and what each interval is of.
INTERVAL_METRICS = {
    "accuracy_clean": "accuracy on the clean test set",
    "accuracy_corrupted": "mean accuracy over the benchmark corruptions x severities",
    "ece_clean": "top-label ECE on the clean test set (the binned ECE is biased upward, so the interval of its "
    "resamples can lie above the estimate; Kumar et al. 2019)",
    "ece_corrupted": "top-label ECE of the benchmark corrupted cells pooled (biased upward like the clean ECE)",
}

#: The fields that name one series of cells: a model, its QACT context ("none" without QACT), its
#: test-time adaptation arm (:mod:`.adaptation`; "none" = static) and a head.
SERIES = ("model", "context", "adaptation", "head")

_KEY_FIELDS = (*SERIES, "corruption", "severity", "n", "group")


def primary_head(heads: Sequence[str]) -> str:
    """The head a model's model-level views show (the per-corruption table, the drop heatmap, mCE):
    its own trained classifier, ``softmax``, when it was scored (a model's logits are trained
    whenever ``softmax`` may be asked for: configs refuse it for embedding losses); else the
    protocol head of [QACT, Sec. 4, Remark], the quantile classifier, else the logistic refit,
    else the first head. The other heads are comparisons beside it."""
    for h in ("softmax", "quantile", "logistic"):
        if h in heads:
            return h
    return heads[0]


def series_text(key: tuple) -> str:
    """``model/context/head``, or ``model/context/adaptation/head`` for an adapted arm: how a
    :func:`series_key` is written by users (``baseline_key``, ``[eval] baseline``) and in messages."""
    m, c, a, h = key
    return f"{m}/{c}/{h}" if a in (None, "none") else f"{m}/{c}/{a}/{h}"


def parse_series(text: str, argument: str) -> tuple:
    """The :func:`series_key` that :func:`series_text` wrote as ``text`` (three parts: the static arm).

    Raises ``ValueError`` naming ``argument`` for any other form."""
    parts = text.split("/")
    if len(parts) == 3:
        parts.insert(2, "none")
    if len(parts) != 4 or not all(parts):
        raise ValueError(f"{argument}: expected 'model/context/head' or 'model/context/adaptation/head', got {text!r}")
    return tuple(parts)


def series_key(row: dict) -> tuple:
    """``(model, context, adaptation, head)`` of a row, aggregate or interval; results written before
    adaptation arms existed have no ``"adaptation"`` and read as the static arm, ``"none"``."""
    return (row.get("model"), row.get("context"), row.get("adaptation", "none"), row.get("head"))


def series_fields(key: tuple) -> dict:
    """``{"model": ..., "context": ..., "adaptation": ..., "head": ...}`` of a :func:`series_key`."""
    return dict(zip(SERIES, key))


def _group(rows: list[dict]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(series_key(r), []).append(r)
    return groups


def _stats(values: list) -> tuple[Optional[float], Optional[float]]:
    v = np.array([x for x in values if x is not None], dtype=float)
    if v.size == 0:
        return None, None
    return float(v.mean()), float(v.std(ddof=0))


def _benchmark(rows: Iterable[dict]) -> list[dict]:
    return [r for r in rows if r.get("group", "benchmark") == "benchmark"]


def aggregate(rows: list[dict]) -> list[dict]:
    """Mean and std over the benchmark corruptions per (model, context, adaptation, head, severity);
    severity 0 is the clean test set (``n_corruptions`` 0)."""
    out = []
    for key, rs in _group(_benchmark(rows)).items():
        metric_keys = [k for k in rs[0] if k not in _KEY_FIELDS]
        for sev in sorted({r["severity"] for r in rs}):
            sel = [r for r in rs if r["severity"] == sev]
            row = {**series_fields(key), "severity": sev, "n_corruptions": len(sel) if sev else 0}
            for m in metric_keys:
                row[f"{m}_mean"], row[f"{m}_std"] = _stats([r[m] for r in sel])
            out.append(row)
    return out


def accuracy_drops(rows: list[dict], pairs: Optional[list[tuple[int, int]]] = None) -> list[dict]:
    """``Acc@Dist_i - Acc@Dist_j`` [QACT, App. C, Tables 1-2], in accuracy points (x100).

    ``drop_mean`` uses the mean accuracy over corruptions at each severity (the tables' measure);
    ``drop_std`` is the std across corruptions of the per-corruption drop, ``per_corruption``
    lists them. Severity 0 is the clean test set, shared by every corruption.
    """
    out = []
    for key, rs in _group(_benchmark(rows)).items():
        acc: dict[int, dict[str, float]] = {}
        for r in rs:
            acc.setdefault(r["severity"], {})[r["corruption"]] = r["accuracy"]
        sevs = sorted(acc)
        todo = pairs or [(i, j) for i in sevs for j in sevs if i < j]
        for i, j in todo:
            if i not in acc or j not in acc:
                continue
            per = {}
            for c in acc[j]:
                a_i = acc[i][CLEAN] if i == 0 else acc[i].get(c)
                if a_i is not None:
                    per[c] = 100.0 * (a_i - acc[j][c])
            mean_i = float(np.mean(list(acc[i].values())))
            mean_j = float(np.mean(list(acc[j].values())))
            out.append(
                {
                    **series_fields(key),
                    "from": i,
                    "to": j,
                    "drop_mean": 100.0 * (mean_i - mean_j),
                    "drop_std": float(np.std(list(per.values()))) if per else None,
                    "per_corruption": per,
                }
            )
    return out


def _mean(values: list) -> Optional[float]:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def robustness_table(
    rows: list[dict], baseline: Optional[Callable[[str], tuple[list[dict], str]]] = None
) -> list[dict]:
    """Per (model, context, adaptation, head): ``mca`` (mean corruption accuracy), ``mca_extra``,
    ``corrupted_accuracy`` / ``corrupted_nll`` / ``corrupted_ece`` (means over the benchmark
    corrupted cells), and with ``baseline`` (``baseline(head) -> (the cells of one baseline series,
    its name)``, same corruptions and severities) ``ce`` per corruption, ``mce``, and
    ``relative_ce`` / ``relative_mce`` (Hendrycks & Dietterich 2019, Sec. 3); ``baseline`` names
    the series used."""
    out = []
    for key, rs in _group(rows).items():
        base_err = base_clean = None
        baseline_name = None
        if baseline is not None:
            baseline_rows, baseline_name = baseline(key[3])
            base_err = {
                (r["corruption"], r["severity"]): 1.0 - r["accuracy"]
                for r in _benchmark(baseline_rows)
                if r["severity"] > 0
            }
            base_clean_rows = [r for r in baseline_rows if r["severity"] == 0]
            base_clean = 1.0 - base_clean_rows[0]["accuracy"] if base_clean_rows else None
        bench = [r for r in _benchmark(rs) if r["severity"] > 0]
        extra = [r for r in rs if r.get("group") == "extra" and r["severity"] > 0]
        clean = [r for r in rs if r["severity"] == 0]
        entry = {
            **series_fields(key),
            "mca": M.mean_corruption_accuracy({(r["corruption"], r["severity"]): r["accuracy"] for r in bench})
            if bench
            else None,
            "mca_extra": _mean([r["accuracy"] for r in extra]) if extra else None,
            "corrupted_accuracy": _mean([r["accuracy"] for r in bench]),
            "corrupted_nll": _mean([r["nll"] for r in bench]),
            "corrupted_ece": _mean([r["ece_top_label"] for r in bench]),
            "mce": None,
            "relative_mce": None,
            "ce": {},
            "relative_ce": {},
            "baseline": None,
        }
        if base_err is not None and bench:
            errors = {(r["corruption"], r["severity"]): 1.0 - r["accuracy"] for r in bench}
            ce = M.corruption_errors(
                errors,
                base_err,
                clean_error=1.0 - clean[0]["accuracy"] if clean and base_clean is not None else None,
                baseline_clean_error=base_clean if clean else None,
            )
            entry.update(
                {
                    "mce": ce.get("mce"),
                    "ce": ce.get("ce", {}),
                    "relative_mce": ce.get("relative_mce"),
                    "relative_ce": ce.get("relative_ce") or {},
                    "baseline": baseline_name,
                }
            )
        out.append(entry)
    return out


def intervals(per_image: dict, n_bins: int, n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> list[dict]:
    """Bootstrap intervals of :data:`INTERVAL_METRICS` per (model, context, adaptation, head).

    ``per_image[(model, context, adaptation, head)]`` holds ``clean_correct`` / ``clean_conf`` / ``clean_hit``
    ``(N,)`` and ``corrupted_*`` ``(cells, N)`` (the benchmark corrupted cells of the same N test
    images, resampled jointly): ``correct`` is the prediction's correctness (accuracy), ``conf`` and
    ``hit`` the top-label confidence and whether that top label is right (ECE). Percentile
    bootstrap over the test images (Efron & Tibshirani 1993), ``n_boot`` resamples, seeded.
    """
    out = []
    for key, d in per_image.items():
        found = {
            "accuracy_clean": M.bootstrap_mean_ci(d["clean_correct"].double(), n_boot=n_boot, level=level, seed=seed),
            "ece_clean": M.bootstrap_ece_ci(
                d["clean_conf"], d["clean_hit"], n_bins=n_bins, n_boot=n_boot, level=level, seed=seed
            ),
        }
        if d.get("corrupted_correct") is not None and d["corrupted_correct"].numel():
            found["accuracy_corrupted"] = M.bootstrap_mean_ci(
                d["corrupted_correct"].double(), n_boot=n_boot, level=level, seed=seed
            )
            found["ece_corrupted"] = M.bootstrap_ece_ci(
                d["corrupted_conf"], d["corrupted_hit"], n_bins=n_bins, n_boot=n_boot, level=level, seed=seed
            )
        for metric, (est, lo, hi) in found.items():
            out.append(
                {**series_fields(key), "metric": metric, "estimate": float(est), "lo": float(lo), "hi": float(hi)}
            )
    return out
