"""Percentile bootstrap confidence intervals over the test images (Efron & Tibshirani 1993, Ch. 13).

What the interval means: the model, its training and the corrupted images are held fixed; only the
sample of test images varies. Each of ``n_boot`` resamples draws ``n`` image indices uniformly with
replacement, the statistic is recomputed on the resample, and ``(lo, hi)`` are the
``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the ``n_boot`` replicates (linear
interpolation between order statistics, as ``numpy.percentile``). With the defaults this is "the 95%
percentile bootstrap interval over the test images, 1000 resamples". It does not cover the variation
between training runs.

Several score rows over the same images (``(m, n)`` inputs, e.g. one row per corruption cell of a
corrupted copy of one test set) are resampled jointly: one index set per resample is applied to every
row, so the correlation between cells that share an image is kept in the interval.

Determinism: all draws come from a private ``torch.Generator`` seeded with ``seed`` on the CPU, so the
result depends only on the inputs and ``seed`` (not on the global RNG, which is left untouched). The
indices are drawn in blocks of resamples whose size depends only on ``n`` (``_resample_blocks``); every
function here uses that same stream, so ``bootstrap_mean_ci`` and ``bootstrap_ece_ci`` see exactly
the resamples that ``bootstrap_ci`` passes to its statistic for the same ``seed`` (tested). The stream
is PyTorch's CPU ``randint``, so identical numbers are promised for one PyTorch version.

ECE caveat: the binned plug-in ECE is biased upward (Kumar et al. 2019), and a resample, which repeats
some images and drops others, adds noise inside the absolute values that on average increases it, so
the bootstrap replicates of a well-calibrated model sit mostly above the estimate. The percentile interval
then describes the
spread of the ECE estimator on n images; it is not bias-corrected and can lie wholly above the estimate.

The fast paths turn each resample into counts ``k_i`` (how often image ``i`` was drawn; a
multinomial(n, 1/n) vector) and evaluate the statistic for a block of resamples as one matrix
product ``K @ per_image_sums``; a block holds at most ``_BLOCK_ELEMENTS`` indices, so memory stays
bounded independently of ``n_boot``.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator

import torch

from shiftguard._validation import check_positive, check_tensor
from shiftguard.metrics.calibration import bin_assignments, calibration_error_1d

__all__ = ["bootstrap_ci", "bootstrap_mean_ci", "bootstrap_ece_ci"]

# Index draws per block (int64, 8 MiB); a block of resamples holds max(1, _BLOCK_ELEMENTS // n) rows.
_BLOCK_ELEMENTS = 1 << 20


def _check_common(n_boot, level, seed) -> None:
    check_positive(n_boot, "n_boot", integer=True)
    if isinstance(level, bool) or not isinstance(level, (int, float)) or not 0.0 < float(level) < 1.0:
        raise ValueError(f"level: expected a number strictly between 0 and 1, got {level!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed: expected an int, got {type(seed).__name__}")


def _resample_blocks(n: int, n_boot: int, seed: int) -> Iterator[torch.Tensor]:
    """Yield CPU int64 index blocks ``(rows, n)`` with ``n_boot`` rows in total: row ``b`` is resample ``b``."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = max(1, _BLOCK_ELEMENTS // n)
    done = 0
    while done < n_boot:
        k = min(rows, n_boot - done)
        yield torch.randint(0, n, (k, n), generator=g, dtype=torch.int64)
        done += k


def _counts(idx: torch.Tensor, n: int, device, dtype=torch.float64) -> torch.Tensor:
    """Resampling counts ``(rows, n)``: entry ``[b, i]`` = how often image ``i`` occurs in resample ``b``."""
    idx = idx.to(device)
    return torch.zeros(idx.shape[0], n, dtype=dtype, device=device).scatter_add_(
        1, idx, torch.ones(idx.shape, dtype=dtype, device=device)
    )


def _percentile_interval(replicates: torch.Tensor, level: float) -> tuple[float, float]:
    q = torch.tensor([(1.0 - level) / 2.0, (1.0 + level) / 2.0], dtype=torch.float64)
    lo, hi = torch.quantile(replicates.double().cpu(), q, interpolation="linear")
    return float(lo), float(hi)


def bootstrap_ci(
    statistic: Callable[[torch.Tensor], float], n: int, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Percentile bootstrap interval of any statistic of ``n`` test images.

    Args:
        statistic: called as ``statistic(idx)`` with ``idx`` a CPU LongTensor ``(n,)`` of image
            indices (drawn with replacement); returns a finite number (float or one-element tensor).
        n: number of test images (positive int).
        n_boot: number of resamples; level: coverage in (0, 1); seed: int seed of the draws.

    Returns:
        ``(estimate, lo, hi)`` as Python floats; ``estimate = statistic(arange(n))``.

    Raises:
        TypeError: ``statistic`` is not callable; ``n``, ``n_boot`` or ``seed`` not an int.
        ValueError: ``n`` or ``n_boot`` not positive; ``level`` outside (0, 1); ``statistic`` returned a
            non-finite or non-scalar value (the message names the resample).
    """
    if not callable(statistic):
        raise TypeError(f"statistic: expected a callable, got {type(statistic).__name__}")
    check_positive(n, "n", integer=True)
    _check_common(n_boot, level, seed)

    def call(idx: torch.Tensor, what: str) -> float:
        value = statistic(idx)
        try:
            v = float(value)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"statistic: returned {type(value).__name__} on {what}, expected a number") from None
        if not math.isfinite(v):
            raise ValueError(f"statistic: returned {v} on {what}, expected a finite number")
        return v

    estimate = call(torch.arange(n), "the full sample")
    reps: list[float] = []
    for block in _resample_blocks(n, n_boot, seed):
        for row in block:
            reps.append(call(row, f"resample {len(reps)}"))
    lo, hi = _percentile_interval(torch.tensor(reps, dtype=torch.float64), level)
    return estimate, lo, hi


def _as_rows(x, name: str) -> torch.Tensor:
    """``(n,)`` or ``(m, n)`` input as ``(m, n)``; Python lists become float64 (not the float32 default)."""
    if isinstance(x, (list, tuple)):
        try:
            x = torch.as_tensor(x, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise TypeError(f"{name}: expected a tensor or an array-like of numbers") from exc
    t = check_tensor(x, name, ndim=(1, 2), nonempty=True)
    return t.unsqueeze(0) if t.dim() == 1 else t


def bootstrap_mean_ci(values, *, n_boot: int = 1000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """Percentile bootstrap interval of a mean score over test images, rows resampled jointly.

    Args:
        values: per-image scores ``(n,)`` or ``(m, n)`` (tensor, numpy array or list; real, finite;
            bool allowed), e.g. the 0/1 correctness of every image in each of ``m`` corruption cells.
            The statistic is the mean over rows of each row's mean over images (= the mean of all
            ``m * n`` entries); every resample applies one index set to all rows.
        n_boot, level, seed: as in :func:`bootstrap_ci`.

    Returns:
        ``(estimate, lo, hi)`` as Python floats. Equal, up to float64 rounding, to :func:`bootstrap_ci`
        with ``statistic = lambda idx: values[:, idx].mean()`` and the same ``seed``.

    Raises:
        ValueError: ``values`` not 1-D/2-D, empty or non-finite; bad ``n_boot`` / ``level``.
        TypeError: complex ``values``; ``seed`` not an int.
    """
    v = _as_rows(values, "values")
    if v.is_complex():
        raise TypeError(f"values: expected real scores, got dtype {v.dtype}")
    v = v.detach().to(torch.float64)
    check_tensor(v, "values", finite=True)
    _check_common(n_boot, level, seed)
    m, n = v.shape
    col = v.sum(0)  # (n,): per-image sum over rows
    total = m * n
    estimate = float(col.sum() / total)
    reps = [_counts(block, n, v.device) @ col / total for block in _resample_blocks(n, n_boot, seed)]
    lo, hi = _percentile_interval(torch.cat(reps), level)
    return estimate, lo, hi


def bootstrap_ece_ci(
    confidence, correct, *, n_bins: int = 15, n_boot: int = 1000, level: float = 0.95, seed: int = 0
) -> tuple[float, float, float]:
    """Percentile bootstrap interval of the top-label ECE with equal-width bins, images resampled.

    The ECE is that of :func:`shiftguard.metrics.ece` with ``kind="top-label"``, ``binning="width"``
    (Guo et al. 2017; [NED, Sec. 3.1, eqs. (6)-(7)]) on these confidences: bins ``[e_k, e_{k+1})`` of [0, 1],
    the last closed at 1, ``ECE = sum_k |B_k| / N |acc(B_k) - conf(B_k)| = sum_k |sum_{B_k} (hit - conf)| / N``.
    For a resample with counts ``k_i``, each pair of image ``i`` enters ``k_i`` times, so the per-bin
    sums are count-weighted bincounts and one ``(rows, n) @ (n, n_bins)`` product gives a block of ECEs.

    Args:
        confidence: top-label confidences in [0, 1], ``(n,)`` or ``(m, n)`` (floating).
        correct: whether each top-label prediction is right, same shape (bool or 0/1 values).
            With ``m`` rows the ECE pools all ``m * n`` pairs and the images (columns) are resampled jointly.
        n_bins: number of equal-width bins (positive int).
        n_boot, level, seed: as in :func:`bootstrap_ci`.

    Returns:
        ``(estimate, lo, hi)`` as Python floats; ``estimate`` equals ``ece(...)`` on the same pairs.

    Raises:
        TypeError: ``confidence`` not floating; ``seed`` not an int.
        ValueError: shapes that are not ``(n,)`` / ``(m, n)`` or differ; ``confidence`` outside [0, 1] or
            non-finite; ``correct`` not 0/1; bad ``n_bins`` / ``n_boot`` / ``level``.
    """
    conf = _as_rows(confidence, "confidence")
    if not conf.is_floating_point():
        raise TypeError(f"confidence: expected a floating-point tensor, got dtype {conf.dtype}")
    check_tensor(conf, "confidence", finite=True)
    if float(conf.min()) < 0.0 or float(conf.max()) > 1.0:
        raise ValueError("confidence: values must lie in [0, 1]")
    hit = _as_rows(correct, "correct")
    if tuple(hit.shape) != tuple(conf.shape):
        raise ValueError(f"correct: expected the shape of confidence {tuple(conf.shape)}, got {tuple(hit.shape)}")
    if hit.dtype != torch.bool:
        if hit.is_complex() or not bool(((hit == 0) | (hit == 1)).all()):
            raise ValueError("correct: expected booleans or 0/1 values")
    check_positive(n_bins, "n_bins", integer=True)
    _check_common(n_boot, level, seed)

    conf = conf.detach().to(torch.float64)
    hit = hit.detach().to(conf.device, torch.float64)
    m, n = conf.shape
    flat_conf, flat_hit = conf.reshape(-1), hit.reshape(-1)
    estimate = calibration_error_1d(flat_conf, flat_hit, n_bins, "width")
    bins, _ = bin_assignments(flat_conf, n_bins, "width")
    image = torch.arange(n, device=conf.device).repeat(m)  # image of each flattened pair
    # gap[i, k] = sum over the pairs of image i that fall in bin k of (hit - conf).
    gap = (
        torch.zeros(n * n_bins, dtype=torch.float64, device=conf.device)
        .index_add_(0, image * n_bins + bins, flat_hit - flat_conf)
        .reshape(n, n_bins)
    )
    total = m * n
    reps = [(_counts(block, n, conf.device) @ gap).abs().sum(1) / total for block in _resample_blocks(n, n_boot, seed)]
    lo, hi = _percentile_interval(torch.cat(reps), level)
    return estimate, lo, hi
