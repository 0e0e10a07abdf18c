"""Comparing two evaluations: which series stand against which (:func:`match_series`), whether
their accuracies can be compared image by image (:func:`pairing_problems`), and the paired
bootstrap intervals of the differences (:func:`paired_accuracy_intervals`) from the per-image
correctness each result stores (:func:`encode_per_image`, ``results["per_image_correct"]``).
``EvaluationResult.compare`` and ``shiftguard report A B`` use them."""

from __future__ import annotations

import base64
import math
import zlib
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np
import torch

from .aggregate import series_fields, series_key, series_text

__all__ = ["match_series", "pairing_problems", "paired_accuracy_intervals", "bootstrap_settings", "encode_per_image"]


# -- per-image correctness ------------------------------------------------------------------------
#: How ``results["per_image_correct"]`` stores a 0/1 vector: numpy.packbits (big bit order), zlib, base64.
_BITS = "packbits-zlib-base64"


def _pack(t: torch.Tensor) -> str:
    bits = np.packbits(t.detach().to("cpu", torch.bool).numpy().reshape(-1))
    return base64.b64encode(zlib.compress(bits.tobytes(), 9)).decode("ascii")


def _unpack(text: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    n = int(np.prod(shape))
    try:
        raw = np.frombuffer(zlib.decompress(base64.b64decode(text, validate=True)), dtype=np.uint8)
    except (TypeError, ValueError, zlib.error):
        raw = None
    if raw is None or raw.size != (n + 7) // 8:
        raise ValueError(f"per_image_correct: {what} is not {n} packed bits ({_BITS}); the results file is damaged")
    return np.unpackbits(raw, count=n).astype(bool).reshape(shape)


def encode_per_image(per_image: Mapping[tuple, Mapping[str, Any]], cells: Sequence[tuple]) -> dict:
    """``results["per_image_correct"]``: whether each series' prediction was right on each test image,
    clean and on every benchmark corrupted cell, compactly (one bit per image and cell), so that two
    results scored on the same images can be compared image by image (:func:`paired_accuracy_intervals`).

    ``per_image[(model, context, adaptation, head)]`` holds ``clean_correct`` ``(N,)`` and
    ``corrupted_correct`` ``(cells, N)`` (or ``None``), rows in the order of the benchmark
    ``(corruption, severity, group)`` cells of ``cells`` (the order the grid scores them in)."""
    bench = [[c, int(s)] for c, s, g in cells if g == "benchmark" and s]
    series = []
    n = None
    for key, d in per_image.items():
        clean = d.get("clean_correct")
        if clean is None:
            continue
        n = int(clean.numel())
        corrupted = d.get("corrupted_correct")
        if corrupted is not None and tuple(corrupted.shape) != (len(bench), n):
            corrupted = None  # not one row per benchmark cell: not stored rather than stored misaligned
        series.append(
            {**series_fields(key), "clean": _pack(clean), "corrupted": None if corrupted is None else _pack(corrupted)}
        )
    return {
        "format": _BITS,
        "meaning": "1 = the head's prediction is right on that test image",
        "n_test": n,
        "cells": bench,
        "series": series,
    }


def _correct_of(results: dict, key: tuple) -> Optional[tuple[np.ndarray, Optional[np.ndarray], list]]:
    """``(clean (N,), corrupted (cells, N) or None, cells)`` of one series, decoded; ``None`` when
    the results hold no per-image correctness for it."""
    store = results.get("per_image_correct")
    if not _stored(results) or not isinstance(store, dict):
        return None
    n, cells = store["n_test"], [tuple(c) for c in store.get("cells") or []]
    for entry in store.get("series") or []:
        if isinstance(entry, dict) and series_key(entry) == tuple(key):
            what = series_text(series_key(entry))
            clean = _unpack(str(entry.get("clean")), (n,), f"the clean entry of {what}")
            corrupted = (
                _unpack(entry["corrupted"], (len(cells), n), f"the corrupted entry of {what}")
                if entry.get("corrupted")
                else None
            )
            return clean, corrupted, cells
    return None


def _stored(results: dict) -> bool:
    """Whether ``results`` holds per-image correctness in the one format this version reads."""
    store = results.get("per_image_correct")
    return (
        isinstance(store, dict)
        and store.get("format") == _BITS
        and isinstance(store.get("n_test"), int)
        and not isinstance(store.get("n_test"), bool)
        and isinstance(store.get("series"), list)
    )


def _corruption_seed(results: dict):
    seed = (results.get("data") or {}).get("corruption_seed")
    if seed is None and results.get("kind") == "run":  # a run corrupts with its config's corruption_seed
        cfg = results.get("config")
        seed = ((cfg.get("data") or {}) if isinstance(cfg, dict) else {}).get("corruption_seed")
    return seed


def pairing_problems(
    a: dict, b: dict, names: Sequence[str] = ("the first", "the second")
) -> tuple[Optional[str], Optional[str]]:
    """``(clean, corrupted)``: why the accuracies of two results dicts cannot be compared image by
    image, clean and on the corrupted cells; ``None`` where they can.

    Clean pairs need per-image correctness on both sides (``results["per_image_correct"]``) and the
    same test images in the same order (``data.test_sha256``). Corrupted pairs need, in addition, the
    same corrupted images: the same benchmark cells, corrupted by the engine with the same suite,
    seed and shiftguard version (the engine's output is promised for one version), or read from the
    same official corrupted files. Images a caller supplied (``shifted=``) are never paired."""
    for res, name in zip((a, b), names):
        if not _stored(res):
            why = f"{name} holds no per-image correctness (results written by an earlier shiftguard)"
            return why, why
    da, db = a.get("data") or {}, b.get("data") or {}
    ha, hb = da.get("test_sha256"), db.get("test_sha256")
    if ha is None or hb is None:
        why = f"{names[0] if ha is None else names[1]} does not record which test images it scored (data.test_sha256)"
        return why, why
    if ha != hb:
        why = "the test images differ (data.test_sha256), so there are no image pairs"
        return why, why
    src = (da.get("corruption_source"), db.get("corruption_source"))
    cells = [sorted(map(tuple, (r.get("per_image_correct") or {}).get("cells") or [])) for r in (a, b)]
    if src[0] != src[1] or src[0] not in ("engine", "official"):
        return None, (
            f"the corrupted images may differ (corruption sources {src[0]!r} and {src[1]!r}; only the "
            "engine's or the official files are known to be the same)"
        )
    if cells[0] != cells[1] or not cells[0]:
        return None, "the two score different corruption x severity cells"
    if da.get("suite") != db.get("suite"):
        return None, f"the corruption suites differ ({da.get('suite')!r}, {db.get('suite')!r})"
    if src[0] == "engine":
        seeds = (_corruption_seed(a), _corruption_seed(b))
        if seeds[0] is None or seeds[0] != seeds[1]:
            return None, f"the corruption seeds differ or are not recorded ({seeds[0]!r}, {seeds[1]!r})"
        versions = [(r.get("versions") or {}).get("shiftguard") for r in (a, b)]
        if versions[0] is None or versions[0] != versions[1]:
            return None, (
                f"the corruption engine's versions differ or are not recorded ({versions[0]!r}, {versions[1]!r})"
            )
    return None, None


def bootstrap_settings(results: dict) -> dict:
    """``{"n_boot", "level", "seed"}`` of ``results["interval_info"]`` (the resamples its own intervals
    used), each replaced by its default (1000, 0.95, 0) where absent or not a valid number."""
    info = results.get("interval_info")
    info = info if isinstance(info, dict) else {}

    def number(key):
        v = info.get(key)
        return None if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) else v

    n, level, seed = number("n_boot"), number("level"), number("seed")
    return {
        "n_boot": int(n) if n is not None and 1 <= n <= 10**7 else 1000,
        "level": float(level) if level is not None and 0 < level < 1 else 0.95,
        "seed": int(seed) if seed is not None and 0 <= seed < 2**63 else 0,
    }


def paired_accuracy_intervals(
    a: dict,
    a_key: tuple,
    b: dict,
    b_key: tuple,
    *,
    corrupted: bool = True,
    n_boot: int = 1000,
    level: float = 0.95,
    seed: int = 0,
) -> dict[str, tuple]:
    """Paired percentile-bootstrap intervals of accuracy differences, series ``a_key`` of ``a`` minus
    series ``b_key`` of ``b``, on the same test images: ``{"accuracy_clean": (delta, lo, hi),
    "mca": (delta, lo, hi)}`` (``mca``, the mean accuracy over the benchmark corrupted cells, only
    with ``corrupted``). Each resample draws test images with replacement and takes both sides'
    correctness on the same images (every corrupted cell of an image together), so the correlation
    between the two models' errors is kept (Efron & Tibshirani 1993, Ch. 13;
    :func:`shiftguard.metrics.bootstrap_mean_ci`). Call it only where :func:`pairing_problems` finds
    no problem; a series without per-image data gives ``{}``."""
    from shiftguard.metrics import bootstrap_mean_ci

    sa, sb = _correct_of(a, a_key), _correct_of(b, b_key)
    if sa is None or sb is None or sa[0].shape != sb[0].shape:
        return {}
    out = {
        "accuracy_clean": bootstrap_mean_ci(
            torch.from_numpy(sa[0].astype(np.float64) - sb[0]), n_boot=n_boot, level=level, seed=seed
        )
    }
    if corrupted and sa[1] is not None and sb[1] is not None and sorted(sa[2]) == sorted(sb[2]):
        rows = {c: i for i, c in enumerate(sb[2])}
        other = sb[1][[rows[c] for c in sa[2]]]  # b's cells in a's order
        out["mca"] = bootstrap_mean_ci(
            torch.from_numpy(sa[1].astype(np.float64) - other), n_boot=n_boot, level=level, seed=seed
        )
    return out


# -- matching series ------------------------------------------------------------------------------
def _listing(keys: Sequence[tuple], limit: int = 12) -> str:
    shown = [series_text(k) for k in keys[:limit]]
    return ", ".join(shown) + (f" and {len(keys) - limit} more" if len(keys) > limit else "") if shown else "none"


def _models_of(keys: Iterable[tuple]) -> list:
    return list(dict.fromkeys(k[0] for k in keys))


def match_series(
    left: Iterable[tuple],
    right: Iterable[tuple],
    pairs: Optional[Mapping[str, str]] = None,
    *,
    names: Sequence[str] = ("this result", "the other"),
    argument: str = "pairs",
) -> tuple[list[tuple[tuple, tuple]], str]:
    """Which series of two results are compared: ``([(left key, right key)], rule)``; keys are
    ``(model, context, adaptation, head)``.

    The rule:

    1. with ``pairs`` (``{left model: right model}``; a model not named keeps its name), a left
       series matches each right series of the mapped model with the same adaptation arm and head
       whose context is the same, or where either context is ``"none"``: a model without QACT has
       the single context ``"none"`` and stands against every context of a QACT model (a ReLU
       network and its QACT conversion: ``{"relu": "qact"}``);
    2. without ``pairs``, series match on the full key (model, context, adaptation, head);
    3. when the full key matches nothing and each side holds exactly one model, those two models
       are paired as in 1.

    Raises:
        ValueError: ``pairs`` naming a model a side does not hold, or a rule that matches nothing
            (one line listing the series of each side).
    """
    lk, rk = list(dict.fromkeys(map(tuple, left))), list(dict.fromkeys(map(tuple, right)))
    lm, rm = _models_of(lk), _models_of(rk)

    def matched(model_map: Mapping[str, str], any_context: bool) -> list[tuple[tuple, tuple]]:
        return [
            (a, b)
            for a in lk
            for b in rk
            if b[0] == model_map.get(a[0], a[0])
            and a[2:] == b[2:]
            and (a[1] == b[1] or (any_context and "none" in (a[1], b[1])))
        ]

    if pairs is not None:
        if not isinstance(pairs, Mapping):
            raise TypeError(f"{argument}: expected a mapping of model names, got {type(pairs).__name__}")
        for a, b in pairs.items():
            if a not in lm:
                raise ValueError(f"{argument}: {a!r} is not a model of {names[0]} (its models: {', '.join(lm)})")
            if b not in rm:
                raise ValueError(f"{argument}: {b!r} is not a model of {names[1]} (its models: {', '.join(rm)})")
        found = matched(pairs, True)
        rule = "models paired as given (" + ", ".join(f"{a} -> {b}" for a, b in pairs.items()) + ")"
    else:
        found, rule = matched({}, False), "the full series key (model, context, adaptation, head)"
        if not found and len(lm) == 1 and len(rm) == 1:
            found = matched({lm[0]: rm[0]}, True)
            rule = f"the only model of each side ({lm[0]} -> {rm[0]}), contexts 'none' against any"
    if not found:
        a, b = (lm or ["A"])[0], (rm or ["B"])[0]
        example = f"{argument} {a}={b}" if argument.startswith("--") else f"{argument}={{{a!r}: {b!r}}}"
        raise ValueError(
            f"{argument}: no series of {names[0]} matches one of {names[1]} by {rule}; {names[0]} has "
            f"{_listing(lk)}; {names[1]} has {_listing(rk)}; pair models by name, e.g. {example}"
        )
    return found, rule
