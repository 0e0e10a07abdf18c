"""``EvaluationResult``: the rows and aggregates of an evaluation, and the ways to read them."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path
from typing import Any, Mapping, Optional, Union

from shiftguard.io import atomic_write_text

from .aggregate import series_fields, series_key
from .compare import bootstrap_settings, match_series, paired_accuracy_intervals, pairing_problems

__all__ = ["EvaluationResult", "describe_preprocess"]


def _headline(results: dict) -> dict[tuple, dict]:
    """Per (model, context, adaptation, head): the numbers a comparison puts side by side."""
    out: dict[tuple, dict] = {}
    top = max(results["data"]["severities"], default=0)
    for a in results["aggregates"]:
        e = out.setdefault(series_key(a), {})
        if a["severity"] == 0:
            e["accuracy_clean"], e["ece_clean"], e["nll_clean"] = (
                a["accuracy_mean"],
                a["ece_top_label_mean"],
                a["nll_mean"],
            )
        if a["severity"] == top and top:
            e[f"accuracy_s{top}"] = a["accuracy_mean"]
    for d in results.get("drops", []):
        if d["from"] == 0 and d["to"] == top:
            out.setdefault(series_key(d), {})["drop"] = d["drop_mean"]
    for r in results.get("robustness", []):
        e = out.setdefault(series_key(r), {})
        e.update(
            {"mca": r["mca"], "corrupted_ece": r["corrupted_ece"], "corrupted_nll": r["corrupted_nll"], "mce": r["mce"]}
        )
    return out


# -- the record -----------------------------------------------------------------------------------
def describe_preprocess(fn: Any) -> Optional[str]:
    """What ``preprocess`` was, for the record: ``module.qualname`` of a function (its repr would
    carry a memory address, different in every process), the repr of anything else (an
    ``nn.Module`` or a transform object shows its parameters); ``None`` without one."""
    if fn is None:
        return None
    if isinstance(fn, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        module = getattr(fn, "__module__", None)
        qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", "?")
        return f"{module}.{qual}" if module else qual
    text = repr(fn)
    return text if len(text) <= 500 else text[:497] + "..."


class EvaluationResult:
    """What :func:`shiftguard.evaluate` returns.

    ``results`` is the JSON-able dict written as ``results.json`` (keys documented in
    ``docs/evaluate.md``); ``rows`` has one entry per (model, context, adaptation, head,
    corruption, severity) cell. Rates are fractions in [0, 1] here; reports print them in %.

    Examples:
        >>> res.summary()  # doctest: +SKIP
        >>> res.to_csv("cells.csv"); res.write_report("report/")  # doctest: +SKIP
        >>> res.compare(EvaluationResult.load("runs/baseline"))  # doctest: +SKIP
    """

    def __init__(self, results: dict):
        if not isinstance(results, dict) or "rows" not in results:
            raise TypeError("results: expected the results dict of an evaluation (with 'rows')")
        self.results = results

    # -- views ----------------------------------------------------------------------------------
    @property
    def rows(self) -> list[dict]:
        return self.results["rows"]

    @property
    def aggregates(self) -> list[dict]:
        return self.results["aggregates"]

    @property
    def robustness(self) -> list[dict]:
        return self.results.get("robustness", [])

    @property
    def intervals(self) -> list[dict]:
        return self.results.get("intervals", [])

    @property
    def skipped_heads(self) -> list[dict]:
        return self.results.get("skipped_heads", [])

    def __repr__(self) -> str:
        d = self.results["data"]
        keys = {series_key(r) for r in self.rows}
        return (
            f"EvaluationResult(name={self.results.get('name')!r}, {len(keys)} model/context/adaptation/head, "
            f"{len(d['corruptions'])} corruptions x severities {d['severities']}, n_test={d['n_test']})"
        )

    def summary(self) -> str:
        """The summary table as plain text (rates in %)."""
        from .report import format_summary, summary_rows

        if "summary" not in self.results:
            self.results["summary"] = summary_rows(self.results)
        return format_summary(self.results)

    # -- files ----------------------------------------------------------------------------------
    def to_csv(self, path: Optional[Union[str, Path]] = None) -> str:
        """One line per cell (every metric a column); written atomically to ``path`` when given."""
        from .report import csv_text

        text = csv_text(self.rows)
        if path is not None:
            atomic_write_text(Path(path), text)
        return text

    def to_json(self, path: Optional[Union[str, Path]] = None) -> str:
        """The whole results dict as JSON (non-finite numbers written as null)."""
        text = json.dumps(_finite_json(self.results), indent=1)
        if path is not None:
            atomic_write_text(Path(path), text)
        return text

    def write_report(self, directory: Union[str, Path]) -> Path:
        """``results.json``, ``results.csv``, ``plots/*.png`` and a self-contained ``report.html``
        in ``directory`` (created); returns the path of ``report.html``."""
        from .report import build_report, summary_rows

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if "summary" not in self.results:
            self.results["summary"] = summary_rows(self.results)
        path = build_report(d, self.results)
        self.to_json(d / "results.json")
        return path

    @classmethod
    def load(cls, path: Union[str, Path]) -> "EvaluationResult":
        """From a ``results.json`` file or a folder holding one."""
        p = Path(path)
        if p.is_dir():
            p = p / "results.json"
        if not p.is_file():
            raise FileNotFoundError(f"path: no results.json at {p}")
        try:
            results = json.loads(p.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{p}: not valid JSON ({exc})") from None
        except RecursionError:
            raise ValueError(f"{p}: nested too deeply to be a results file") from None
        if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
            raise ValueError(f"{p}: not a shiftguard results file (no 'rows' list)")
        return cls(results)

    # -- comparison -----------------------------------------------------------------------------
    def compare(
        self, other: "EvaluationResult", *, pairs: Optional[Mapping[str, str]] = None, n_boot: Optional[int] = None
    ) -> dict:
        """Headline numbers of ``self`` minus those of ``other``, series by series.

        Works between any two results (``shiftguard.evaluate``, ``shiftguard evaluate`` or ``shiftguard
        run`` outputs, :meth:`load`). Series are matched by :func:`match_series`: the full key
        (model, context, adaptation, head); when that matches nothing and each side holds one model,
        those two models; or ``pairs={"relu": "qact"}`` mapping ``self``'s model names to ``other``'s.
        Under a model pairing a model without QACT (context ``"none"``) stands against every context
        of the other.

        Returns:
            ``{"deltas": [{"model", "context", "adaptation", "head", "other": {the matched series of
            other}, "<metric>": (self, other, delta), "intervals": {"accuracy_clean" | "mca": (lo, hi)}}],
            "match": the rule used, "intervals": {"method", "level", "n_boot", "seed", "clean",
            "corrupted"}, "protocol_differences": ["field: other's -> self's"]}``. The deltas' intervals
            are paired bootstrap intervals over the test images (:func:`paired_accuracy_intervals`),
            given only where both sides scored the same images (:func:`pairing_problems`);
            ``intervals["clean"]`` / ``["corrupted"]`` say why not otherwise (``None`` when given).
            A non-empty ``protocol_differences`` (data set, suite, corruptions, severities, test
            size, corruption source, seed) means the numbers were not measured the same way.

        Raises:
            TypeError: ``other`` is not an EvaluationResult.
            ValueError: the rule matches no series (the message lists each side's series) or
                ``pairs`` names a model a side does not hold.
        """
        if not isinstance(other, EvaluationResult):
            raise TypeError(f"other: expected an EvaluationResult, got {type(other).__name__}")
        mine, theirs = _headline(self.results), _headline(other.results)
        found, rule = match_series(
            mine, theirs, pairs, names=(self._label("this result"), other._label("the other result"))
        )
        boot = bootstrap_settings(self.results)
        if n_boot is not None:
            if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 10:
                raise ValueError(f"n_boot: expected an integer >= 10, got {n_boot!r}")
            boot["n_boot"] = n_boot
        clean_why, corrupted_why = pairing_problems(
            self.results, other.results, names=("this result", "the other result")
        )
        deltas = []
        for key, okey in found:
            row: dict[str, Any] = {**series_fields(key), "other": series_fields(okey)}
            for metric, v in mine[key].items():
                w = theirs[okey].get(metric)
                row[metric] = (v, w, None if v is None or w is None else v - w)
            ivs = (
                {}
                if clean_why
                else paired_accuracy_intervals(
                    self.results, key, other.results, okey, corrupted=corrupted_why is None, **boot
                )
            )
            row["intervals"] = {m: (lo, hi) for m, (_, lo, hi) in ivs.items()}
            deltas.append(row)
        from .report import protocol_differences

        diffs = [f"{field}: {a!r} -> {b!r}" for field, (a, b) in protocol_differences([other.results, self.results])]
        return {
            "deltas": deltas,
            "match": rule,
            "intervals": {
                "method": "paired percentile bootstrap over the test images of the accuracy difference",
                **boot,
                "clean": clean_why,
                "corrupted": corrupted_why,
            },
            "protocol_differences": diffs,
        }

    def _label(self, fallback: str) -> str:
        name = self.results.get("name")
        return f"{fallback} ({name})" if isinstance(name, str) and name else fallback


def _finite_json(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    return obj
