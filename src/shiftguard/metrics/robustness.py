"""Corruption-robustness summaries: mean corruption accuracy, corruption error (CE / mCE) and relative mCE.

Definitions:
- mean corruption accuracy: the plain mean of the accuracies over all (corruption, severity) cells,
  robustbench's summary for CIFAR-10-C / ImageNet-C (15 corruptions x 5 severities; Croce et al. 2021,
  "RobustBench"). The cells must form a complete corruptions x severities grid, so that every
  corruption and every severity carries the same weight.
- corruption error (Hendrycks & Dietterich 2019, "Benchmarking neural network robustness to common
  corruptions and perturbations", ICLR, the ImageNet-C metric): with ``E^f_{s,c}`` the error rate of classifier ``f`` on
  corruption ``c`` at severity ``s``, ``CE^f_c = sum_s E^f_{s,c} / sum_s E^base_{s,c}`` and
  ``mCE = mean_c CE^f_c``. Hendrycks & Dietterich normalise by AlexNet; here the baseline is whatever
  the caller passes (no constants are built in).
- relative corruption error (same paper, next to CE): ``rCE^f_c = sum_s (E^f_{s,c} - E^f_clean) /
  sum_s (E^base_{s,c} - E^base_clean)``, relative mCE their mean over corruptions. The paper writes the
  clean error next to the sum without brackets; the reading used here subtracts it once per severity
  (``sum_s E_{s,c} - S E_clean`` for S severities), the scale on which the degradation is compared.

Undefined ratios: a corruption on which the baseline never errs (``sum_s E^base_{s,c} = 0``), or, for
the relative form, on which the baseline is no worse than on clean data (denominator ``<= 0``), has no
corruption error. Its entry is ``None`` (never inf or NaN), and the mean over corruptions is then
``None`` too: a mean over the remaining corruptions would silently re-weight the benchmark. A
negative relative denominator is treated as undefined as well, since dividing by it flips the sign of
the comparison.

Inputs are error rates / accuracies in [0, 1] (not percentages); anything outside, non-finite or
missing raises a ``ValueError`` naming the argument and the cell.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Hashable, Optional, Union

import torch

from shiftguard._validation import as_tensor

__all__ = ["mean_corruption_accuracy", "corruption_errors"]


def _cell_value(value, name: str, cell=None) -> float:
    """One value as a float in [0, 1]; ``TypeError`` / ``ValueError`` naming ``name`` (and the cell)."""
    where = name if cell is None else f"{name}: cell {cell!r}"
    if isinstance(value, bool):
        raise TypeError(f"{where} is a bool, expected a number in [0, 1]")
    if isinstance(value, (int, float)):
        v = float(value)  # Python numbers stay float64 (a tensor would default to float32)
    else:
        try:
            t = as_tensor(value, name)
        except TypeError:
            raise TypeError(f"{where} is not a number ({type(value).__name__})") from None
        if t.dim() != 0:
            raise ValueError(f"{where} should be one number, got shape {tuple(t.shape)}")
        if t.dtype == torch.bool or t.is_complex():
            raise TypeError(f"{where} has dtype {t.dtype}, expected a real number")
        v = float(t.reshape(()))
    if not math.isfinite(v):
        raise ValueError(f"{where} is not finite ({v})")
    if not 0.0 <= v <= 1.0:
        raise ValueError(f"{where} = {v} lies outside [0, 1] (rates, not percentages)")
    return v


def _cells(x, name: str) -> dict[tuple[Hashable, Hashable], float]:
    """Parse ``{(corruption, severity): v}`` or ``{corruption: [v by severity 1, 2, ...]}`` into cells.

    Returns an insertion-ordered dict ``{(corruption, severity): float}``; raises ``TypeError`` for
    other types or a mapping that mixes both forms, ``ValueError`` for an empty mapping or a bad cell.
    """
    if not isinstance(x, Mapping):
        raise TypeError(
            f"{name}: expected a mapping {{(corruption, severity): value}} or "
            f"{{corruption: [values by severity]}}, got {type(x).__name__}"
        )
    if len(x) == 0:
        raise ValueError(f"{name}: expected at least one cell, got an empty mapping")
    cells: dict[tuple[Hashable, Hashable], float] = {}
    forms = set()
    for key, value in x.items():
        seq: Union[list, tuple, torch.Tensor, None] = value if isinstance(value, (list, tuple)) else None
        if seq is None and not isinstance(value, (int, float, bool)):
            t = as_tensor(value, f"{name}[{key!r}]") if not isinstance(value, (str, bytes)) else None
            if t is None:
                raise TypeError(f"{name}: value for {key!r} is not a number ({type(value).__name__})")
            if t.dim() == 1:
                seq = t
            elif t.dim() > 1:
                raise ValueError(
                    f"{name}: value for {key!r} should be a number or a 1-D sequence, got shape {tuple(t.shape)}"
                )
        if seq is not None:
            forms.add("sequence")
            if len(seq) == 0:
                raise ValueError(f"{name}: corruption {key!r} has no severities")
            for s, v in enumerate(seq, start=1):
                cells[(key, s)] = _cell_value(v, name, (key, s))
        else:
            forms.add("cell")
            if not (isinstance(key, tuple) and len(key) == 2):
                raise TypeError(f"{name}: key {key!r} of a single value should be a (corruption, severity) pair")
            cells[key] = _cell_value(value, name, key)
    if len(forms) > 1:
        raise TypeError(f"{name}: mixes {{(corruption, severity): value}} and {{corruption: [values]}} entries")
    return cells


def _group(cells: dict) -> dict[Hashable, dict[Hashable, float]]:
    """``{(c, s): v}`` -> ``{c: {s: v}}`` keeping first-appearance order."""
    out: dict[Hashable, dict[Hashable, float]] = {}
    for (c, s), v in cells.items():
        out.setdefault(c, {})[s] = v
    return out


def _format_cells(cells, limit: int = 8) -> str:
    items = [repr(c) for c in cells]
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more


def mean_corruption_accuracy(accuracy) -> float:
    """Plain mean of the accuracies over all (corruption, severity) cells (robustbench's convention).

    Args:
        accuracy: a mapping ``{(corruption, severity): acc}`` or ``{corruption: [acc by severity]}``,
            or a ``(n_corruptions, n_severities)`` tensor / numpy array; accuracies in [0, 1].

    Returns:
        The mean over the cells as a Python float.

    Raises:
        TypeError: ``accuracy`` is neither a mapping nor a 2-D array of real numbers.
        ValueError: an empty input; a non-finite cell or one outside [0, 1] (the message names the
            cell); a mapping whose cells do not form a complete corruptions x severities grid (the
            message lists the missing cells).
    """
    if isinstance(accuracy, Mapping):
        by_c = _group(_cells(accuracy, "accuracy"))
        severities = list(dict.fromkeys(s for sev in by_c.values() for s in sev))
        missing = [(c, s) for c in by_c for s in severities if s not in by_c[c]]
        if missing:
            raise ValueError(
                f"accuracy: the cells do not form a complete corruptions x severities grid; "
                f"missing {_format_cells(missing)}"
            )
        values = [v for sev in by_c.values() for v in sev.values()]
        return math.fsum(values) / len(values)
    if isinstance(accuracy, (list, tuple)):
        try:  # Python floats are float64; the default tensor dtype would round them to float32
            accuracy = torch.as_tensor(accuracy, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError("accuracy: expected a mapping or a 2-D array of numbers") from exc
    t = as_tensor(accuracy, "accuracy")
    if t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"accuracy: expected real accuracies, got dtype {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"accuracy: expected shape (n_corruptions, n_severities), got {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"accuracy: expected at least one cell, got shape {tuple(t.shape)}")
    t = t.detach().to("cpu", torch.float64)
    bad = ~torch.isfinite(t) | (t < 0) | (t > 1)
    if bool(bad.any()):
        i, j = (int(k) for k in bad.nonzero()[0])
        raise ValueError(
            f"accuracy: cell (corruption {i}, severity index {j}) = {float(t[i, j])} is not a finite value in [0, 1]"
        )
    return float(t.mean())


def _ratio(num: float, den: float) -> Optional[float]:
    return num / den if den > 0 else None


def _mean_or_none(values) -> Optional[float]:
    values = list(values)
    return None if any(v is None for v in values) else math.fsum(values) / len(values)


def corruption_errors(errors, baseline_errors, *, clean_error=None, baseline_clean_error=None) -> dict[str, Any]:
    """Corruption errors and mCE of a classifier against a baseline (Hendrycks & Dietterich 2019).

    Args:
        errors: error rates in [0, 1] of the evaluated classifier, as ``{(corruption, severity): error}``
            or ``{corruption: [error by severity]}`` (severities then numbered 1, 2, ...).
        baseline_errors: the baseline's error rates on the same cells, in either form.
        clean_error, baseline_clean_error: clean-data error rates in [0, 1]; give both for the
            relative form, or neither.

    Returns:
        ``{"ce": {corruption: CE or None}, "mce": float or None}``, plus ``"relative_ce"`` and
        ``"relative_mce"`` when both clean errors are given. Corruptions keep their order in ``errors``.
        ``None`` marks an undefined ratio (a baseline never wrong on the corruption, or for the
        relative form a baseline no worse than clean); a mean over corruptions is ``None`` when any of
        its terms is (module docstring).

    Raises:
        TypeError: an argument of the wrong type, or a mapping that mixes both forms.
        ValueError: a non-finite value or one outside [0, 1] (naming the argument and cell); cells that
            differ between ``errors`` and ``baseline_errors`` (listed); only one clean error given.
    """
    cells = _cells(errors, "errors")
    base = _cells(baseline_errors, "baseline_errors")
    only_f = [k for k in cells if k not in base]
    only_b = [k for k in base if k not in cells]
    if only_f or only_b:
        parts = []
        if only_f:
            parts.append(f"only in errors: {_format_cells(only_f)}")
        if only_b:
            parts.append(f"only in baseline_errors: {_format_cells(only_b)}")
        raise ValueError(
            "errors, baseline_errors: must cover the same (corruption, severity) cells; " + "; ".join(parts)
        )
    if (clean_error is None) != (baseline_clean_error is None):
        missing = "baseline_clean_error" if baseline_clean_error is None else "clean_error"
        raise ValueError(f"{missing}: the relative CE needs both clean_error and baseline_clean_error")

    by_c, base_c = _group(cells), _group(base)
    ce = {c: _ratio(math.fsum(sev.values()), math.fsum(base_c[c].values())) for c, sev in by_c.items()}
    out: dict[str, Any] = {"ce": ce, "mce": _mean_or_none(ce.values())}
    if clean_error is not None:
        e_clean = _cell_value(clean_error, "clean_error")
        b_clean = _cell_value(baseline_clean_error, "baseline_clean_error")
        rce = {
            c: _ratio(math.fsum(v - e_clean for v in sev.values()), math.fsum(base_c[c][s] - b_clean for s in sev))
            for c, sev in by_c.items()
        }
        out["relative_ce"] = rce
        out["relative_mce"] = _mean_or_none(rce.values())
    return out
